"""Apply-skip logic and whole reconciles against an in-memory API: idempotent and quiet."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from kvpilot.api.models import API_VERSION, KIND
from kvpilot.operator.apply import is_subset, needs_apply, stamp
from kvpilot.operator.builders import APPLIED_HASH_ANNOTATION, CONFIG_HASH_ANNOTATION, OperatorSettings
from kvpilot.operator.reconcile import Reconciler
from tests.operator.fakes import FakeKube, make_body

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("desired", "live", "expected"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 2], "c": 0}}, True),
        ({"l": [1, 2]}, {"l": [1, 2, 3]}, False),
        ({"c": [{"name": "x", "v": 1}]}, {"c": [{"name": "y"}, {"name": "x", "v": 1, "d": 0}]}, True),
        ({"c": [{"name": "x", "v": 1}]}, {"c": [{"name": "x", "v": 2}]}, False),
        ({"n": 1}, {"n": 1.0}, True),
        ({"t": True}, {"t": 1}, False),
        ({"s": "1"}, {"s": 1}, False),
        ({"m": {}}, {}, False),
    ],
)
def test_is_subset(desired: Any, live: Any, expected: bool) -> None:
    assert is_subset(desired, live) is expected


def test_stamp_hash_ignores_its_own_annotation() -> None:
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": {"k": "v"}}
    once = stamp(obj)
    assert stamp(once) == once
    assert (
        stamp({**obj, "data": {"k": "w"}})["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
        != (once["metadata"]["annotations"][APPLIED_HASH_ANNOTATION])
    )
    assert "annotations" not in obj["metadata"]  # no mutation


def test_needs_apply() -> None:
    desired = stamp({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": {"k": "v"}})
    live = {**desired, "metadata": {**desired["metadata"], "resourceVersion": "7", "uid": "u"}}
    assert needs_apply(desired, None)
    assert not needs_apply(desired, live)
    assert needs_apply(desired, {**live, "data": {"k": "edited"}})  # drift is repaired
    old_hash = {**live, "metadata": {**live["metadata"], "annotations": {APPLIED_HASH_ANNOTATION: "old"}}}
    assert needs_apply(desired, old_hash)  # something we rendered before may need removing


# -- whole reconciles ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


def setup(kube: FakeKube, **spec: Any) -> tuple[Reconciler, Clock]:
    kube.put(make_body(**spec))
    clock = Clock()
    return Reconciler(kube, OperatorSettings(image="img"), clock=clock), clock


def body(kube: FakeKube) -> dict[str, Any]:
    got = kube.get(API_VERSION, KIND, "ml", "llama")
    assert got is not None
    return got


def child(kube: FakeKube, api_version: str, kind: str, name: str = "llama") -> dict[str, Any]:
    got = kube.get(api_version, kind, "ml", name)
    assert got is not None
    return got


def test_second_reconcile_writes_nothing(fake_kube: FakeKube) -> None:
    rec, clock = setup(fake_kube)
    first = rec.reconcile(body(fake_kube))
    assert first.applied == [
        "ConfigMap/llama-config",
        "Deployment/llama",
        "Service/llama",
        "PodDisruptionBudget/llama",
    ]
    assert first.status_patch is not None
    versions = {k: o["metadata"]["resourceVersion"] for k, o in fake_kube.objects.items()}
    writes = len(fake_kube.writes)
    clock.now = NOW.replace(minute=30)  # time passing alone changes nothing
    second = rec.reconcile(body(fake_kube))
    assert not second.wrote and len(second.skipped) == 4
    assert len(fake_kube.writes) == writes
    assert {k: o["metadata"]["resourceVersion"] for k, o in fake_kube.objects.items()} == versions


def test_restarted_operator_makes_no_writes(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube)
    rec.reconcile(body(fake_kube))
    writes = len(fake_kube.writes)
    fresh = Reconciler(fake_kube, OperatorSettings(image="img"), clock=lambda: NOW.replace(hour=13))
    assert not fresh.reconcile(body(fake_kube)).wrote
    assert len(fake_kube.writes) == writes


def test_spec_change_rolls_only_what_changed(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube)
    rec.reconcile(body(fake_kube))
    before = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["metadata"]["annotations"]
    b = body(fake_kube)
    b["spec"]["runtime"] = {"maxNumSeqs": 8}
    b["metadata"]["generation"] = 2
    fake_kube.put(b)
    out = rec.reconcile(body(fake_kube))
    assert out.applied == ["ConfigMap/llama-config", "Deployment/llama"]
    after = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert after[CONFIG_HASH_ANNOTATION] != before[CONFIG_HASH_ANNOTATION]
    cfg = yaml.safe_load(child(fake_kube, "v1", "ConfigMap", "llama-config")["data"]["config.yaml"])
    assert cfg["max_num_seqs"] == 8
    assert body(fake_kube)["status"]["observedGeneration"] == 2


def test_scaling_changes_only_the_deployment(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube)
    rec.reconcile(body(fake_kube))
    b = body(fake_kube)
    b["spec"]["replicas"] = 3
    fake_kube.put(b)
    assert rec.reconcile(body(fake_kube)).applied == ["Deployment/llama"]
    assert child(fake_kube, "apps/v1", "Deployment")["spec"]["replicas"] == 3


def test_drift_is_repaired(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube)
    rec.reconcile(body(fake_kube))
    dep = child(fake_kube, "apps/v1", "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil"
    fake_kube.put(dep)
    assert rec.reconcile(body(fake_kube)).applied == ["Deployment/llama"]
    assert (
        child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
        == "img"
    )


def test_service_monitor_when_the_api_exists(fake_kube: FakeKube) -> None:
    fake_kube.apis.add("monitoring.coreos.com/v1")
    rec, _ = setup(fake_kube)
    assert "ServiceMonitor/llama" in rec.reconcile(body(fake_kube)).applied


def test_invalid_spec_reports_and_renders_nothing(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube, resources={"gpus": 3}, runtime={"tensorParallelSize": 2})
    out = rec.reconcile(body(fake_kube))
    assert out.invalid and out.applied == []
    degraded = next(c for c in body(fake_kube)["status"]["conditions"] if c["type"] == "Degraded")
    assert (
        degraded["reason"] == "InvalidSpec"
        and "must equal spec.runtime.tensorParallelSize" in degraded["message"]
    )
    assert [(e["type"], e["reason"]) for e in fake_kube.events] == [("Warning", "InvalidSpec")]
    assert not rec.reconcile(body(fake_kube)).wrote


def _add_pod(kube: FakeKube, chash: str, **status: Any) -> None:
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "llama-1",
                "namespace": "ml",
                "labels": {"kvpilot.dev/model": "llama"},
                "annotations": {CONFIG_HASH_ANNOTATION: chash},
            },
            "status": status,
        }
    )


def test_unschedulable_sets_scaling_limited_and_one_event(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube, resources={"gpus": 8})
    rec.reconcile(body(fake_kube))
    chash = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["metadata"]["annotations"][
        CONFIG_HASH_ANNOTATION
    ]
    _add_pod(
        fake_kube,
        chash,
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        ],
    )
    rec.reconcile(body(fake_kube))
    limited = next(c for c in body(fake_kube)["status"]["conditions"] if c["type"] == "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in limited["message"]
    rec.reconcile(body(fake_kube))
    assert [e["reason"] for e in fake_kube.events] == ["Unschedulable"]


def _oom_pod(fake_kube: FakeKube, terminated: dict[str, Any]) -> None:
    chash = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["metadata"]["annotations"][
        CONFIG_HASH_ANNOTATION
    ]
    _add_pod(
        fake_kube,
        chash,
        containerStatuses=[
            {
                "name": "kvpilot",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {**terminated, "finishedAt": "2026-01-01T11:59:00Z"}},
            }
        ],
    )


def test_gpu_oom_adapts_the_runtime_config_once_and_records_it(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube, resources={"gpus": 1, "memory": "16Gi"}, oomPolicy={"adapt": True})
    rec.reconcile(body(fake_kube))
    _oom_pod(
        fake_kube,
        {"reason": "Error", "exitCode": 1, "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to"},
    )
    out = rec.reconcile(body(fake_kube))
    assert out.applied == ["ConfigMap/llama-config", "Deployment/llama"]
    status = body(fake_kube)["status"]
    assert status["oomAdaptation"]["count"] == 1
    assert status["oomAdaptation"]["changes"]["maxNumSeqs"] == "64 -> 32"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (
        degraded["reason"] == "OOMKilled"
        and "adapted: gpuMemoryUtilization 0.9 -> 0.85" in degraded["message"]
    )
    cfg = yaml.safe_load(child(fake_kube, "v1", "ConfigMap", "llama-config")["data"]["config.yaml"])
    assert (cfg["gpu_memory_utilization"], cfg["max_num_seqs"], cfg["max_num_batched_tokens"]) == (
        0.85,
        32,
        1024,
    )
    limits = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert limits["limits"]["memory"] == "16Gi"  # host memory was not the problem
    assert "OOMAdapted" in [e["reason"] for e in fake_kube.events]
    # The pod still shows the old OOM; that is not a new one.
    again = rec.reconcile(body(fake_kube))
    assert again.applied == [] and body(fake_kube)["status"]["oomAdaptation"]["count"] == 1


def test_memory_limit_oom_raises_memory_and_leaves_the_gpu_settings(fake_kube: FakeKube) -> None:
    rec, _ = setup(fake_kube, resources={"gpus": 1, "memory": "16Gi"}, oomPolicy={"adapt": True})
    rec.reconcile(body(fake_kube))
    config_before = child(fake_kube, "v1", "ConfigMap", "llama-config")["data"]["config.yaml"]
    _oom_pod(fake_kube, {"reason": "OOMKilled", "exitCode": 137})
    out = rec.reconcile(body(fake_kube))
    assert out.applied == ["Deployment/llama"]  # the runtime's config is unchanged
    assert child(fake_kube, "v1", "ConfigMap", "llama-config")["data"]["config.yaml"] == config_before
    container = child(fake_kube, "apps/v1", "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert (
        container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"] == "24Gi"
    )
    status = body(fake_kube)["status"]
    assert status["oomAdaptation"]["changes"] == {"memory": "16Gi -> 24Gi"}
    assert status["oomAdaptation"]["overrides"] == {"memory": "24Gi"}
    assert not rec.reconcile(body(fake_kube)).applied  # the old pod's OOM is not a new one


def test_a_rejected_child_is_reported_not_retried_forever(fake_kube: FakeKube) -> None:
    from kubernetes.client.exceptions import ApiException

    class Rejecting(FakeKube):
        def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
            if obj["kind"] == "Deployment":
                err = ApiException(status=422, reason="Unprocessable Entity")
                err.body = '{"message": "Deployment.apps \\"llama\\" is invalid: spec.template.spec.nodeSelector: bad"}'
                raise err
            return super().apply(obj, field_manager)

    kube = Rejecting()
    rec, _ = setup(kube)
    out = rec.reconcile(body(kube))
    assert out.applied == ["ConfigMap/llama-config", "Service/llama", "PodDisruptionBudget/llama"]
    degraded = next(c for c in body(kube)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert degraded["message"].startswith("Deployment/llama was rejected: Deployment.apps")
    assert ("Warning", "ApplyFailed") in [(e["type"], e["reason"]) for e in kube.events]


def test_router_endpoint_in_status_only_for_the_routed_namespace(fake_kube: FakeKube) -> None:
    fake_kube.put(make_body())
    fake_kube.put(make_body(name="other", namespace="research"))
    routed = OperatorSettings(
        image="img", router_endpoints={"ml": "http://kvpilot-router.kvpilot-system.svc:80/v1"}
    )
    rec = Reconciler(fake_kube, routed, clock=Clock())
    rec.reconcile(body(fake_kube))
    assert body(fake_kube)["status"]["routerEndpoint"] == "http://kvpilot-router.kvpilot-system.svc:80/v1"
    other = fake_kube.get(API_VERSION, KIND, "research", "other")
    assert other is not None
    rec.reconcile(other)
    other = fake_kube.get(API_VERSION, KIND, "research", "other")
    assert other is not None and "routerEndpoint" not in other["status"]
    # the router goes away: the field is removed, not left stale
    Reconciler(fake_kube, OperatorSettings(image="img"), clock=Clock()).reconcile(body(fake_kube))
    assert "routerEndpoint" not in body(fake_kube)["status"]


def test_a_refused_service_leaves_no_endpoint_and_ready_false(fake_kube: FakeKube) -> None:
    """The `dotted.name` case: Deployment and pods fine, the Service refused by the API server."""
    from kubernetes.client.exceptions import ApiException

    class RejectingService(FakeKube):
        def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
            if obj["kind"] == "Service":
                err = ApiException(status=422, reason="Unprocessable Entity")
                err.body = '{"message": "Service \\"llama\\" is invalid: metadata.name: a DNS-1035 label"}'
                raise err
            live = super().apply(obj, field_manager)
            if obj["kind"] == "Deployment":  # every replica ready
                live["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
            return live

    kube = RejectingService()
    rec, _ = setup(kube)
    rec.reconcile(body(kube))
    status = body(kube)["status"]
    assert "endpoint" not in status
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Ready"] == ("False", "ApplyFailed")
    assert conditions["Degraded"] == ("True", "ApplyFailed")


def test_an_overlong_name_stored_before_the_rule_is_reported(fake_kube: FakeKube) -> None:
    name = "m" * 64
    fake_kube.put(make_body(name=name))
    rec = Reconciler(fake_kube, OperatorSettings(image="img"), clock=Clock())
    live = fake_kube.get(API_VERSION, KIND, "ml", name)
    assert live is not None
    out = rec.reconcile(live)
    assert out.applied == [] and out.invalid and "at most 63 characters" in out.invalid
    after = fake_kube.get(API_VERSION, KIND, "ml", name)
    assert after is not None
    degraded = next(c for c in after["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and degraded["message"].startswith("metadata.name must be")
    assert "endpoint" not in after["status"]
    assert [(e["type"], e["reason"]) for e in fake_kube.events] == [("Warning", "InvalidSpec")]
