"""The e2e control plane itself: scheduling onto fake GPU nodes, controllers, CRDs, RBAC, tokens.

Everything goes through the real kubectl against the real apiserver; kwok only plays the kubelet.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import pytest

from e2e.harness import E2E_NODE_LABEL, Cluster, Kubectl, KubectlError, wait_until

pytestmark = pytest.mark.e2e


def gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"kvpilot.dev/gpu-type": "h100"},
                    "containers": [
                        {
                            "name": "server",
                            # Never pulled: kwok only fakes the kubelet.
                            "image": "registry.invalid/kvpilot-runtime:e2e",
                            "resources": {
                                "limits": {"nvidia.com/gpu": str(gpus), "cpu": "1", "memory": "1Gi"}
                            },
                        }
                    ],
                },
            },
        },
    }


def pods(kubectl: Kubectl, app: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl.json("get", "pods", "-l", f"app={app}")["items"]
    return items


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


def test_fake_gpu_nodes_are_ready(cluster: Cluster) -> None:
    cluster.kubectl("wait", "--for=condition=Ready", "node", "-l", f"{E2E_NODE_LABEL}=true", "--timeout=60s")
    nodes = cluster.kubectl.json("get", "nodes", "-l", f"{E2E_NODE_LABEL}=true")["items"]
    assert len(nodes) >= 2
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        labels = node["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["kvpilot.dev/gpu-type"] == "h100"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    version = json.loads(cluster.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"].startswith("v1.")


def test_gpu_deployment_becomes_running_and_ready(kubectl: Kubectl) -> None:
    kubectl.apply(gpu_deployment("llm", replicas=3, gpus=1))
    kubectl("rollout", "status", "deployment/llm", "--timeout=90s")

    replica_sets = kubectl.json("get", "replicasets", "-l", "app=llm")["items"]
    assert len(replica_sets) == 1
    assert replica_sets[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert replica_sets[0]["status"]["readyReplicas"] == 3

    kubectl("wait", "--for=condition=Ready", "pod", "-l", "app=llm", "--timeout=60s")
    gpu_nodes = {
        n["metadata"]["name"] for n in kubectl.json("get", "nodes", "-l", f"{E2E_NODE_LABEL}=true")["items"]
    }
    running = pods(kubectl, "llm")
    assert len(running) == 3
    for pod in running:
        assert pod["status"]["phase"] == "Running"
        assert condition(pod, "Ready")["status"] == "True"
        assert pod["spec"]["nodeName"] in gpu_nodes
        assert pod["metadata"]["ownerReferences"][0]["name"] == replica_sets[0]["metadata"]["name"]
        # ServiceAccount admission mounted a projected token, signed with the e2e service-account key.
        assert any(v["name"].startswith("kube-api-access-") for v in pod["spec"]["volumes"])


def test_a_pod_the_node_controller_marked_not_ready_becomes_ready_again(kubectl: Kubectl) -> None:
    """After an API-server outage longer than the node monitor grace period, kube-controller-manager
    finds the nodes' leases stale and marks their pods not Ready, changing only the pod's Ready
    condition (MarkPodsNotReady). kwok's own pod-ready stage selects only Pending pods, so these stayed
    unready forever; e2e/kwok/stages.yaml's pod-ready-again stage makes them Ready again. The
    controller's write is made here directly, so the shared cluster needs no outage."""
    kubectl.apply(gpu_deployment("survivor", replicas=1, gpus=1))
    kubectl("rollout", "status", "deployment/survivor", "--timeout=90s")
    pod = pods(kubectl, "survivor")[0]
    name = pod["metadata"]["name"]
    conditions = [
        {**c, "status": "False"} if c["type"] == "Ready" else c for c in pod["status"]["conditions"]
    ]
    kubectl(
        "patch", "pod", name, "--subresource=status", "--type=strategic",
        "-p", json.dumps({"status": {"conditions": conditions}}),
    )  # fmt: skip
    wait_until(
        lambda: condition(kubectl.json("get", "pod", name), "Ready")["status"] == "True",
        timeout=30,
        what="kwok to make the pod Ready again",
    )
    # Same pod, not a replacement: nothing had to be deleted.
    assert [p["metadata"]["name"] for p in pods(kubectl, "survivor")] == [name]


