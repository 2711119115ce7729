"""The resource paths the Kubernetes adapter builds for the kinds the operator reads and writes."""

from __future__ import annotations

import pytest

from kvpilot.kube.client import kind_of


@pytest.mark.parametrize(
    ("api_version", "kind", "path"),
    [
        ("v1", "Secret", "/api/v1/namespaces/ml/secrets/rt"),  # the runtime API key (adapters)
        ("apps/v1", "Deployment", "/apis/apps/v1/namespaces/ml/deployments/rt"),
        (
            "kvpilot.dev/v1alpha1",
            "InferenceModel",
            "/apis/kvpilot.dev/v1alpha1/namespaces/ml/inferencemodels/rt",
        ),
    ],
)
def test_kind_paths(api_version: str, kind: str, path: str) -> None:
    assert kind_of(api_version, kind).path("ml", "rt") == path


def test_an_unknown_kind_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        kind_of("v1", "Node")
