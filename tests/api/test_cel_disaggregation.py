"""spec.disaggregation's CEL rules, evaluated with cel-python, and the operator's Python mirror of them."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.api import disaggregation as pd
from kvpilot.api.models import InferenceModelSpec
from tests.api.test_cel import BUILTIN, check

AUTO = {"minReplicas": 1, "maxReplicas": 8}

VALID: list[dict[str, Any]] = [
    {"model": BUILTIN, "disaggregation": {}},
    {"model": BUILTIN, "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}},
    {"model": BUILTIN, "disaggregation": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}},
    {
        "model": BUILTIN,
        "autoscaling": AUTO,
        "disaggregation": {"prefill": {"maxReplicas": 2}, "decode": {"minReplicas": 2, "maxReplicas": 6}},
    },
    {
        "model": BUILTIN,
        "resources": {"gpus": 1, "memory": "64Gi"},
        "runtime": {"tensorParallelSize": 1, "blockSize": 16, "kvCacheDtype": "fp8"},
        "disaggregation": {
            "prefill": {
                "resources": {"gpus": 1, "gpuType": "h100"},
                "runtime": {"maxNumBatchedTokens": 8192, "maxNumSeqs": 8},
            },
            "decode": {"resources": {"gpuType": "l40s", "memory": "32Gi"}, "runtime": {"maxNumSeqs": 256}},
            "minPromptTokens": 1024,
            "transferTimeoutSeconds": 5,
        },
    },
    # each tensor-parallel rank transfers its own shard (docs/disaggregation.md)
    {"model": BUILTIN, "resources": {"gpus": 2}, "disaggregation": {}},
]

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"model": BUILTIN, "replicas": 2, "disaggregation": {}}, pd.REPLICAS_HELP),
    (
        {"model": BUILTIN, "disaggregation": {"decode": {"minReplicas": 1, "maxReplicas": 4}}},
        pd.bounds_without_autoscaling_help("decode"),
    ),
    (
        {
            "model": BUILTIN,
            "autoscaling": AUTO,
            "disaggregation": {"prefill": {"minReplicas": 5, "maxReplicas": 3}},
        },
        pd.min_max_help("prefill"),
    ),
    (  # the role's minReplicas over spec.autoscaling's maxReplicas
        {"model": BUILTIN, "autoscaling": AUTO, "disaggregation": {"decode": {"minReplicas": 9}}},
        pd.min_max_help("decode"),
    ),
    (
        {"model": BUILTIN, "disaggregation": {"prefill": {"runtime": {"blockSize": 32}}}},
        pd.kv_layout_help("prefill"),
    ),
    (
        {"model": BUILTIN, "disaggregation": {"decode": {"runtime": {"kvCacheDtype": "int8"}}}},
        pd.kv_layout_help("decode"),
    ),
    (
        {"model": BUILTIN, "disaggregation": {"decode": {"runtime": {"tensorParallelSize": 2}}}},
        pd.kv_layout_help("decode"),
    ),
    (
        {
            "model": BUILTIN,
            "resources": {"gpus": 1},
            "disaggregation": {"prefill": {"resources": {"gpus": 2}}},
        },
        pd.gpus_help("prefill"),
    ),
    (  # a CPU decode pool behind a GPU prefill pool
        {"model": BUILTIN, "disaggregation": {"decode": {"resources": {"gpus": 0}}}},
        pd.gpus_help("decode"),
    ),
    (
        {"model": BUILTIN, "autoscaling": AUTO, "disaggregation": {"prefill": {"replicas": 2}}},
        pd.replicas_at_create_help("prefill"),
    ),
]


@pytest.mark.parametrize("spec", VALID)
def test_valid_disaggregated_specs_pass(spec: dict[str, Any]) -> None:
    assert check(spec) == []
    assert InferenceModelSpec.model_validate(spec).check() == []


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_invalid_combinations_get_their_message(spec: dict[str, Any], message: str) -> None:
    assert check(spec) == [message]


@pytest.mark.parametrize(("spec", "message"), [c for c in INVALID if "created" not in c[1]])
def test_operator_mirror_says_the_same(spec: dict[str, Any], message: str) -> None:
    assert InferenceModelSpec.model_validate(spec).check() == [message]


@pytest.mark.parametrize("role", pd.ROLES)
def test_every_message_names_its_field_and_the_fix(role: str) -> None:
    for help_of in (
        pd.bounds_without_autoscaling_help,
        pd.min_max_help,
        pd.kv_layout_help,
        pd.gpus_help,
        pd.replicas_at_create_help,
        pd.replicas_in_bounds_help,
    ):
        message = help_of(role)
        assert message.startswith(f"spec.disaggregation.{role}.") and ": " in message, message


def test_autoscaler_writes_role_replicas_within_bounds() -> None:
    """One merge patch of both roles' replicas is an update: allowed within the bounds, refused outside."""
    old = {"model": BUILTIN, "autoscaling": AUTO, "disaggregation": {"decode": {"maxReplicas": 4}}}
    ok = {**old, "disaggregation": {"prefill": {"replicas": 3}, "decode": {"replicas": 4, "maxReplicas": 4}}}
    assert check(ok, old=old) == []
    over = {
        **old,
        "disaggregation": {"prefill": {"replicas": 3}, "decode": {"replicas": 5, "maxReplicas": 4}},
    }
    assert check(over, old=old) == [pd.replicas_in_bounds_help("decode")]


