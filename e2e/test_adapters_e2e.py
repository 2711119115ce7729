"""LoRA adapters swapped in a running pod on the real control plane, without restarting it.

- `kvpilot operator` reconciling an InferenceModel (a tiny random Llama, PEFT adapters built here);
- a fake node of our own whose spec.podCIDR lies in 127.0.0.0/8, so kwok gives its pods loopback
  addresses; e2e/localpods.py (pod_network=True) runs a real `kvpilot serve` per pod on the pod's
  podIP:8000, where the operator's GET /v1/models and POST /v1/(un)load_lora_adapter reach it, as
  they would a pod in a cluster.

Asserted: after spec.adapters swaps `sql` for `chat`, the same pod (name, uid) and the same process
serve `chat` (200) and no longer `sql` (404), with the runtime API key from a Secret, and
status.adapters and the AdaptersLoaded condition say so.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import Cluster, Kubectl, wait_until
from e2e.localpods import LocalKubelet
from e2e.processes import OperatorProcess
from e2e.test_autoscaler_e2e import get_model
from tests.needs import require_module

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"
MODEL = "tiny"
KEY = "e2e-adapter-key"
RUNTIME_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--block-size", "8",
                 "--threads", "1")  # fmt: skip


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_module("peft", "pip install -e .[test]")
    from tests.runtime.test_lora import ADAPTERS, random_llama, write_adapter, write_base

    root = tmp_path_factory.mktemp("adapters-e2e")
    write_base(root / "base")
    for i, name in enumerate(("sql", "chat")):
        rank, alpha, rslora, targets = ADAPTERS[name]
        write_adapter(random_llama(), root / name, rank, alpha, rslora, targets, seed=400 + i)
    return root


@pytest.fixture
def loopback_node(cluster: Cluster) -> Any:
    """A kwok node of this test's own, its pod CIDR a random /24 of 127.0.0.0/8; yields its gpu-type."""
    rng = random.Random()
    suffix = f"{rng.randrange(16**6):06x}"
    name, gpu_type = f"kvpilot-lo-{suffix}", f"lo-{suffix}"
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    cluster.kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake"},
                "labels": {"kubernetes.io/hostname": name, "type": "kwok", "kvpilot.dev/gpu-type": gpu_type},
            },
            "spec": {"podCIDR": f"127.{rng.randint(64, 254)}.{rng.randint(0, 255)}.0/24"},
            "status": {"capacity": resources, "allocatable": resources},
        }
    )
    try:
        yield gpu_type
    finally:
        cluster.kubectl("delete", "node", name, "--wait=false")


def model(weights: Path, gpu_type: str, *adapters: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"source": f"file://{weights / 'base'}"},
            "resources": {"gpus": 1, "gpuType": gpu_type},
            "runtime": {"maxLoras": 2},
            "env": [{"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "rt", "key": "key"}}}],
            "adapters": [{"name": n, "source": f"file://{weights / n}"} for n in adapters],
        },
    }


def complete(url: str, name: str) -> int:
    body = json.dumps({"model": name, "prompt": "w3 w4 w5", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def adapters_state(status: dict[str, Any]) -> tuple[Any, Any]:
    """status.adapters and the AdaptersLoaded condition's (status, reason)."""
    cond: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c["type"] == "AdaptersLoaded"), {}
    )
    return status.get("adapters"), (cond.get("status"), cond.get("reason"))


def test_adapter_swap_reaches_the_running_pod_without_a_restart(
    cluster: Cluster, namespace: str, kubectl: Kubectl, weights: Path, loopback_node: str, tmp_path: Path
) -> None:
    from kubernetes import config

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    kubectl("create", "secret", "generic", "rt", f"--from-literal=key={KEY}")
    env = {**cluster.env(), "KVPILOT_API_KEY": KEY, "OMP_NUM_THREADS": "1"}  # the container env, by hand
    kubelet = LocalKubelet(
        api_client, namespace, f"kvpilot.dev/model={MODEL}", tmp_path / "pods",
        extra_args=RUNTIME_FLAGS, env=env, pod_network=True,
    )  # fmt: skip
    # Resync every 2 s: kwok reports the pod Ready before the process listens, as a kubelet without a
    # readiness probe would; the periodic resync (60 s by default) is what then reaches it.
    operator = OperatorProcess(cluster, namespace, tmp_path, "--resync-seconds", "2")

    def wait_loaded(name: str) -> None:
        """Until status.adapters is [name] on 1 replica and AdaptersLoaded is True (the last status and
        the operator's log in the failure)."""
        seen: dict[str, Any] = {}

        def loaded() -> bool:
            seen.update(get_model(api_client, namespace, MODEL).get("status") or {})
            return bool(
                adapters_state(seen) == ([{"name": name, "loadedReplicas": 1}], ("True", "AllLoaded"))
            )

        try:
            wait_until(loaded, timeout=30, what=f"status.adapters: {name} loaded")
        except TimeoutError as e:
            raise AssertionError(f"{e}; last status {seen}; operator log:\n{operator.log()}") from e

    try:
        operator.start()
        kubelet.start()
        kubectl.apply(model(weights, loopback_node, "sql"))
        wait_until(lambda: kubelet.ready_urls(), timeout=90, what="a runtime Ready")
        [(pod_name, url)] = kubelet.ready_urls().items()
        [before] = kubelet.live()
        assert url == f"http://{kubectl.json('get', 'pod', pod_name)['status']['podIP']}:8000"
        wait_loaded("sql")
        assert complete(url, "sql") == 200

        # Swap sql for chat: the operator unloads and loads through the pod's address; nothing restarts.
        kubectl(
            "patch", "inferencemodel", MODEL, "--type=merge", "-p",
            json.dumps({"spec": {"adapters": model(weights, loopback_node, "chat")["spec"]["adapters"]}}),
        )  # fmt: skip
        wait_loaded("chat")
        assert complete(url, "chat") == 200
        assert complete(url, "sql") == 404
        pods = kubectl.json("get", "pods", "-l", f"kvpilot.dev/model={MODEL}")["items"]
        assert [(p["metadata"]["name"], p["metadata"]["uid"]) for p in pods] == [(pod_name, before.uid)]
        assert [(p.uid, p.proc.pid, p.exit_code) for p in kubelet.all_pods()] == [
            (before.uid, before.proc.pid, None)
        ]
        assert kubelet.errors == []
    finally:
        kubelet.stop()
        operator.stop()
        api_client.close()
