"""A disaggregated InferenceModel: its children per role, whole reconciles, and its status."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import yaml

from kvpilot.api.models import API_VERSION, KIND, KV_ROLE_LABEL, MODEL_LABEL, InferenceModel
from kvpilot.operator.builders import CONFIG_HASH_ANNOTATION, OperatorSettings
from kvpilot.operator.reconcile import Reconciler
from kvpilot.operator.roles import render_role_children, role_args
from kvpilot.operator.rolestatus import combine_conditions, compute_roles_status
from kvpilot.operator.status import Cond
from tests.operator.fakes import FakeKube, make_body
from tests.operator.test_status import deployment

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SETTINGS = OperatorSettings(image="img")
PD = {
    "prefill": {"replicas": 1, "runtime": {"maxNumBatchedTokens": 8192}, "resources": {"memory": "24Gi"}},
    "decode": {"replicas": 2, "runtime": {"maxNumSeqs": 128}},
    "transferTimeoutSeconds": 7.5,
}


def model(**spec: Any) -> InferenceModel:
    return InferenceModel.model_validate(make_body(**spec))


def by_ref(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def test_one_deployment_budget_and_config_per_role_one_service() -> None:
    im = model(resources={"gpus": 1, "memory": "16Gi"}, runtime={"maxNumSeqs": 32}, disaggregation=PD)
    children = by_ref(render_role_children(im, SETTINGS, {}))
    assert list(children) == [
        "ConfigMap/llama-prefill-config",
        "Deployment/llama-prefill",
        "PodDisruptionBudget/llama-prefill",
        "ConfigMap/llama-decode-config",
        "Deployment/llama-decode",
        "PodDisruptionBudget/llama-decode",
        "Service/llama",
    ]
    for role, replicas in (("prefill", 1), ("decode", 2)):
        dep = children[f"Deployment/llama-{role}"]
        both = {MODEL_LABEL: "llama", KV_ROLE_LABEL: role}
        assert dep["spec"]["replicas"] == replicas
        assert dep["spec"]["selector"]["matchLabels"] == both
        assert both.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert children[f"PodDisruptionBudget/llama-{role}"]["spec"]["selector"]["matchLabels"] == both
        pod = dep["spec"]["template"]["spec"]
        (config_volume,) = [v for v in pod["volumes"] if "configMap" in v]
        assert config_volume["configMap"]["name"] == f"llama-{role}-config"
        container = pod["containers"][0]
        assert container["command"][4:6] == ["--kv-role", role]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # probes as aggregated pods'
    # the Service (and so the router entry) covers both roles
    assert children["Service/llama"]["spec"]["selector"] == {MODEL_LABEL: "llama"}
    prefill_cfg = yaml.safe_load(children["ConfigMap/llama-prefill-config"]["data"]["config.yaml"])
    decode_cfg = yaml.safe_load(children["ConfigMap/llama-decode-config"]["data"]["config.yaml"])
    assert (prefill_cfg["max_num_seqs"], prefill_cfg["max_num_batched_tokens"]) == (32, 8192)
    assert (decode_cfg["max_num_seqs"], decode_cfg["max_num_batched_tokens"]) == (128, 2048)
    assert prefill_cfg["served_model_name"] == decode_cfg["served_model_name"] == "llama"
    memory = {
        role: children[f"Deployment/llama-{role}"]["spec"]["template"]["spec"]["containers"][0]["resources"][
            "limits"
        ]["memory"]
        for role in ("prefill", "decode")
    }
    assert memory == {"prefill": "24Gi", "decode": "16Gi"}


def test_only_the_decode_side_gets_the_transfer_deadline() -> None:
    im = model(disaggregation=PD)
    assert role_args(im, "prefill") == ["--kv-role", "prefill"]
    assert role_args(im, "decode") == ["--kv-role", "decode", "--kv-transfer-timeout", "7.5"]


def test_extra_args_stay_last() -> None:
    im = model(disaggregation={}, extraArgs=["--threads", "2"])
    dep = by_ref(render_role_children(im, SETTINGS, {}))["Deployment/llama-decode"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--threads", "2"]


# -- whole reconciles -----------------------------------------------------------------------------


def reconciler(kube: FakeKube, **spec: Any) -> Reconciler:
    kube.put(make_body(**spec))
    return Reconciler(kube, SETTINGS, clock=lambda: NOW)


def body(kube: FakeKube) -> dict[str, Any]:
    got = kube.get(API_VERSION, KIND, "ml", "llama")
    assert got is not None
    return got


def set_spec(kube: FakeKube, **spec: Any) -> None:
    b = body(kube)
    b["spec"] = make_body(**spec)["spec"]
    b["metadata"]["generation"] += 1
    kube.put(b)


def deployment_status(kube: FakeKube, name: str, replicas: int, ready: int) -> None:
    dep = kube.get("apps/v1", "Deployment", "ml", name)
    assert dep is not None
    dep["status"] = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas}
    kube.put(dep)


def test_reconcile_is_quiet_the_second_time_and_reports_both_roles(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube, disaggregation=PD)
    first = rec.reconcile(body(fake_kube))
    assert "Deployment/llama-prefill" in first.applied and "Deployment/llama-decode" in first.applied
    assert not rec.reconcile(body(fake_kube)).wrote
    deployment_status(fake_kube, "llama-prefill", 1, 1)
    deployment_status(fake_kube, "llama-decode", 2, 0)
    rec.reconcile(body(fake_kube))
    status = body(fake_kube)["status"]
    assert (status["replicas"], status["readyReplicas"]) == (3, 1)
    assert status["roles"] == {
        "prefill": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
        "decode": {"replicas": 2, "readyReplicas": 0, "desiredReplicas": 2},
    }
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NoReplicaReady")
    assert ready["message"].startswith("both roles must serve; decode: 0/2 replicas ready")
    deployment_status(fake_kube, "llama-decode", 2, 1)
    rec.reconcile(body(fake_kube))
    ready = next(c for c in body(fake_kube)["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    assert ready["message"].startswith("prefill 1/1, decode 1/2 replicas ready")


def test_switching_modes_removes_the_other_modes_children(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube, replicas=2)
    rec.reconcile(body(fake_kube))
    assert fake_kube.get("apps/v1", "Deployment", "ml", "llama") is not None

    set_spec(fake_kube, disaggregation=PD)
    out = rec.reconcile(body(fake_kube))
    assert sorted(out.deleted) == ["ConfigMap/llama-config", "Deployment/llama", "PodDisruptionBudget/llama"]
    assert fake_kube.get("apps/v1", "Deployment", "ml", "llama") is None
    assert fake_kube.get("v1", "Service", "ml", "llama") is not None  # the Service stays: one endpoint

    set_spec(fake_kube, replicas=1)
    out = rec.reconcile(body(fake_kube))
    assert sorted(out.deleted) == [
        "ConfigMap/llama-decode-config",
        "ConfigMap/llama-prefill-config",
        "Deployment/llama-decode",
        "Deployment/llama-prefill",
        "PodDisruptionBudget/llama-decode",
        "PodDisruptionBudget/llama-prefill",
    ]
    assert "roles" not in body(fake_kube)["status"]
    assert fake_kube.get("apps/v1", "Deployment", "ml", "llama") is not None


def test_a_child_of_another_model_is_not_taken_over(fake_kube: FakeKube) -> None:
    """Model `llama` with roles renders Deployment `llama-prefill`: that is aggregated model
    `llama-prefill`'s Deployment, which must stay its own."""
    other = make_body(name="llama-prefill")
    fake_kube.put(other)
    Reconciler(fake_kube, SETTINGS, clock=lambda: NOW).reconcile(other)
    theirs = fake_kube.get("apps/v1", "Deployment", "ml", "llama-prefill")
    rec = reconciler(fake_kube, disaggregation=PD)
    rec.reconcile(body(fake_kube))
    assert fake_kube.get("apps/v1", "Deployment", "ml", "llama-prefill") == theirs
    degraded = next(c for c in body(fake_kube)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert "Deployment/llama-prefill belongs to InferenceModel llama-prefill" in degraded["message"]


def test_autoscaled_roles_start_at_their_minimum(fake_kube: FakeKube) -> None:
    rec = reconciler(
        fake_kube,
        autoscaling={"minReplicas": 1, "maxReplicas": 6},
        disaggregation={"decode": {"minReplicas": 2}},
    )
    rec.reconcile(body(fake_kube))
    replicas = {
        role: fake_kube.get("apps/v1", "Deployment", "ml", f"llama-{role}")["spec"]["replicas"]  # type: ignore[index]
        for role in ("prefill", "decode")
    }
    assert replicas == {"prefill": 1, "decode": 2}
    # the autoscaler's one merge patch of both roles
    b = body(fake_kube)
    b["spec"]["disaggregation"] = {"prefill": {"replicas": 3}, "decode": {"minReplicas": 2, "replicas": 5}}
    fake_kube.put(b)
    out = rec.reconcile(body(fake_kube))
    assert out.applied == ["Deployment/llama-prefill", "Deployment/llama-decode"]
    assert body(fake_kube)["status"]["roles"]["decode"]["desiredReplicas"] == 5


def test_an_oom_adapts_only_its_own_role(fake_kube: FakeKube) -> None:
    """Each role has its own runtime settings, so an OOM adapts the role whose pod ran out of memory."""
    rec = reconciler(fake_kube, resources={"gpus": 1}, oomPolicy={"adapt": True}, disaggregation=PD)
    rec.reconcile(body(fake_kube))
    dep = fake_kube.get("apps/v1", "Deployment", "ml", "llama-decode")
    assert dep is not None
    fake_kube.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "llama-decode-1",
                "namespace": "ml",
                "labels": {MODEL_LABEL: "llama", KV_ROLE_LABEL: "decode"},
                "annotations": {
                    CONFIG_HASH_ANNOTATION: dep["spec"]["template"]["metadata"]["annotations"][
                        CONFIG_HASH_ANNOTATION
                    ]
                },
            },
            "status": {
                "containerStatuses": [
                    {
                        "name": "kvpilot",
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "reason": "Error",
                                "exitCode": 1,
                                "message": "torch.OutOfMemoryError: CUDA out of memory.",
                                "finishedAt": "2026-01-01T11:59:00Z",
                            }
                        },
                    }
                ]
            },
        }
    )
    out = rec.reconcile(body(fake_kube))
    assert out.applied == ["ConfigMap/llama-decode-config", "Deployment/llama-decode"]
    roles = body(fake_kube)["status"]["roles"]
    assert roles["decode"]["oomAdaptation"]["changes"]["maxNumSeqs"] == "128 -> 64"  # the role's own 128
    assert "oomAdaptation" not in roles["prefill"] and "oomAdaptation" not in body(fake_kube)["status"]
    cfg = fake_kube.get("v1", "ConfigMap", "ml", "llama-decode-config")
    assert cfg is not None and yaml.safe_load(cfg["data"]["config.yaml"])["max_num_seqs"] == 64
    degraded = next(c for c in body(fake_kube)["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "OOMKilled" and degraded["message"].startswith("decode: pod llama-decode-1")
    assert not rec.reconcile(body(fake_kube)).applied  # the same OOM is not adapted twice


def test_both_roles_at_zero_is_scaled_to_zero_one_is_not_serving() -> None:
    zero = Cond("Ready", False, "ScaledToZero", "replicas is 0")
    serving = Cond("Ready", True, "Serving", "1/1")
    rest = [
        Cond("Progressing", False, "RolloutComplete", "ok"),
        Cond("Degraded", False, "AsExpected"),
        Cond("ScalingLimited", False, "AsExpected"),
    ]
    both = combine_conditions(
        {"prefill": [zero, *rest], "decode": [zero, *rest]}, {"prefill": (0, 0), "decode": (0, 0)}, "url"
    )
    assert (both[0].status, both[0].reason) == (False, "ScaledToZero")
    one = combine_conditions(
        {"prefill": [zero, *rest], "decode": [serving, *rest]}, {"prefill": (0, 0), "decode": (1, 1)}, "url"
    )
    assert (one[0].status, one[0].reason) == (False, "RoleScaledToZero")
    assert one[0].message == "both roles must serve; prefill: replicas is 0"


def test_a_role_fetching_its_weights_is_named_in_ready() -> None:
    im = model(disaggregation=PD)
    status = compute_roles_status(
        im,
        {"prefill": deployment(1, 1), "decode": deployment(2, 0)},
        {},
        now=NOW,
        fetching={"decode": ["m-decode-x (fetch-model)"]},
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NoReplicaReady")
    assert ready["message"] == (
        "both roles must serve; decode: 0/2 replicas ready: waiting for the weights: "
        "m-decode-x (fetch-model) downloading them"
    )


def test_tensor_parallel_roles_shard_alike() -> None:
    """Both roles of a 2-GPU model run tensor parallel over their 2 GPUs (each rank transfers its shard)."""
    im = model(resources={"gpus": 2}, disaggregation=PD)
    children = by_ref(render_role_children(im, SETTINGS, {}))
    for role in ("prefill", "decode"):
        cfg = yaml.safe_load(children[f"ConfigMap/llama-{role}-config"]["data"]["config.yaml"])
        assert cfg["tensor_parallel_size"] == 2
        container = children[f"Deployment/llama-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
