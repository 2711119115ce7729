"""Scale from zero through the router, with a real pod start-up on the real node.

The model is at zero replicas (autoscaling.minReplicas 0). The router (a real `Router` on the host,
its Kubernetes discovery watching the namespace; it reaches pods by their IPs, which the host routes)
holds the first request in its queue; the autoscaler (`kvpilot autoscaler run`, reading the router's
queue and the pods' own metrics) scales the model to one replica; the operator's Deployment gets a pod
that the kubelet starts from the runtime image (present in the node), with the weights on a local
PersistentVolume; the router sends the held request there once the pod is Ready, and it is served in
full.

TTFT broken down (REALNODE_FIGURES), each from the clock that saw it: request sent -> replicas 0 -> 1
(the autoscaler's decision), -> pod created (the API server), -> container started (the kubelet's
startedAt), -> pod Ready (the readiness probe), -> first token at the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import Cluster, Kubectl, stop_all, wait_until
from e2e.localrouter import RequestRecord, RouterThread, stream_completion
from e2e.processes import OperatorProcess
from e2e.realnode import pods as rp
from e2e.realnode.pods import SELECTOR, inference_model
from e2e.test_autoscaler_e2e import AutoscalerProcess, ReplicaWatch
from kvpilot.router.kube_discovery import kube_source
from kvpilot.router.pool import QueueSettings
from kvpilot.router.server import Router, RouterSettings

pytestmark = pytest.mark.timeout(1200)

MAX_TOKENS = 16


@pytest.fixture
def api_client(cluster: Cluster) -> Iterator[Any]:
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()


def _at(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


async def _one_request(url: str) -> RequestRecord:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await stream_completion(session, url, "smollm2", "Tell me about lighthouses.", MAX_TOKENS)


def test_first_request_wakes_the_model_and_a_real_pod_serves_it(
    real_node: object,
    cluster: Cluster,
    operator: OperatorProcess,
    weights: str,
    kubectl: Kubectl,
    namespace: str,
    api_client: Any,
    tmp_path: Path,
) -> None:
    model = inference_model(weights)
    spec = model["spec"]
    del spec["replicas"]
    spec["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "targetQueueDepth": 2,
        "scaleDownStabilizationSeconds": 600,  # nothing scales down during the test
        "metricsSource": "pods",
    }
    router = Router(
        RouterSettings(queue=QueueSettings(max_queue=16, queue_timeout_s=600, cold_start_timeout_s=600))
    )
    discovery = kube_source(namespace, str(cluster.kubeconfig))
    router.add_source(discovery)
    rt = RouterThread(router)
    autoscaler = AutoscalerProcess(
        cluster, namespace, tmp_path, "solo", "--router-url", rt.url, "--interval", "5", "--no-leader-elect"
    )
    watch = ReplicaWatch(api_client, namespace)
    figures: dict[str, Any] = {}
    try:
        rt.start()
        kubectl.apply(model)
        autoscaler.start()
        watch.start()
        wait_until(lambda: "smollm2" in router.pools, timeout=60, what="the router to list the model")
        time.sleep(2)
        assert watch.current == 0 and rp.pods(kubectl, SELECTOR) == [], watch.changes

        first = asyncio.run(_one_request(rt.url))
        assert first.ok, f"{first.error}\n{rp.diagnostics(kubectl, operator.log_path, autoscaler.log_path)}"
        assert first.finish_reason == "length" and first.chunks >= 1
        assert [r for _, r in watch.changes][:2] == [0, 1], watch.changes
        (pod,) = rp.pods(kubectl, SELECTOR)
        assert pod["spec"]["nodeName"] == "kvpilot-real-0"
        assert first.pod == pod["metadata"]["name"]
        decided = next(t for t, r in watch.changes if r == 1)
        created = _at(pod["metadata"]["creationTimestamp"])
        started = _at(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
        ready = _at(rp.condition(pod, "Ready")["lastTransitionTime"])
        assert first.first_token is not None
        # the API server's times are whole seconds: each step at or after the one before, within that
        assert first.sent - 1 <= decided <= created + 1 and created <= started <= ready <= first.first_token
        figures = {
            "ttft_s": round(first.first_token - first.sent, 2),
            "decision_s": round(decided - first.sent, 2),
            "decision_to_pod_created_s": round(created - decided, 2),
            "pod_created_to_container_started_s": round(started - created, 2),
            "container_started_to_ready_s": round(ready - started, 2),
            "ready_to_first_token_s": round(first.first_token - ready, 2),
        }
        # it waited in the router's queue, not on a pod, for as long as the start-up took
        held = sum(
            sample.value
            for family in text_string_to_metric_families(rt.metrics_text())
            for sample in family.samples
            if sample.name == "kvpilot_router_queue_time_seconds_sum"
            and sample.labels.get("model_name") == "smollm2"
        )
        assert held >= ready - decided - 1, (held, ready - decided)  # the API server's times: whole seconds
    finally:
        stop_all(watch.stop, autoscaler.stop, rt.stop)
        print("REALNODE_FIGURES scale_from_zero " + json.dumps(figures))
