"""spec.engine: vllm on the real control plane: a vLLM InferenceModel beside a kvpilot one, both served
through one router, with real parts only.

- `kvpilot operator` renders both models: a `kvpilot serve` pod, and a `vllm serve --config` pod whose
  ConfigMap holds vLLM's config file (spec.runtime mapped flag by flag, operator/vllm_pod.py);
- e2e/localpods.py runs each pod's command as a local process: kvpilot's runtime, and vLLM's CPU build
  from scripts/vllm_cpu.sh for the vLLM pod (SmolLM2-135M-Instruct converted to safetensors), Ready
  when its probe path (/ready, /health) answers;
- the router discovering both models' pods through the API server, the official `openai` client in
  front of it, and the autoscaler's pod metric source scraping the vLLM pod.

Asserted: the API server refuses, with their messages, the specs vLLM cannot serve as written (the CRD's
CEL rules, api/engine.py) and takes the rest; both models Ready; each answers through the router (completions, and chat for vLLM); the
router's load view of the vLLM pod (KV use, waiting) comes from its /metrics, and so does the
autoscaler's sample (KV use, queue, finished requests, tokens). The time the vLLM pod took from
start to Ready is printed as VLLM_E2E_FIGURES (run with -s).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import Cluster, Kubectl, stop_all, wait_until
from e2e.localpods import LocalKubelet
from e2e.localrouter import LocalPodSource, RouterThread
from e2e.processes import OperatorProcess
from e2e.test_autoscaler_e2e import get_model
from e2e.test_router_e2e import api_client, crds  # noqa: F401 (fixtures)
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sources import ModelRef, PodScrapeSource, PodTarget
from kvpilot.router.kube_discovery import kube_source
from kvpilot.router.pool import QueueSettings
from kvpilot.router.server import Router, RouterSettings
from tests.api.test_spec_engine import INVALID, VALID
from tests.vllm_cpu import require_vllm

KVPILOT_MODEL = "smol"
VLLM_MODEL = "smol-vllm"
KVPILOT_FLAGS = ("--device", "cpu", "--kv-cache-memory", "48MiB", "--threads", "1")
# vLLM's CPU build on a shared 2-core machine: no torch.compile warm-up (minutes) and a small KV pool.
VLLM_FLAGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20))


def models(vllm_model_dir: Path) -> list[dict[str, Any]]:
    def im(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": name},
            "spec": spec,
        }

    return [
        im(KVPILOT_MODEL, {"model": {"source": "builtin://smollm2-135m-instruct"}, "resources": {"gpus": 0}}),
        im(
            VLLM_MODEL,
            {
                "engine": "vllm",
                "model": {"source": f"file://{vllm_model_dir}"},
                "resources": {"gpus": 0},
                "runtime": {"maxModelLen": 2048, "maxNumSeqs": 4, "shutdownTimeoutSeconds": 5},
            },
        ),
    ]


async def scrape_like_the_autoscaler(namespace: str, name: str, ip: str, port: int) -> MetricsSnapshot:
    """The autoscaler's pod metric source (metricsSource: pods) reading one pod."""
    source = PodScrapeSource(timeout_s=10)
    try:
        return await source.collect(ModelRef(namespace, VLLM_MODEL, VLLM_MODEL), [PodTarget(name, ip, port)])
    finally:
        await source.close()


def ready(api: Any, namespace: str, name: str) -> bool:
    status = get_model(api, namespace, name).get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return status.get("readyReplicas") == 1 and conditions.get("Ready") == "True"