def test_lowering_a_role_max_below_its_replicas_is_allowed() -> None:
    """Ratcheting, as for spec.replicas: the operator clamps and the autoscaler follows."""
    old = {"model": BUILTIN, "autoscaling": AUTO, "disaggregation": {"decode": {"replicas": 6}}}
    new = {
        "model": BUILTIN,
        "autoscaling": AUTO,
        "disaggregation": {"decode": {"replicas": 6, "maxReplicas": 4}},
    }
    assert check(new, old=old) == []


def test_switching_an_aggregated_model_needs_replicas_removed() -> None:
    old = {"model": BUILTIN, "replicas": 2}
    assert check({**old, "disaggregation": {}}, old=old) == [pd.REPLICAS_HELP]
    assert check({"model": BUILTIN, "disaggregation": {}}, old=old) == []


def test_role_values_merge_over_spec() -> None:
    spec = InferenceModelSpec.model_validate(VALID[4])
    prefill, decode = pd.role_spec(spec, "prefill"), pd.role_spec(spec, "decode")
    assert prefill.resources.dump() == {"gpus": 1, "gpuType": "h100", "memory": "64Gi"}
    assert decode.resources.dump() == {"gpus": 1, "gpuType": "l40s", "memory": "32Gi"}
    assert prefill.runtime.dump() == {
        "blockSize": 16,
        "kvCacheDtype": "fp8",
        "tensorParallelSize": 1,
        "maxNumSeqs": 8,
        "maxNumBatchedTokens": 8192,
    }
    assert decode.runtime.max_num_seqs == 256 and decode.runtime.max_num_batched_tokens is None
    assert prefill.disaggregation is None and prefill.autoscaling is None


@pytest.mark.parametrize(
    ("autoscaling", "role", "want"),
    [
        (None, {}, 1),
        (None, {"replicas": 3}, 3),
        (None, {"replicas": 0}, 0),
        (AUTO, {}, 1),  # spec.autoscaling's minReplicas
        (AUTO, {"minReplicas": 2}, 2),
        (AUTO, {"replicas": 12}, 8),  # clamped to spec.autoscaling's maxReplicas
        (AUTO, {"replicas": 5, "maxReplicas": 3}, 3),
        ({"minReplicas": 0, "maxReplicas": 4}, {}, 0),  # scale from zero
    ],
)
def test_role_replicas(autoscaling: dict[str, Any] | None, role: dict[str, Any], want: int) -> None:
    spec: dict[str, Any] = {"model": BUILTIN, "disaggregation": {"decode": role}}
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    assert pd.role_replicas(InferenceModelSpec.model_validate(spec), "decode") == want
