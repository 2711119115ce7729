"""`helm install` of the chart with the images built here: the operator, autoscaler and router run as
pods on the real node, from the operator image.

What is real here and is not in the kwok suite (e2e/test_helm.py): the containers start from the
images, their probes (/healthz, /readyz, /ready) decide Ready, two operator pods elect a leader
through the Lease from inside the pod network (in-cluster config and the ServiceAccount token the
kubelet projects; the `kubernetes` Service is reached through e2e/kubelet_node.py's DNAT rule, there
is no kube-proxy), the PodDisruptionBudget counts healthy pods the kubelet reports, and the router pod
routes a completion to the model pod the operator pod created, pod IP to pod IP. The test reaches the
router by its pod IP (no Service routing without kube-proxy).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness import Cluster, Kubectl, wait_until
from e2e.kubelet_node import NODE_NAME, REAL_NODE_LABEL, REAL_NODE_TOLERATION
from e2e.realnode import pods as rp
from e2e.realnode.pods import inference_model
from tests.charts.tools import CHART, helm

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "rn"
FULL = f"{RELEASE}-kvpilot"


def _split(image: str) -> tuple[str, str, str]:
    """registry, repository, tag of an image reference such as ghcr.io/kvpilot/kvpilot-operator:0.1.0."""
    registry, _, rest = image.partition("/")
    repository, _, tag = rest.rpartition(":")
    return registry, repository, tag


@pytest.fixture
def release(
    cluster: Cluster, namespace: str, operator_image: str, runtime_image: str, tmp_path: Path
) -> Iterator[str]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferencemodels.kvpilot.dev", "--timeout=60s")
    _, _, op_tag = _split(operator_image)
    _, rt_repository, rt_tag = _split(runtime_image)
    values = {
        "watchNamespaces": [namespace],
        "operator": {
            "replicas": 2,
            "image": {"tag": op_tag, "pullPolicy": "Never"},
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [REAL_NODE_TOLERATION],
        },
        "autoscaler": {
            "image": {"tag": op_tag, "pullPolicy": "Never"},
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [REAL_NODE_TOLERATION],
        },
        "router": {
            "enabled": True,
            "replicas": 1,
            "image": {"tag": op_tag, "pullPolicy": "Never"},
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [REAL_NODE_TOLERATION],
        },
        "runtime": {"image": {"repository": rt_repository, "tag": rt_tag, "pullPolicy": "Never"}},
        "metrics": {"serviceMonitor": {"enabled": False}},
        "prometheusRule": {"enabled": False},
    }
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))
    argv = [helm(), "--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace]
    started = time.monotonic()
    result = subprocess.run(
        [*argv, "install", RELEASE, str(CHART), "-f", str(values_file), "--wait", "--timeout", "600s"],
        capture_output=True,
        text=True,
        timeout=660,
        env=cluster.env(),
    )
    if result.returncode != 0:
        listing = cluster.kubectl.run("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        events = cluster.kubectl.run("get", "events", "-n", namespace, check=False).stdout[-4000:]
        pytest.fail(f"helm install failed:\n{result.stderr}\n{listing}\n{events}", pytrace=False)
    print(f"REALNODE_FIGURES helm_install_wait_s={time.monotonic() - started:.1f}")
    yield RELEASE
    subprocess.run(
        [*argv, "uninstall", RELEASE, "--wait", "--timeout", "180s"], capture_output=True, timeout=240
    )


def test_chart_runs_operator_autoscaler_router_as_pods(
    real_node: object, release: str, kubectl: Kubectl, namespace: str, cluster: Cluster
) -> None:
    chart_pods = kubectl.json("get", "pods", "-l", f"app.kubernetes.io/instance={release}")["items"]
    by_component: dict[str, list[dict[str, object]]] = {}
    for pod in chart_pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert rp.condition(pod, "Ready").get("status") == "True", pod["metadata"]["name"]
        component = pod["metadata"]["labels"].get("app.kubernetes.io/component", "")
        by_component.setdefault(component, []).append(pod)
        for status in pod["status"]["containerStatuses"]:
            assert status["restartCount"] == 0, (pod["metadata"]["name"], status)
    assert sorted((c, len(p)) for c, p in by_component.items()) == [
        ("autoscaler", 1),
        ("operator", 2),
        ("router", 1),
    ]

    # Leader election from inside the pods: one operator pod holds the Lease.
    operator_pods = {p["metadata"]["name"] for p in by_component["operator"]}  # type: ignore[index]
    lease = wait_until(
        lambda: kubectl.json("get", "lease", f"{FULL}-operator")["spec"].get("holderIdentity"),
        timeout=60,
        what="the operator Lease's holder",
    )
    assert any(lease.startswith(name) for name in operator_pods), (lease, operator_pods)

    # The PodDisruptionBudget counts what the kubelet reports.
    pdb = kubectl.json("get", "poddisruptionbudget", f"{FULL}-operator")
    assert pdb["status"]["currentHealthy"] == 2 and pdb["status"]["disruptionsAllowed"] == 1, pdb["status"]

    # An InferenceModel: the operator pod renders it, the kubelet runs it, the router pod routes to it.
    objects = rp.weights_volume(namespace, "weights")
    kubectl.apply(objects)
    try:
        kubectl.apply(inference_model("weights"))
        wait_until(
            lambda: any(
                rp.condition(p, "Ready").get("status") == "True"
                for p in rp.pods(kubectl, "kvpilot.dev/model=smol")
            ),
            timeout=600,
            interval=1,
            what="the model pod the chart's operator created to be Ready",
        )
        router = by_component["router"][0]
        router_url = f"http://{router['status']['podIP']}:8080"  # type: ignore[index]
        body = {"model": "smollm2", "prompt": "The harbour at dawn", "max_tokens": 8, "temperature": 0.0}
        out = wait_until(
            lambda: _completion(f"{router_url}/v1/completions", body),
            timeout=120,
            what="a completion through the router pod",
        )
        assert out["usage"]["completion_tokens"] == 8
    finally:
        kubectl.run("delete", "inferencemodel", "smol", "--wait=false", check=False)
        cluster.kubectl.run("delete", "pv", objects[0]["metadata"]["name"], "--wait=false", check=False)


def _completion(url: str, body: dict[str, object]) -> dict[str, object] | None:
    try:
        return rp.post_json(url, body, timeout=120)
    except OSError:  # the router has not seen the pod's endpoint yet
        return None
