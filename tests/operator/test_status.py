"""Status computed purely from Deployment and pod dicts (table tests)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvpilot.api.models import InferenceModel
from kvpilot.operator.podstate import all_problems, fetching, pod_problems
from kvpilot.operator.status import (
    compute_conditions,
    compute_status,
    condition_events,
    invalid_status,
    merge_conditions,
    status_patch,
)
from tests.operator.fakes import make_body

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
T = "2026-01-01T11:59:00Z"


def im(**spec: Any) -> InferenceModel:
    return InferenceModel.model_validate(make_body(**spec))


def deployment(
    replicas: int = 1,
    ready: int = 0,
    updated: int | None = None,
    available: int | None = None,
    generation: int = 1,
    observed: int = 1,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "availableReplicas": ready if available is None else available,
            "observedGeneration": observed,
            "conditions": conditions or [],
        },
    }


def pod(name: str = "llama-abc", chash: str = "h1", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {"kvpilot.dev/config-hash": chash}}, "status": status}


UNSCHEDULABLE = pod(
    conditions=[
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
        }
    ]
)
OOM_LOOP = pod(
    containerStatuses=[
        {
            "name": "kvpilot",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137, "finishedAt": T}},
        }
    ]
)
GPU_OOM = pod(
    containerStatuses=[
        {
            "name": "kvpilot",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {
                "terminated": {
                    "reason": "Error",
                    "exitCode": 1,
                    "finishedAt": T,
                    "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
                }
            },
        }
    ]
)
CRASH = pod(
    containerStatuses=[
        {
            "name": "kvpilot",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"reason": "Error", "exitCode": 2, "message": "bad flag --foo"}},
        }
    ]
)
PULL = pod(
    containerStatuses=[
        {"name": "kvpilot", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}
    ]
)
OLD_OOM = pod(
    containerStatuses=[
        {
            "name": "kvpilot",
            "state": {"running": {}},
            "lastState": {
                "terminated": {"reason": "OOMKilled", "exitCode": 137, "finishedAt": "2026-01-01T10:00:00Z"}
            },
        }
    ]
)


def conds(
    model: InferenceModel, dep: dict[str, Any] | None, pods: list[dict[str, Any]]
) -> dict[str, tuple[bool, str, str]]:
    return {
        c.type: (c.status, c.reason, c.message)
        for c in compute_conditions(model, dep, all_problems(pods, NOW))
    }


@pytest.mark.parametrize(
    ("spec", "dep", "pods", "expect"),
    [
        ({}, None, [], {"Ready": (False, "Creating"), "Progressing": (True, "Creating")}),
        (
            {},
            deployment(1, 0),
            [],
            {"Ready": (False, "NoReplicaReady"), "Progressing": (True, "WaitingForReplicas")},
        ),
        (
            {},
            deployment(1, 1),
            [],
            {
                "Ready": (True, "Serving"),
                "Progressing": (False, "RolloutComplete"),
                "Degraded": (False, "AsExpected"),
                "ScalingLimited": (False, "AsExpected"),
            },
        ),
        (
            {"replicas": 3},
            deployment(1, 1),
            [],
            {"Ready": (True, "Serving"), "Progressing": (True, "Scaling")},
        ),
        ({"replicas": 2}, deployment(2, 2, updated=1), [], {"Progressing": (True, "RollingOut")}),
        (
            {"replicas": 2},
            deployment(2, 2, generation=2, observed=1),
            [],
            {"Progressing": (True, "RollingOut")},
        ),
        (
            {"replicas": 0},
            deployment(0, 0),
            [],
            {"Ready": (False, "ScaledToZero"), "Progressing": (False, "RolloutComplete")},
        ),
        (
            {},
            deployment(1, 0),
            [UNSCHEDULABLE],
            {"ScalingLimited": (True, "Unschedulable"), "Degraded": (False, "AsExpected")},
        ),
        ({}, deployment(1, 0), [OOM_LOOP], {"Degraded": (True, "OOMKilled")}),
        ({}, deployment(1, 0), [GPU_OOM], {"Degraded": (True, "OOMKilled")}),
        ({}, deployment(1, 0), [CRASH], {"Degraded": (True, "CrashLoopBackOff")}),
        ({}, deployment(1, 0), [PULL], {"Degraded": (True, "ImagePullBackOff")}),
        ({}, deployment(1, 1), [OLD_OOM], {"Degraded": (False, "AsExpected")}),  # long ago, recovered
        ({}, deployment(1, 0), [CRASH, OOM_LOOP], {"Degraded": (True, "OOMKilled")}),  # OOM wins
        (
            {},
            deployment(
                1,
                0,
                conditions=[
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": "ReplicaSet has timed out progressing.",
                    }
                ],
            ),
            [],
            {
                "Progressing": (False, "ProgressDeadlineExceeded"),
                "Degraded": (True, "ProgressDeadlineExceeded"),
            },
        ),
        (
            {},
            deployment(
                1,
                0,
                conditions=[
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": "exceeded quota: gpus",
                    }
                ],
            ),
            [],
            {"ScalingLimited": (True, "FailedCreate")},
        ),
    ],
)
def test_conditions(
    spec: dict[str, Any],
    dep: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    expect: dict[str, tuple[bool, str]],
) -> None:
    got = conds(im(**spec), dep, pods)
    for ctype, (status, reason) in expect.items():
        assert got[ctype][:2] == (status, reason), (ctype, got[ctype])


def test_unschedulable_message_carries_the_scheduler_message() -> None:
    _, _, message = conds(im(), deployment(1, 0), [UNSCHEDULABLE])["ScalingLimited"]
    assert message == "1 pod cannot be scheduled: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def test_oom_messages_name_pod_and_kind() -> None:
    assert "was OOMKilled (host memory limit)" in conds(im(), deployment(), [OOM_LOOP])["Degraded"][2]
    assert "exited on GPU out-of-memory" in conds(im(), deployment(), [GPU_OOM])["Degraded"][2]
    assert "bad flag --foo" in conds(im(), deployment(), [CRASH])["Degraded"][2]


def test_pod_problems_record_config_hash_and_finish_time() -> None:
    (problem,) = pod_problems(OOM_LOOP, NOW)
    assert problem.is_oom and problem.config_hash == "h1"
    assert problem.finished_at == datetime(2026, 1, 1, 11, 59, tzinfo=UTC)
    assert pod_problems(OLD_OOM, NOW) == []
    assert pod_problems(OLD_OOM, datetime(2026, 1, 1, 10, 5, tzinfo=UTC))  # recent then


FETCH_MESSAGE = (
    "hf://org/x-GGUF holds 2 .gguf files (x-Q4_K_M.gguf, x-Q8_0.gguf): name one as hf://org/x-GGUF:QUANT"
)


@pytest.mark.parametrize(
    "init",
    [
        {
            "state": {"terminated": {"reason": "Error", "exitCode": 1, "message": FETCH_MESSAGE}}
        },  # first failure
        {
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": FETCH_MESSAGE}},
        },
    ],
)
def test_a_failed_fetch_init_container_degrades_the_model_with_its_message(init: dict[str, Any]) -> None:
    waiting = {"name": "kvpilot", "state": {"waiting": {"reason": "PodInitializing"}}}
    failed = pod(initContainerStatuses=[{"name": "fetch-model", **init}], containerStatuses=[waiting])
    (problem,) = pod_problems(failed, NOW)
    assert problem.reason == "CrashLoopBackOff"
    assert problem.message == f"pod llama-abc init container fetch-model failed: {FETCH_MESSAGE}"
    degraded = {c.type: c for c in compute_conditions(im(), deployment(1, 0), [problem])}["Degraded"]
    assert degraded.status and FETCH_MESSAGE in degraded.message
    done = {"name": "fetch-model", "state": {"terminated": {"reason": "Completed", "exitCode": 0}}}
    running = {"name": "fetch-model", "state": {"running": {}}, "lastState": init["state"]}
    for fine in (done, running):  # fetched, or retrying after a failure and not yet backed off
        assert pod_problems(pod(initContainerStatuses=[fine]), NOW) == []


def test_a_replica_fetching_its_weights_is_named_while_none_is_ready() -> None:
    downloading = pod(initContainerStatuses=[{"name": "fetch-model", "state": {"running": {"startedAt": T}}}])
    done = pod(
        "llama-def", initContainerStatuses=[{"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}]
    )
    going = pod("llama-old", initContainerStatuses=[{"name": "fetch-model", "state": {"running": {}}}])
    going["metadata"]["deletionTimestamp"] = T
    names = fetching([done, going, downloading])
    assert names == ["llama-abc (fetch-model)"]
    ready = {c.type: c for c in compute_conditions(im(), deployment(1, 0), [], fetching=names)}["Ready"]
    assert (ready.status, ready.reason) == (False, "NoReplicaReady")
    assert (
        ready.message
        == "0/1 replicas ready: waiting for the weights: llama-abc (fetch-model) downloading them"
    )
    serving = {c.type: c for c in compute_conditions(im(), deployment(1, 1), [], fetching=names)}["Ready"]
    assert serving.status  # one replica serves: a second one's download is not news


def test_terminating_pods_are_ignored() -> None:
    gone = pod(**OOM_LOOP["status"])
    gone["metadata"]["deletionTimestamp"] = T
    assert all_problems([gone], NOW) == []


def test_compute_status_fields() -> None:
    st = compute_status(im(replicas=2), deployment(2, 1, updated=2), [], now=NOW)
    assert st["observedGeneration"] == 1
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 1, 2)
    assert st["selector"] == "kvpilot.dev/model=llama"
    assert st["endpoint"] == "http://llama.ml.svc:8000/v1"
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Progressing", "Degraded", "ScalingLimited"]
    assert all(
        c["lastTransitionTime"] == "2026-01-01T12:00:00Z" and c["observedGeneration"] == 1
        for c in st["conditions"]
    )
    assert "kvCacheUsage" not in st and "autoscaler" not in st  # the autoscaler's


def test_last_transition_time_moves_only_on_flip() -> None:
    first = compute_status(im(), deployment(1, 0), [], now=NOW)
    later = NOW + timedelta(minutes=5)
    same = compute_status(im(), deployment(1, 0), [], now=later, previous=first)
    assert same == first
    flipped = compute_status(im(), deployment(1, 1), [], now=later, previous=first)
    ready = next(c for c in flipped["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    degraded = next(c for c in flipped["conditions"] if c["type"] == "Degraded")
    assert degraded["lastTransitionTime"] == "2026-01-01T12:00:00Z"


def test_status_patch_only_for_differences_and_never_autoscaler_fields() -> None:
    desired = compute_status(im(), deployment(1, 1), [], now=NOW)
    live = {**desired, "kvCacheUsage": "42%", "autoscaler": {"lastScaleTime": T}}
    assert status_patch(live, desired) is None
    assert status_patch({**live, "readyReplicas": 0}, desired) == {"readyReplicas": 1}
    assert status_patch(None, desired) == desired
    assert status_patch({**live, "oomAdaptation": {"count": 1}}, desired) == {"oomAdaptation": None}


def test_condition_events_on_transitions_only() -> None:
    before = merge_conditions(
        compute_conditions(im(), deployment(1, 0), all_problems([UNSCHEDULABLE], NOW)), None, NOW, 1
    )
    after = merge_conditions(compute_conditions(im(), deployment(1, 1), []), before, NOW, 1)
    events = condition_events(before, after)
    assert [(e.type, e.reason) for e in events] == [("Normal", "Ready"), ("Normal", "ScalingLimitedCleared")]
    assert condition_events(after, after) == []
    first = condition_events(None, before)
    assert [(e.type, e.reason) for e in first] == [("Warning", "Unschedulable")]


def test_invalid_status_keeps_counts() -> None:
    st = invalid_status("llama", "ml", 3, "bad", now=NOW, previous={"replicas": 2, "readyReplicas": 2})
    assert (st["replicas"], st["readyReplicas"], st["observedGeneration"]) == (2, 2, 3)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "InvalidSpec",
        "spec is invalid: bad",
    )


def _ready(st: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == "Ready")


def test_losing_readiness_posts_one_warning() -> None:
    serving = compute_status(im(), deployment(2, 2), [], now=NOW)
    lost = compute_status(im(), deployment(2, 0), [], now=NOW, previous=serving)
    events = condition_events(serving["conditions"], lost["conditions"])
    assert [(e.type, e.reason) for e in events] == [("Warning", "NotReady")]
    assert events[0].message.startswith("the model stopped serving (NoReplicaReady): 0/1 replicas ready")
    # Still down, for another reason: no second Warning for the same way down.
    refused = compute_status(
        im(), deployment(2, 0), [], now=NOW, previous=lost, refused=frozenset({"Service"})
    )
    assert "NotReady" not in [e.reason for e in condition_events(lost["conditions"], refused["conditions"])]
    # Back up: the Normal Ready event, as before.
    back = compute_status(im(), deployment(2, 1), [], now=NOW, previous=lost)
    assert [(e.type, e.reason) for e in condition_events(lost["conditions"], back["conditions"])] == [
        ("Normal", "Ready")
    ]


def test_scaling_to_zero_is_announced_as_normal() -> None:
    serving = compute_status(im(), deployment(1, 1), [], now=NOW)
    zero = compute_status(im(replicas=0), deployment(0, 0), [], now=NOW, previous=serving)
    assert [(e.type, e.reason) for e in condition_events(serving["conditions"], zero["conditions"])] == [
        ("Normal", "ScaledToZero")
    ]


def test_a_refused_service_means_no_endpoint_and_not_ready() -> None:
    st = compute_status(
        im(),
        deployment(1, 1),
        [],
        now=NOW,
        apply_error="Service/llama was rejected: bad name",
        refused=frozenset({"Service"}),
    )
    assert "endpoint" not in st
    ready = _ready(st)
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    # Only a refused Service takes the endpoint away; a refused PodDisruptionBudget does not.
    other = compute_status(
        im(), deployment(1, 1), [], now=NOW, apply_error="x", refused=frozenset({"PodDisruptionBudget"})
    )
    assert other["endpoint"] == "http://llama.ml.svc:8000/v1" and _ready(other)["status"] == "True"


def test_invalid_status_keeps_only_an_endpoint_that_was_made() -> None:
    st = invalid_status("llama", "ml", 1, "bad", now=NOW, previous=None)
    assert "endpoint" not in st
    before = {"endpoint": "http://llama.ml.svc:8000/v1"}
    assert invalid_status("llama", "ml", 2, "bad", now=NOW, previous=before)["endpoint"] == before["endpoint"]