def test_vllm_model_beside_a_kvpilot_model_behind_one_router(
    cluster: Cluster,
    crds: None,  # noqa: F811
    namespace: str,
    kubectl: Kubectl,
    api_client: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    import openai

    vllm = require_vllm()
    figures: dict[str, Any] = {}
    kubelet = LocalKubelet(
        api_client,
        namespace,
        "kvpilot.dev/model",
        tmp_path / "pods",
        extra_args=KVPILOT_FLAGS,
        executables={"vllm": str(vllm.vllm)},
        command_args={"vllm": VLLM_FLAGS},
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )
    router = Router(
        RouterSettings(
            policy="least-loaded",
            queue=QueueSettings(max_queue=16, queue_timeout_s=300, cold_start_timeout_s=600),
            scrape_interval_s=1,
        )
    )
    router.add_source(LocalPodSource(kube_source(namespace, str(cluster.kubeconfig)), kubelet))
    rt = RouterThread(router)
    operator = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect")
    try:
        operator.start()
        kubelet.start()
        kubectl.apply(models(vllm.model))
        rt.start()

        # The operator rendered `vllm serve --config` with vLLM's config file in the ConfigMap.
        deployment = kubectl.json("get", "deployment", VLLM_MODEL)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][:4] == ["vllm", "serve", "--config", "/etc/kvpilot/config.yaml"]
        config = yaml.safe_load(
            kubectl.json("get", "configmap", f"{VLLM_MODEL}-config")["data"]["config.yaml"]
        )
        assert config["model"] == str(vllm.model) and config["served-model-name"] == VLLM_MODEL
        assert (config["max-model-len"], config["max-num-seqs"], config["shutdown-timeout"]) == (2048, 4, 5)

        for name in (KVPILOT_MODEL, VLLM_MODEL):
            wait_until(lambda n=name: ready(api_client, namespace, n), timeout=120, what=f"{name} Ready")

        def local_ready() -> bool:
            pods = kubelet.all_pods()
            return len(pods) == 2 and all(p.ready_at is not None for p in pods)

        wait_until(local_ready, timeout=900, interval=2, what="both model servers answering their probes")
        vllm_pod = next(p for p in kubelet.all_pods() if p.model == VLLM_MODEL)
        assert vllm_pod.ready_path == "/health" and vllm_pod.ready_at is not None
        figures["vllm_start_to_ready_s"] = round(vllm_pod.ready_at - vllm_pod.started_at, 1)
        wait_until(
            lambda: all(
                router.pools.get(m) and router.pools[m].routable() for m in (KVPILOT_MODEL, VLLM_MODEL)
            ),
            timeout=60,
            what="the router to route to both models",
        )

        # Both answer through the one router, with the official client.
        client = openai.OpenAI(base_url=f"{rt.url}/v1", api_key="unused", max_retries=0, timeout=300)
        served = {m.id for m in client.models.list().data}
        assert {KVPILOT_MODEL, VLLM_MODEL} <= served
        for name in (KVPILOT_MODEL, VLLM_MODEL):
            done = client.completions.create(
                model=name, prompt="The capital of France is", max_tokens=8, temperature=0
            )
            assert done.model == name and done.choices[0].text.strip(), done
            assert done.usage is not None and done.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model=VLLM_MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content, chat

        # The router's view of the vLLM pod's load comes from its /metrics (vLLM's names).
        def router_view() -> tuple[float, int] | None:
            pods = list(router.pools[VLLM_MODEL].pods.values())
            if len(pods) != 1 or pods[0].kv_usage is None or pods[0].waiting is None:
                return None
            return pods[0].kv_usage, pods[0].waiting

        kv, waiting = wait_until(router_view, timeout=30, what="the router's load view of the vLLM pod")
        assert 0.0 <= kv <= 1.0 and waiting >= 0
        figures["router_view"] = {"kv_usage": kv, "waiting": waiting}

        # The autoscaler's pod source reads the same page into a full sample.
        snapshot = asyncio.run(
            scrape_like_the_autoscaler(namespace, vllm_pod.name, vllm_pod.host, vllm_pod.port)
        )
        (sample,) = snapshot.samples
        assert sample.pod == vllm_pod.name and 0.0 <= sample.kv_cache_usage <= 1.0
        assert chat.usage is not None
        assert (
            sample.completed_total == 2 and sample.generation_tokens_total == 8 + chat.usage.completion_tokens
        )
        assert sample.prompt_tokens_total is not None and sample.prompt_tokens_total > 0
        assert sample.ttft_buckets and sample.itl_buckets and sample.output_tokens_buckets
        figures["autoscaler_sample"] = {"kv": sample.kv_cache_usage, "waiting": sample.num_waiting,
                                        "completed": sample.completed_total}  # fmt: skip
        assert kubelet.errors == []
    finally:
        t0 = time.monotonic()
        stop_all(rt.stop, kubelet.stop, operator.stop)
        figures["stop_s"] = round(time.monotonic() - t0, 1)
        print("VLLM_E2E_FIGURES " + json.dumps(figures))


def _apply(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> Any:
    manifest = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": spec,
    }
    return kubectl.run("apply", "--dry-run=server", "-f", "-", input_text=json.dumps(manifest), check=False)


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_the_api_server_refuses_what_vllm_cannot_do(
    crds: None,  # noqa: F811
    kubectl: Kubectl,
    spec: dict[str, Any],
    message: str,
) -> None:
    result = _apply(kubectl, "bad", spec)
    assert result.returncode != 0, result.stdout
    assert message in result.stderr, result.stderr


def test_the_api_server_takes_what_vllm_can_do(crds: None, kubectl: Kubectl) -> None:  # noqa: F811
    for i, spec in enumerate(VALID):
        result = _apply(kubectl, f"good-{i}", spec)
        assert result.returncode == 0, (spec, result.stderr)
