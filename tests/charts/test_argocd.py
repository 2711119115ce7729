"""Argo CD: the example Application, and the InferenceModel health check (Lua 5.1, as Argo CD runs it)
against statuses the operator computes (operator/status.py) and statuses captured from the e2e cluster."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from kvpilot.api.models import InferenceModel
from kvpilot.operator.podstate import PodProblem
from kvpilot.operator.rolestatus import compute_roles_status
from kvpilot.operator.status import compute_status, invalid_status
from tests.charts.lua_health import HEALTH_DIR, health
from tests.charts.tools import ROOT

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_example_applications() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "argocd-application.yaml").read_text()) if d]
    apps = {d["metadata"]["name"]: d for d in docs}
    assert {d["kind"] for d in docs} == {"Application"}
    chart_app, models_app = apps["kvpilot"], apps["kvpilot-models"]
    assert chart_app["spec"]["source"]["path"] == "charts/kvpilot"
    assert (
        chart_app["spec"]["source"]["targetRevision"]
        == "v" + yaml.safe_load((ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text())["appVersion"]
    )
    wave = "argocd.argoproj.io/sync-wave"
    assert int(chart_app["metadata"]["annotations"][wave]) < int(models_app["metadata"]["annotations"][wave])
    assert {
        "group": "kvpilot.dev",
        "kind": "InferenceModel",
        "jsonPointers": ["/spec/replicas"],
    } in models_app["spec"]["ignoreDifferences"]
    options = models_app["spec"]["syncPolicy"]["syncOptions"]
    for option in (
        "ServerSideApply=true",
        "RespectIgnoreDifferences=true",
        "SkipDryRunOnMissingResource=true",
    ):
        assert option in options
    assert "ServerSideApply=true" in chart_app["spec"]["syncPolicy"]["syncOptions"]
    # the chart values in the Application are valid chart values
    import json

    import jsonschema

    schema = json.loads((ROOT / "charts" / "kvpilot" / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(chart_app["spec"]["source"]["helm"]["valuesObject"])


# -- statuses from operator/status.py ------------------------------------------------------------------


def im(generation: int = 1, **spec: Any) -> InferenceModel:
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": generation},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }
    return InferenceModel.model_validate(body)


def deployment(
    replicas: int, ready: int, updated: int | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    status = {
        "replicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "updatedReplicas": replicas if updated is None else updated,
        "observedGeneration": 1,
        **(extra or {}),
    }
    return {"metadata": {"name": "llama", "generation": 1}, "status": status}


def obj_for(model: InferenceModel, status: dict[str, Any], generation: int | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {
            "name": model.name,
            "namespace": model.namespace,
            "generation": generation or model.generation,
        },
        "spec": {},
        "status": status,
    }


def problem(reason: str, pod: str = "llama-abc") -> PodProblem:
    return PodProblem(pod=pod, reason=reason, message=f"pod {pod}: {reason}")


DEADLINE = {
    "conditions": [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "too slow",
        }
    ]
}

SCENARIOS: list[tuple[str, InferenceModel, dict[str, Any] | None, list[PodProblem], str, str]] = [
    ("creating", im(replicas=1), None, [], "Progressing", "Creating"),
    ("loading", im(replicas=2), deployment(2, 0), [], "Progressing", "NoReplicaReady"),
    ("serving", im(replicas=2), deployment(2, 2), [], "Healthy", "Serving"),
    ("scaling up", im(replicas=3), deployment(2, 2), [], "Progressing", "Scaling"),
    ("rolling out", im(replicas=2), deployment(2, 2, updated=1), [], "Progressing", "RollingOut"),
    ("scaled to zero", im(replicas=0), deployment(0, 0), [], "Suspended", "ScaledToZero"),
    ("oom killed", im(replicas=1), deployment(1, 0), [problem("OOMKilled")], "Degraded", "OOMKilled"),
    (
        "crash loop",
        im(replicas=1),
        deployment(1, 1),
        [problem("CrashLoopBackOff")],
        "Degraded",
        "CrashLoopBackOff",
    ),
    (
        "image pull",
        im(replicas=1),
        deployment(1, 0),
        [problem("ImagePullBackOff")],
        "Degraded",
        "ImagePullBackOff",
    ),
    (
        "no gpu anywhere",
        im(replicas=1),
        deployment(1, 0),
        [problem("Unschedulable")],
        "Progressing",
        "Unschedulable",
    ),
    (
        "some replicas unplaceable",
        im(replicas=3),
        deployment(3, 2),
        [problem("Unschedulable", "llama-xyz")],
        "Healthy",
        "Unschedulable",
    ),
    (
        "deadline",
        im(replicas=1),
        deployment(1, 0, extra=DEADLINE),
        [],
        "Degraded",
        "ProgressDeadlineExceeded",
    ),
]


@pytest.mark.parametrize(
    ("model", "dep", "problems", "expected", "reason"),
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_health_of_operator_statuses(
    model: InferenceModel, dep: dict[str, Any] | None, problems: list[PodProblem], expected: str, reason: str
) -> None:
    status = compute_status(model, dep, problems, now=NOW)
    result = health(obj_for(model, status))
    assert result["status"] == expected, (result, status["conditions"])
    assert reason in result["message"]


PD = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}


@pytest.mark.parametrize(
    ("disaggregation", "prefill", "decode", "expected", "reason"),
    [
        (PD, (1, 1), (1, 1), "Healthy", "prefill 1/1, decode 1/1 replicas ready"),
        (PD, (1, 1), (1, 0), "Progressing", "decode: 0/1 replicas ready"),  # one role is not enough
        (
            {"prefill": {"replicas": 0}, "decode": {"replicas": 1}},
            (0, 0),
            (1, 1),
            "Suspended",
            "RoleScaledToZero",
        ),
        (
            {"prefill": {"replicas": 0}, "decode": {"replicas": 0}},
            (0, 0),
            (0, 0),
            "Suspended",
            "ScaledToZero",
        ),
    ],
)
def test_health_of_a_disaggregated_model(
    disaggregation: dict[str, Any],
    prefill: tuple[int, int],
    decode: tuple[int, int],
    expected: str,
    reason: str,
) -> None:
    model = im(disaggregation=disaggregation)
    status = compute_roles_status(
        model, {"prefill": deployment(*prefill), "decode": deployment(*decode)}, {}, now=NOW
    )
    result = health(obj_for(model, status))
    assert result["status"] == expected, (result, status["conditions"])
    assert reason in result["message"]


def test_invalid_spec_is_degraded() -> None:
    status = invalid_status("llama", "ml", 3, "spec.runtime.maxModelLen: too large", now=NOW, previous=None)
    result = health(obj_for(im(generation=3), status))
    assert result == {
        "status": "Degraded",
        "message": "InvalidSpec: spec is invalid: spec.runtime.maxModelLen: too large",
    }


def test_unobserved_generation_is_progressing() -> None:
    model = im(replicas=2)
    status = compute_status(model, deployment(2, 2), [], now=NOW)
    result = health(obj_for(model, status, generation=2))
    assert result == {
        "status": "Progressing",
        "message": "Waiting for the kvpilot operator to observe generation 2",
    }


def test_no_status_yet() -> None:
    assert health({"metadata": {"generation": 1}, "spec": {}})["status"] == "Progressing"
    assert health({"metadata": {"generation": 1}, "status": {"conditions": []}})["status"] == "Progressing"


def test_script_cannot_reach_the_host() -> None:
    """The sandbox in these tests has no os/io, as in Argo CD; the script must not need them."""
    assert "os." not in (HEALTH_DIR / "health.lua").read_text()
    assert "io." not in (HEALTH_DIR / "health.lua").read_text()


# -- Argo CD's own test layout: health_test.yaml over testdata/ (captured from the e2e cluster) ---------


def health_cases() -> list[dict[str, Any]]:
    data = yaml.safe_load((HEALTH_DIR / "health_test.yaml").read_text())
    return list(data["tests"])


@pytest.mark.parametrize("case", health_cases(), ids=lambda c: c["inputPath"])
def test_health_test_yaml(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((HEALTH_DIR / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]