def test_a_container_that_is_not_ready_keeps_its_pod_unready(kubectl: Kubectl) -> None:
    """The stage above must not undo a failed readiness probe: a container marked not ready stays so."""
    kubectl.apply(gpu_deployment("probed", replicas=1, gpus=1))
    kubectl("rollout", "status", "deployment/probed", "--timeout=90s")
    pod = pods(kubectl, "probed")[0]
    name = pod["metadata"]["name"]
    statuses = [{**cs, "ready": False} for cs in pod["status"]["containerStatuses"]]
    conditions = [
        {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
        for c in pod["status"]["conditions"]
    ]
    kubectl(
        "patch", "pod", name, "--subresource=status", "--type=strategic",
        "-p", json.dumps({"status": {"conditions": conditions, "containerStatuses": statuses}}),
    )  # fmt: skip
    time.sleep(3)  # kwok reacts within milliseconds when a stage matches
    assert condition(kubectl.json("get", "pod", name), "Ready")["status"] == "False"


def test_pod_asking_for_too_many_gpus_is_unschedulable(kubectl: Kubectl) -> None:
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "greedy"},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.invalid/x",
                        "resources": {"limits": {"nvidia.com/gpu": "100"}},
                    }
                ]
            },
        }
    )

    def unschedulable() -> dict[str, Any] | None:
        cond = condition(kubectl.json("get", "pod", "greedy"), "PodScheduled")
        return cond if cond.get("reason") == "Unschedulable" else None

    cond = wait_until(unschedulable, timeout=60, what="PodScheduled=False/Unschedulable")
    assert cond["status"] == "False"
    assert "nvidia.com/gpu" in cond["message"]
    time.sleep(2)
    pod = kubectl.json("get", "pod", "greedy")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_deleting_a_deployment_garbage_collects_its_pods(kubectl: Kubectl) -> None:
    kubectl.apply(gpu_deployment("doomed", replicas=2, gpus=2))
    kubectl("rollout", "status", "deployment/doomed", "--timeout=90s")
    assert len(pods(kubectl, "doomed")) == 2

    # Background propagation: the apiserver deletes only the Deployment; the garbage collector in
    # kube-controller-manager removes the ReplicaSet and then its Pods, which kwok finalizes.
    kubectl("delete", "deployment", "doomed", "--cascade=background")
    wait_until(
        lambda: not kubectl.json("get", "replicasets", "-l", "app=doomed")["items"],
        timeout=60,
        what="ReplicaSet garbage collection",
    )
    wait_until(lambda: not pods(kubectl, "doomed"), timeout=60, what="Pod garbage collection")


def test_custom_resource_with_scale_subresource(cluster: Cluster, kubectl: Kubectl) -> None:
    group = f"e2e-{uuid.uuid4().hex[:8]}.kvpilot.dev"  # cluster-scoped: unique per run
    crd_name = f"scalers.{group}"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": crd_name},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "scalers", "singular": "scaler", "kind": "Scaler"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                                "status": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "selector": {"type": "string"},
                                    },
                                },
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                }
            ],
        },
    }
    cluster.kubectl.apply(crd)
    try:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name}", "--timeout=30s")
        resource = f"scalers.{group}"
        kubectl.apply(
            {
                "apiVersion": f"{group}/v1",
                "kind": "Scaler",
                "metadata": {"name": "s"},
                "spec": {"replicas": 1},
            }
        )
        kubectl("scale", resource, "s", "--replicas=4")
        assert kubectl.json("get", resource, "s")["spec"]["replicas"] == 4
        scale = kubectl.json("get", resource, "s", "--subresource=scale")
        assert scale["kind"] == "Scale"
        assert scale["spec"]["replicas"] == 4
        # --current-replicas is checked against .status.replicas, which nothing has set.
        with pytest.raises(KubectlError):
            kubectl("scale", resource, "s", "--current-replicas=7", "--replicas=2")
    finally:
        cluster.kubectl.run("delete", "crd", crd_name, "--wait=false", check=False)


def test_rbac_and_service_account_tokens(kubectl: Kubectl, namespace: str) -> None:
    token = kubectl("create", "token", "default", "--duration=10m").strip()
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["iss"] == "https://kubernetes.default.svc.cluster.local"
    assert claims["sub"] == f"system:serviceaccount:{namespace}:default"

    sa = f"system:serviceaccount:{namespace}:default"
    assert kubectl.run("auth", "can-i", "list", "pods", f"--as={sa}", check=False).stdout.strip() == "no"
    kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods")
    kubectl(
        "create", "rolebinding", "pod-reader", "--role=pod-reader", f"--serviceaccount={namespace}:default"
    )
    wait_until(
        lambda: (
            kubectl.run("auth", "can-i", "list", "pods", f"--as={sa}", check=False).stdout.strip() == "yes"
        ),
        timeout=10,
        what="RBAC to allow the ServiceAccount",
    )
