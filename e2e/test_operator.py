"""End-to-end tests of the operator against the local control plane (fake GPU nodes via kwok).

The operator runs as a real `kvpilot operator` subprocess per test, watching only that test's
namespace. kwok marks scheduled pods Running and Ready (it does not run the runtime), so readiness
here means "scheduled onto a node with enough GPUs".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import Cluster, Kubectl, wait_until
from e2e.processes import OperatorProcess
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture
def operator(cluster: Cluster, crds: None, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect").start()
    yield op
    op.stop()


# -- helpers ---------------------------------------------------------------------------------


def load_example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "examples" / name).read_text()))


def model(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }


def get(kubectl: Kubectl, *resource: str) -> dict[str, Any] | None:
    result = kubectl.run("get", *resource, "-o", "json", "--show-managed-fields", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def wait_condition(
    kubectl: Kubectl, name: str, ctype: str, status: str = "True", timeout: float = 90
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        c = condition(get(kubectl, "im", name), ctype)
        return c if c.get("status") == status else None

    return wait_until(check, timeout=timeout, what=f"im/{name} {ctype}={status}")


def versions(kubectl: Kubectl, name: str) -> dict[str, str]:
    out = {}
    for kind, obj_name in [
        ("inferencemodel", name),
        ("deployment", name),
        ("service", name),
        ("configmap", f"{name}-config"),
        ("poddisruptionbudget", name),
    ]:
        obj = get(kubectl, kind, obj_name)
        assert obj is not None, (kind, obj_name)
        out[kind] = obj["metadata"]["resourceVersion"]
    return out


# -- tests -----------------------------------------------------------------------------------


def test_operator_creates_every_child_with_the_expected_fields(
    operator: OperatorProcess, kubectl: Kubectl
) -> None:
    kubectl.apply(load_example("smollm2-cpu.yaml"))
    dep = wait_until(lambda: get(kubectl, "deployment", "smollm2"), timeout=30, what="Deployment")
    im = get(kubectl, "im", "smollm2")
    assert im is not None
    owner = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "name": "smollm2",
        "uid": im["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    children = {
        "deployment": dep,
        "service": get(kubectl, "service", "smollm2"),
        "configmap": get(kubectl, "configmap", "smollm2-config"),
        "poddisruptionbudget": get(kubectl, "poddisruptionbudget", "smollm2"),
    }
    for kind, child in children.items():
        assert child is not None, kind
        md = child["metadata"]
        assert md["ownerReferences"] == [owner], kind
        assert md["labels"]["kvpilot.dev/model"] == "smollm2"
        managers = {(m["manager"], m["operation"]) for m in md["managedFields"]}
        assert ("kvpilot-operator", "Apply") in managers, (kind, managers)
        assert "kvpilot.dev/applied-hash" in md["annotations"]

    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["kvpilot", "serve", "--config", "/etc/kvpilot/config.yaml"]
    assert container["image"] == "kvpilot/kvpilot:e2e"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    config = yaml.safe_load(children["configmap"]["data"]["config.yaml"])
    assert config["model"] == "smollm2-135m-instruct" and config["device"] == "cpu"
    assert config["max_num_seqs"] == 16
    assert children["service"]["spec"]["ports"][0]["port"] == 8000

    ready = wait_condition(kubectl, "smollm2", "Ready")
    assert ready["reason"] == "Serving"
    status = get(kubectl, "im", "smollm2")["status"]  # type: ignore[index]
    assert status["endpoint"] == f"http://smollm2.{kubectl.namespace}.svc:8000/v1"
    assert status["readyReplicas"] == 1 and status["observedGeneration"] == 1


def test_gpu_model_from_a_pvc_becomes_ready_on_fake_gpu_nodes(
    operator: OperatorProcess, kubectl: Kubectl
) -> None:
    pv_name = f"models-{kubectl.namespace}"[:63]
    kubectl.apply([
        {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "100Gi"}, "accessModes": ["ReadOnlyMany"],
                "hostPath": {"path": "/models"}, "storageClassName": "",
                "claimRef": {"namespace": kubectl.namespace, "name": "models"},
            },
        },
        {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
            "spec": {
                "accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                "resources": {"requests": {"storage": "100Gi"}},
            },
        },
    ])  # fmt: skip
    try:
        kubectl.apply(load_example("llama-8b-gpu.yaml"))
        wait_condition(kubectl, "llama-8b", "Ready", timeout=120)
        wait_until(
            lambda: (get(kubectl, "im", "llama-8b") or {}).get("status", {}).get("readyReplicas") == 2,
            timeout=60,
            what="2 ready replicas",
        )
        pods = kubectl.json("get", "pods", "-l", "kvpilot.dev/model=llama-8b")["items"]
        assert len(pods) == 2
        for pod in pods:
            c = pod["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert pod["spec"]["nodeSelector"]["kvpilot.dev/gpu-type"] == "h100"
            assert pod["spec"]["nodeName"].startswith("kvpilot-gpu-")
        out = kubectl("get", "im")
        header = out.splitlines()[0].split()
        assert header == ["NAME", "MODEL", "REPLICAS", "READY", "KV", "AGE"]
        assert "pvc://models/llama-3.1-8b-instruct" in out
        assert (
            kubectl("get", "inferencemodel", "llama-8b", "-o", "name")
            == "inferencemodel.kvpilot.dev/llama-8b\n"
        )
    finally:
        kubectl.run("delete", "inferencemodel", "llama-8b", "--wait=true", check=False)
        kubectl.run("delete", "pvc", "models", "--wait=false", check=False)
        kubectl.run("delete", "pv", pv_name, "--wait=false", check=False)


def test_scale_subresource(operator: OperatorProcess, kubectl: Kubectl) -> None:
    kubectl.apply(model("scaled", replicas=1, resources={"gpus": 1}))
    wait_condition(kubectl, "scaled", "Ready")
    kubectl("scale", "im/scaled", "--replicas", "3")
    wait_until(
        lambda: (get(kubectl, "deployment", "scaled") or {}).get("status", {}).get("readyReplicas") == 3,
        timeout=60,
        what="deployment scaled to 3",
    )
    wait_until(
        lambda: (get(kubectl, "im", "scaled") or {}).get("status", {}).get("readyReplicas") == 3,
        timeout=60,
        what="status.readyReplicas == 3",
    )
    scale = json.loads(
        kubectl(
            "get",
            "--raw",
            f"/apis/kvpilot.dev/v1alpha1/namespaces/{kubectl.namespace}/inferencemodels/scaled/scale",
        )
    )
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "kvpilot.dev/model=scaled"


def test_autoscaled_model_leaves_replicas_to_the_autoscaler(
    operator: OperatorProcess, kubectl: Kubectl
) -> None:
    kubectl("create", "secret", "generic", "hf-token", "--from-literal=token=hf_test")
    kubectl.apply(load_example("autoscaled.yaml"))
    dep = wait_until(lambda: get(kubectl, "deployment", "qwen-7b"), timeout=30, what="Deployment")
    assert dep["spec"]["replicas"] == 1  # autoscaling.minReplicas
    init = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init[
        "env"
    ]
    im = get(kubectl, "im", "qwen-7b")
    assert im is not None and "replicas" not in im["spec"]
    # The autoscaler scales through the scale subresource; the operator follows, never writes it back.
    kubectl("scale", "im/qwen-7b", "--replicas", "2")
    wait_until(
        lambda: (get(kubectl, "deployment", "qwen-7b") or {}).get("spec", {}).get("replicas") == 2,
        timeout=30,
        what="deployment follows spec.replicas",
    )
    im = get(kubectl, "im", "qwen-7b")
    assert im is not None
    replica_managers = [
        m["manager"]
        for m in im["metadata"]["managedFields"]
        if "f:replicas" in json.dumps(m.get("fieldsV1", {}))
    ]
    assert "kvpilot-operator" not in replica_managers


def test_spec_change_rolls_the_deployment(operator: OperatorProcess, kubectl: Kubectl) -> None:
    kubectl.apply(model("rolling", replicas=2, resources={"gpus": 1}))
    wait_until(
        lambda: (get(kubectl, "im", "rolling") or {}).get("status", {}).get("readyReplicas") == 2,
        timeout=60,
        what="2 ready",
    )
    before = get(kubectl, "deployment", "rolling")
    assert before is not None
    old_hash = before["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"]
    old_rs = {
        rs["metadata"]["name"] for rs in kubectl.json("get", "rs", "-l", "kvpilot.dev/model=rolling")["items"]
    }

    kubectl(
        "patch", "im", "rolling", "--type=merge", "-p", json.dumps({"spec": {"runtime": {"maxNumSeqs": 8}}})
    )
    wait_until(
        lambda: (
            (get(kubectl, "deployment", "rolling") or {})["spec"]["template"]["metadata"]["annotations"][
                "kvpilot.dev/config-hash"
            ]
            != old_hash
        ),
        timeout=30,
        what="new config hash",
    )
    kubectl("rollout", "status", "deployment/rolling", "--timeout=90s")
    new_rs = {
        rs["metadata"]["name"] for rs in kubectl.json("get", "rs", "-l", "kvpilot.dev/model=rolling")["items"]
    }
    assert new_rs - old_rs, "a new ReplicaSet (pod-template-hash) was created"
    config = yaml.safe_load((get(kubectl, "configmap", "rolling-config") or {})["data"]["config.yaml"])
    assert config["max_num_seqs"] == 8
    wait_until(
        lambda: (get(kubectl, "im", "rolling") or {}).get("status", {}).get("observedGeneration") == 2,
        timeout=30,
        what="observedGeneration 2",
    )
    wait_condition(kubectl, "rolling", "Progressing", "False", timeout=60)


def test_more_gpus_than_the_cluster_has_is_scaling_limited(
    operator: OperatorProcess, kubectl: Kubectl
) -> None:
    kubectl.apply(model("huge", replicas=1, resources={"gpus": 16}))
    limited = wait_condition(kubectl, "huge", "ScalingLimited", timeout=60)
    assert limited["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in limited["message"], limited["message"]
    assert limited["message"].startswith("1 pod cannot be scheduled: 0/")
    ready = condition(get(kubectl, "im", "huge"), "Ready")
    assert ready["status"] == "False"
    events = kubectl.json(
        "get", "events", "--field-selector", "involvedObject.name=huge,reason=Unschedulable"
    )["items"]
    assert any(e["involvedObject"]["kind"] == "InferenceModel" and e["type"] == "Warning" for e in events)


INVALID = [
    (
        {"model": {"source": "s3://bucket/llama"}},
        "spec.model.source must be one of builtin://NAME",
    ),
    (
        {"model": {"source": "builtin://smollm2-135m-instruct", "hfTokenSecret": {"name": "hf"}}},
        "spec.model.hfTokenSecret is only used with hf:// sources",
    ),
    (
        {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "replicas": 2,
            "autoscaling": {"maxReplicas": 4},
        },
        "spec.replicas and spec.autoscaling cannot both be set when an InferenceModel is created",
    ),
    (
        {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "autoscaling": {"minReplicas": 5, "maxReplicas": 2},
        },
        "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
    ),
    (
        {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "autoscaling": {"maxReplicas": 2, "metricsSource": "prometheus"},
        },
        "spec.autoscaling.prometheus (with at least url) is required when spec.autoscaling.metricsSource is prometheus",
    ),
    (
        {
            "model": {"source": "pvc://models/x"},
            "resources": {"gpus": 3},
            "runtime": {"tensorParallelSize": 2},
        },
        "spec.resources.gpus must equal spec.runtime.tensorParallelSize",
    ),
    (
        {"model": {"source": "builtin://smollm2-135m-instruct"}, "resources": {"cpu": "lots"}},
        "spec.resources.cpu must be a Kubernetes quantity such as '4' or '500m'",
    ),
    (
        {"model": {"source": "builtin://smollm2-135m-instruct"}, "replicas": -1},
        "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0",
    ),
    (
        {"model": {"source": "builtin://smollm2-135m-instruct"}, "runtime": {"kvCacheDtype": "fp4"}},
        'spec.runtime.kvCacheDtype: Unsupported value: "fp4"',
    ),
    (
        {"model": {"source": "builtin://smollm2-135m-instruct"}, "runtime": {"gpuMemoryUtilization": 1.5}},
        "spec.runtime.gpuMemoryUtilization: Invalid value",
    ),
    ({}, "spec.model: Required value"),
]


@pytest.mark.parametrize(("spec", "message"), INVALID, ids=[m[:40] for _, m in INVALID])
def test_invalid_specs_are_rejected_with_their_message(
    crds: None, kubectl: Kubectl, spec: dict[str, Any], message: str
) -> None:
    manifest = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    result = kubectl.run("apply", "-f", "-", input_text=json.dumps(manifest), check=False)
    assert result.returncode != 0, result.stdout
    assert message in result.stderr, result.stderr
    assert not kubectl.exists("im", "bad")


def test_deleting_the_model_garbage_collects_children(operator: OperatorProcess, kubectl: Kubectl) -> None:
    kubectl.apply(model("doomed", replicas=1, resources={"gpus": 1}))
    wait_condition(kubectl, "doomed", "Ready")
    kubectl("delete", "im", "doomed", "--wait=true", "--timeout=60s")
    for kind, name in [
        ("deployment", "doomed"),
        ("service", "doomed"),
        ("configmap", "doomed-config"),
        ("poddisruptionbudget", "doomed"),
    ]:
        wait_until(lambda k=kind, n=name: not kubectl.exists(k, n), timeout=60, what=f"{kind}/{name} gone")
    wait_until(
        lambda: not kubectl.json("get", "pods", "-l", "kvpilot.dev/model=doomed")["items"],
        timeout=60,
        what="pods gone",
    )


def test_operator_restart_makes_no_writes(
    operator: OperatorProcess, cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    for name in ("quiet-a", "quiet-b"):
        kubectl.apply(model(name, replicas=1, resources={"gpus": 1}))
    for name in ("quiet-a", "quiet-b"):
        wait_condition(kubectl, name, "Ready")
    time.sleep(3)  # let the last pod events settle
    before = {name: versions(kubectl, name) for name in ("quiet-a", "quiet-b")}

    operator.stop()
    restarted = OperatorProcess(cluster, operator.namespace, tmp_path, "--no-leader-elect").start()
    try:
        wait_until(
            lambda: restarted.metric('kvpilot_operator_reconcile_total{result="unchanged"}') >= 2,
            timeout=30,
            what="both models reconciled after the restart",
        )
        time.sleep(2)
        assert restarted.metric('kvpilot_operator_reconcile_total{result="changed"}') == 0
        assert restarted.metric('kvpilot_operator_child_apply_total{action="applied"') == 0
        assert restarted.metric("kvpilot_operator_status_patch_total") == 0
        after = {name: versions(kubectl, name) for name in ("quiet-a", "quiet-b")}
        assert after == before
    finally:
        restarted.stop()


def test_two_replicas_elect_one_leader(
    cluster: Cluster, crds: None, kubectl: Kubectl, tmp_path: Path
) -> None:
    first = OperatorProcess(cluster, kubectl.namespace or "", tmp_path, "--identity", "op-a").start()
    second = OperatorProcess(cluster, kubectl.namespace or "", tmp_path, "--identity", "op-b").start()
    try:
        lease = wait_until(
            lambda: (get(kubectl, "lease", "kvpilot-operator") or {}).get("spec", {}).get("holderIdentity"),
            timeout=30,
            what="a lease holder",
        )
        leader, standby = (first, second) if lease == "op-a" else (second, first)
        kubectl.apply(model("elected", replicas=1, resources={"gpus": 1}))
        wait_condition(kubectl, "elected", "Ready")
        assert leader.metric("kvpilot_operator_reconcile_total") >= 1
        assert standby.metrics().get("kvpilot_operator_leader", 0) == 0
        assert standby.metric("kvpilot_operator_reconcile_total") == 0

        leader.stop()  # releases the lease on SIGTERM
        wait_until(
            lambda: (
                (get(kubectl, "lease", "kvpilot-operator") or {}).get("spec", {}).get("holderIdentity")
                == ("op-b" if lease == "op-a" else "op-a")
            ),
            timeout=30,
            what="the standby takes over",
        )
        kubectl.apply(model("after-failover", replicas=1, resources={"gpus": 1}))
        wait_condition(kubectl, "after-failover", "Ready")
        assert standby.metrics().get("kvpilot_operator_leader") == 1
    finally:
        first.stop()
        second.stop()


def _set_container_ready(kubectl: Kubectl, pod: dict[str, Any], ready: bool) -> None:
    """What a kubelet writes when the readiness probe fails: the container and the pod not ready. When
    it passes again only the container is written; kwok's pod-ready-again stage makes the pod Ready."""
    status: dict[str, Any] = {
        "containerStatuses": [{**cs, "ready": ready} for cs in pod["status"]["containerStatuses"]]
    }
    if not ready:
        status["conditions"] = [
            {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
            for c in pod["status"]["conditions"]
        ]
    kubectl(
        "patch", "pod", pod["metadata"]["name"], "--subresource=status", "--type=strategic",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def test_losing_readiness_posts_one_warning_and_regaining_it_one_normal(
    operator: OperatorProcess, kubectl: Kubectl
) -> None:
    kubectl.apply(model("blinky", replicas=1, resources={"gpus": 1}))
    wait_condition(kubectl, "blinky", "Ready")
    pod = kubectl.json("get", "pods", "-l", "kvpilot.dev/model=blinky")["items"][0]

    def events(reason: str) -> list[str]:
        items = kubectl.json(
            "get", "events", "--field-selector", f"involvedObject.name=blinky,reason={reason}"
        )
        return [e["type"] for e in items["items"] for _ in range(int(e.get("count") or 1))]

    _set_container_ready(kubectl, pod, False)  # the only replica fails its readiness probe
    lost = wait_condition(kubectl, "blinky", "Ready", "False")
    assert lost["reason"] == "NoReplicaReady"
    wait_until(lambda: events("NotReady"), timeout=30, what="a NotReady event")
    assert events("NotReady") == ["Warning"]

    # The probe passes again; kwok's pod-ready-again stage makes the pod Ready.
    _set_container_ready(kubectl, kubectl.json("get", "pod", pod["metadata"]["name"]), True)
    wait_condition(kubectl, "blinky", "Ready")
    wait_until(lambda: len(events("Ready")) == 2, timeout=30, what="the second Ready event")
    assert events("NotReady") == ["Warning"]  # once per transition, never repeated
    assert events("Ready") == ["Normal", "Normal"]


def test_overlong_and_dotted_names_are_refused_with_why(crds: None, kubectl: Kubectl) -> None:
    for name, why in [
        ("m" * 64, "metadata.name must be at most 63 characters"),
        ("dotted.name", "metadata.name must not contain '.'"),
    ]:
        result = kubectl.run(
            "apply", "-f", "-", input_text=yaml.safe_dump(model(name, replicas=0)), check=False
        )
        assert result.returncode != 0 and why in result.stderr, result.stderr
        assert not kubectl.exists("inferencemodel", name)


CUDA_OOM = {"reason": "Error", "exitCode": 1, "message": "torch.OutOfMemoryError: CUDA out of memory."}
MEMORY_LIMIT_OOM = {"reason": "OOMKilled", "exitCode": 137}


@pytest.mark.parametrize(
    ("terminated", "changes"),
    [
        (
            CUDA_OOM,
            {
                "gpuMemoryUtilization": "0.9 -> 0.85",
                "maxNumSeqs": "64 -> 32",
                "maxNumBatchedTokens": "2048 -> 1024",
            },
        ),
        (MEMORY_LIMIT_OOM, {"memory": "16Gi -> 24Gi"}),
    ],
    ids=["cuda-oom", "memory-limit"],
)
def test_pod_oom_degrades_and_adapts_what_matches_the_cause(
    operator: OperatorProcess, kubectl: Kubectl, terminated: dict[str, Any], changes: dict[str, str]
) -> None:
    """kwok runs no container, so the OOM is written into the pod's status by hand, as a kubelet would."""
    kubectl.apply(
        model("oomy", replicas=1, resources={"gpus": 1, "memory": "16Gi"}, oomPolicy={"adapt": True})
    )
    wait_condition(kubectl, "oomy", "Ready")
    pod = kubectl.json("get", "pods", "-l", "kvpilot.dev/model=oomy")["items"][0]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    statuses = pod["status"]["containerStatuses"]
    statuses[0]["restartCount"] = 1
    statuses[0]["lastState"] = {"terminated": {**terminated, "startedAt": now, "finishedAt": now}}
    kubectl(
        "patch", "pod", pod["metadata"]["name"], "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"containerStatuses": statuses}}),
    )  # fmt: skip
    adaptation = wait_until(
        lambda: (get(kubectl, "im", "oomy") or {}).get("status", {}).get("oomAdaptation"),
        timeout=30,
        what="status.oomAdaptation",
    )
    assert adaptation["count"] == 1
    assert adaptation["changes"] == changes
    config = yaml.safe_load((get(kubectl, "configmap", "oomy-config") or {})["data"]["config.yaml"])
    container = (get(kubectl, "deployment", "oomy") or {})["spec"]["template"]["spec"]["containers"][0]
    if terminated is CUDA_OOM:
        assert config["gpu_memory_utilization"] == 0.85 and config["max_num_seqs"] == 32
        assert container["resources"]["limits"]["memory"] == "16Gi"
    else:  # host memory: the GPU settings stay, the limit goes up
        assert config["gpu_memory_utilization"] == 0.9 and config["max_num_seqs"] == 64
        assert container["resources"]["limits"]["memory"] == "24Gi"
    for reason in ("OOMKilled", "OOMAdapted"):  # Degraded turned True; the config was adapted
        events = kubectl.json(
            "get", "events", "--field-selector", f"involvedObject.name=oomy,reason={reason}"
        )
        assert [e["type"] for e in events["items"]] == ["Warning"], reason
    # The adapted Deployment rolls the pods; the new pod has no OOM, so Degraded clears again.
    wait_condition(kubectl, "oomy", "Degraded", "False", timeout=60)
    assert (get(kubectl, "im", "oomy") or {})["status"]["oomAdaptation"]["count"] == 1


if os.environ.get("KVPILOT_E2E_DEBUG"):  # pragma: no cover - a hook for poking at a failing test by hand

    @pytest.fixture(autouse=True)
    def _show_operator_log(request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        op = request.node.funcargs.get("operator")
        if op is not None:
            print(op.log())


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList", "plural": "servicemonitors",
                  "singular": "servicemonitor"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        }],
    },
}  # fmt: skip


