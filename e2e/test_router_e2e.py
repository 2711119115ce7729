"""The fleet router end to end: a model at zero replicas woken by its first request, then a burst
absorbed by a replica added mid-burst, with real parts only.

- the local control plane and the CRD; `kvpilot operator` rendering the InferenceModel (minReplicas 0)
  and writing status.routerEndpoint;
- e2e/localpods.py running a real `kvpilot serve` (SmolLM2 on CPU) per Running pod;
- the router (kvpilot.router.server.Router) discovering the model's pods through the API server
  (kube_discovery), with e2e/localrouter.py mapping each pod to its local process;
- a real Prometheus scraping the runtimes and `kvpilot autoscaler run --router-url` reading the
  router's queue depth.

Asserted: behaviour, not timings. Figures (the first request's time to first token and where it
went) are printed as one JSON line starting with ROUTER_E2E_FIGURES (run with -s); the bigger runs
are benchmarks/router_bench.py e2e.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import Cluster, Kubectl, stop_all, wait_until
from e2e.localpods import LocalKubelet
from e2e.localrouter import LocalPodSource, RequestRecord, RouterThread, closed_loop, stream_completion
from e2e.processes import OperatorProcess
from e2e.test_autoscaler_e2e import AutoscalerProcess, Prometheus, ReplicaWatch, get_model
from kvpilot.autoscaler.sources import parse_router_queue
from kvpilot.router.kube_discovery import kube_source
from kvpilot.router.pool import QueueSettings
from kvpilot.router.server import Router, RouterSettings
from tests.needs import require_tool

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"
MODEL = "smol"
SLOTS = 4  # maxNumSeqs: the router's capacity per pod
RUNTIME_FLAGS = ("--device", "cpu", "--kv-cache-memory", "48MiB", "--threads", "1")
MAX_TOKENS = 16
# the burst's answers: long enough that a request queued before the new replica is Ready is still
# waiting when the router has discovered it (at 16 tokens the queue turned over in ~0.3 s on a fast
# CPU, less than the discovery can take on a loaded machine, and the backlog had left before)
BURST_TOKENS = 64


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture
def api_client(cluster: Cluster) -> Any:
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()


def zero_scaled_model(prometheus_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "resources": {"gpus": 1},
            "runtime": {"maxNumSeqs": SLOTS, "shutdownTimeoutSeconds": 30},
            "routing": {"policy": "least-loaded"},
            "autoscaling": {
                "minReplicas": 0,
                "maxReplicas": 2,
                "targetQueueDepth": 2,
                "scaleDownStabilizationSeconds": 600,  # nothing scales down during the test
                "metricsSource": "prometheus",
                "prometheus": {"url": prometheus_url},
            },
        },
    }


def router_queue(router: RouterThread) -> int | None:
    return parse_router_queue(router.metrics_text(), MODEL)


def router_samples(router: RouterThread, name: str) -> dict[str, float]:
    """{the sample's labels other than model_name, as text: value} of one of the router's metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(router.metrics_text()):
        for s in family.samples:
            if s.name == name and s.labels.get("model_name") == MODEL:
                rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[rest] = s.value
    return out


async def one_request(url: str) -> RequestRecord:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await stream_completion(session, url, MODEL, "Tell me about lighthouses.", MAX_TOKENS)


def test_router_wakes_a_model_from_zero_and_a_new_replica_takes_the_queued_burst(
    cluster: Cluster, crds: None, namespace: str, kubectl: Kubectl, api_client: Any, tmp_path: Path
) -> None:
    require_tool("prometheus", "apt-get install prometheus")
    figures: dict[str, Any] = {}
    targets = tmp_path / "targets.json"
    kubelet = LocalKubelet(
        api_client,
        namespace,
        f"kvpilot.dev/model={MODEL}",
        tmp_path / "pods",
        extra_args=RUNTIME_FLAGS,
        targets_file=targets,
    )
    prom = Prometheus(tmp_path, targets)  # started in the try below, so the finally always stops it
    router = Router(
        RouterSettings(
            policy="round-robin",  # the model's spec.routing.policy (least-loaded) must win
            queue=QueueSettings(max_queue=64, queue_timeout_s=300, cold_start_timeout_s=300),
            scrape_interval_s=1,
        )
    )
    discovery = kube_source(namespace, str(cluster.kubeconfig))  # watches the pods and InferenceModels
    router.add_source(LocalPodSource(discovery, kubelet))
    rt = RouterThread(router)
    operator = OperatorProcess(
        cluster,
        namespace,
        tmp_path,
        "--no-leader-elect",
        "--router-endpoint",
        f"{namespace}=http://router.test",
    )
    autoscaler = AutoscalerProcess(
        cluster,
        namespace,
        tmp_path,
        "solo",
        "--metrics-source", "prometheus",
        "--prometheus-url", prom.url,
        "--router-url", rt.url,
        "--interval", "15",
        "--no-leader-elect",
    )  # fmt: skip
    watch = ReplicaWatch(api_client, namespace)
    try:
        prom.start()
        operator.start()
        kubelet.start()
        kubectl.apply(zero_scaled_model(prom.url))
        rt.start()
        autoscaler.start()
        watch.start()
        wait_until(lambda: MODEL in router.pools, timeout=30, what="the router to list the model")
        assert router.pools[MODEL].routable() == []  # zero replicas: nothing to route to
        assert router.pools[MODEL].policy.name == "least-loaded"
        wait_until(
            lambda: get_model(api_client, namespace).get("status", {}).get("routerEndpoint"),
            timeout=30,
            what="status.routerEndpoint",
        )
        time.sleep(2)
        assert watch.current == 0 and kubelet.all_pods() == [], watch.changes

        # (1) The first request is held, wakes the model, and is served in full.
        first = asyncio.run(one_request(rt.url))
        assert first.ok, first.error
        assert first.finish_reason == "length" and first.chunks >= 1
        assert [r for _, r in watch.changes][:2] == [0, 1], watch.changes
        (pod1,) = kubelet.all_pods()
        assert first.pod == pod1.name
        decided = next(t for t, r in watch.changes if r == 1)
        assert pod1.ready_at is not None and first.first_token is not None
        figures["scale_from_zero"] = {
            "ttft_s": round(first.first_token - first.sent, 2),
            "decision_s": round(decided - first.sent, 2),
            "scheduling_s": round(pod1.started_at - decided, 2),
            "runtime_start_and_load_s": round(pod1.ready_at - pod1.started_at, 2),
            "ready_to_first_token_s": round(first.first_token - pod1.ready_at, 2),
        }
        # it waited in the router's queue (not on a pod) for as long as the wake-up took
        held = router_samples(rt, "kvpilot_router_queue_time_seconds_sum")[""]
        assert held >= pod1.ready_at - decided > 0

        # (2) A burst over the one pod's slots: the router queues it, the autoscaler adds a replica,
        # and the new replica takes queued requests as soon as it is Ready.
        def pod2_busy(records: list[RequestRecord]) -> bool:
            return sum(1 for r in records if r.pod not in (None, pod1.name)) >= 3

        burst = asyncio.run(
            closed_loop(
                lambda: [rt.url],
                MODEL,
                concurrency=3 * SLOTS,
                max_tokens=BURST_TOKENS,
                stop=pod2_busy,
                max_s=240,
            )
        )
        failed = [r for r in burst if not r.ok]
        assert failed == [], [r.error for r in failed[:5]]
        assert {r.finish_reason for r in burst} == {"length"}
        assert max(r for _, r in watch.changes) == 2, watch.changes
        pod2 = next(p for p in kubelet.all_pods() if p.name != pod1.name)
        assert pod2.ready_at is not None
        by_pod = {name: sum(1 for r in burst if r.pod == name) for name in (pod1.name, pod2.name)}
        assert set(by_pod) == {r.pod for r in burst} and by_pod[pod2.name] >= 3, by_pod
        # requests already waiting when the new replica became Ready went to it (the backlog moved)
        backlog = [r for r in burst if r.pod == pod2.name and r.sent < pod2.ready_at]
        assert backlog, "the new replica took no request that was queued before it was Ready"
        assert router_queue(rt) == 0
        # every answer was a 200 (counted when its handler ends, just after the client read [DONE])
        wait_until(
            lambda: router_samples(rt, "kvpilot_router_requests_total") == {"code=200": len(burst) + 1},
            timeout=15,
            what=f"{len(burst) + 1} answers counted, all 200 "
            f"(now {router_samples(rt, 'kvpilot_router_requests_total')})",
        )
        figures["burst"] = {
            "requests": len(burst),
            "per_pod": by_pod,
            "queued_before_new_pod_ready_served_by_it": len(backlog),
            "new_pod_ready_after_burst_start_s": round(pod2.ready_at - min(r.sent for r in burst), 1),
        }
        # the API server's watches delivered the changes: the source lists on events, not every second
        assert discovery.watching and discovery.watch_events > 0
        assert kubelet.errors == []
    finally:
        stop_all(watch.stop, autoscaler.stop, rt.stop, kubelet.stop, prom.stop, operator.stop)
        print("ROUTER_E2E_FIGURES " + json.dumps(figures))