def test_service_monitor_only_when_its_crd_exists(
    cluster: Cluster, crds: None, kubectl: Kubectl, tmp_path: Path
) -> None:
    crd = "crd/servicemonitors.monitoring.coreos.com"
    installed_here = not cluster.kubectl.exists(crd)
    if not installed_here:
        # A shared cluster may have one; a fresh cluster (CI) never does, so there it is a leak.
        missing("a cluster without the ServiceMonitor CRD", "it is already installed; not touching it")
    op = OperatorProcess(cluster, kubectl.namespace or "", tmp_path, "--no-leader-elect").start()
    try:
        kubectl.apply(model("plain", replicas=0))
        wait_until(lambda: get(kubectl, "deployment", "plain"), timeout=30, what="Deployment")
    finally:
        op.stop()
    cluster.kubectl.apply(SERVICE_MONITOR_CRD)
    try:
        cluster.kubectl("wait", "--for=condition=Established", crd, "--timeout=60s")
        op = OperatorProcess(cluster, kubectl.namespace or "", tmp_path, "--no-leader-elect").start()
        try:
            kubectl.apply(model("monitored", replicas=0))
            sm = wait_until(
                lambda: get(kubectl, "servicemonitor", "monitored"), timeout=30, what="ServiceMonitor"
            )
            assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
            assert sm["metadata"]["ownerReferences"][0]["name"] == "monitored"
            # The model from before the CRD existed gets one too once reconciled (the restart did it).
            wait_until(
                lambda: get(kubectl, "servicemonitor", "plain"), timeout=30, what="ServiceMonitor for plain"
            )
        finally:
            op.stop()
    finally:
        cluster.kubectl.run("delete", crd, "--wait=false", check=False)
