"""Prefill/decode disaggregation end to end (docs/disaggregation.md), with real parts only:

- the local control plane and the CRD; `kvpilot operator` rendering a disaggregated InferenceModel into
  a prefill and a decode Deployment;
- e2e/localpods.py running a real `kvpilot serve` (SmolLM2 on CPU) per Running pod, with the command
  the operator rendered (`--kv-role prefill|decode`, the decode side's `--kv-transfer-timeout`);
- the router discovering both roles through the API server and running each long prompt on a prefill
  pod, then the request on a decode pod that pulls the prompt's KV blocks.

Asserted: the model becomes Ready with both roles serving; an answer through the router took the two
legs, moved KV bytes and equals the aggregated (plain) answer; a role scales on its own replicas (the
autoscaler's merge patch of spec.disaggregation); a prefill pod killed while it holds a request, and a
prefill pod killed between the two legs, still give the client its answer, with the fallback counted
(by the router, and by the decode pod).

The second test adds a real Prometheus and `kvpilot autoscaler run`: short prompts with long answers
(straight to the decode pool) grow the decode role alone; long prompts then grow the prefill role.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import Cluster, Kubectl, stop_all, wait_until
from e2e.localpods import LocalKubelet, LocalPod
from e2e.localrouter import LocalPodSource, RequestRecord, RouterThread, closed_loop
from e2e.processes import OperatorProcess
from e2e.test_autoscaler_e2e import AutoscalerProcess, Prometheus, get_model
from kvpilot.router.kube_discovery import kube_source
from kvpilot.router.pool import QueueSettings
from kvpilot.router.server import POD_HEADER, Router, RouterSettings
from tests.needs import require_tool

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"
MODEL = "smol"
RUNTIME_FLAGS = ("--device", "cpu", "--kv-cache-memory", "48MiB", "--threads", "1")
MIN_PROMPT_TOKENS = 16
# ~100 tokens: well over minPromptTokens (the router estimates 4 characters a token), several KV blocks
PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 6
# Another prompt for the decode-side fallback: a decode pod pulls only the blocks its prefix cache lacks
OTHER_PROMPT = "A fisherman mended his nets on the pier while the gulls circled above the harbour. " * 6
MAX_TOKENS = 12


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


def disaggregated_model() -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "resources": {"gpus": 1},
            "runtime": {"maxNumSeqs": 4, "shutdownTimeoutSeconds": 5},
            "disaggregation": {
                "prefill": {"replicas": 1, "runtime": {"maxNumBatchedTokens": 1024}},
                "decode": {"replicas": 1},
                "minPromptTokens": MIN_PROMPT_TOKENS,
                "transferTimeoutSeconds": 5,
            },
        },
    }


def samples(text: str, name: str) -> dict[str, float]:
    """{labels other than model_name, as text: value} of one metric in a /metrics page."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[rest] = s.value
    return out


def pod_metrics(pod: LocalPod) -> str:
    with urllib.request.urlopen(f"{pod.url}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def complete(
    base_url: str, extra: dict[str, Any] | None = None, prompt: str = PROMPT
) -> tuple[int, dict[str, Any], str | None]:
    """A greedy, non-streaming /v1/completions: (status, body, the X-Kvpilot-Pod header)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **(extra or {})}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get(POD_HEADER)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), None


def text_of(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["text"])


def live_pods(kubelet: LocalKubelet, role: str) -> list[LocalPod]:
    return [
        p
        for p in kubelet.live()
        if p.name.startswith(f"{MODEL}-{role}-") and p.ready_at and not p.terminating
    ]


def ready_condition(api_client: Any, namespace: str) -> dict[str, Any]:
    conds = get_model(api_client, namespace).get("status", {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Ready"), {})


def test_a_disaggregated_model_serves_through_the_router_and_falls_back_when_prefill_dies(
    cluster: Cluster, crds: None, namespace: str, kubectl: Kubectl, api_client: Any, tmp_path: Path
) -> None:
    figures: dict[str, Any] = {}
    kubelet = LocalKubelet(
        api_client, namespace, f"kvpilot.dev/model={MODEL}", tmp_path / "pods", extra_args=RUNTIME_FLAGS
    )
    router = Router(
        RouterSettings(
            queue=QueueSettings(max_queue=16, queue_timeout_s=120, cold_start_timeout_s=120),
            scrape_interval_s=1,
            max_retries=0,  # the one prefill pod is the one killed: no other to try
        )
    )
    router.add_source(LocalPodSource(kube_source(namespace, str(cluster.kubeconfig)), kubelet))
    rt = RouterThread(router)
    operator = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect")
    try:
        operator.start()
        kubelet.start()
        kubectl.apply(disaggregated_model())

        # (1) Ready with both roles serving, each pod running its role.
        wait_until(
            lambda: ready_condition(api_client, namespace).get("status") == "True",
            timeout=300,
            what=f"Ready (now {ready_condition(api_client, namespace)})",
        )
        status = get_model(api_client, namespace)["status"]
        assert status["roles"] == {
            "prefill": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
            "decode": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
        }
        assert status["replicas"] == 2 and status["readyReplicas"] == 2
        assert not kubectl.exists("deployment", MODEL)  # no aggregated Deployment
        wait_until(
            lambda: live_pods(kubelet, "prefill") and live_pods(kubelet, "decode"),
            timeout=120,
            what="runtimes",
        )
        (prefill,), (decode,) = live_pods(kubelet, "prefill"), live_pods(kubelet, "decode")
        for pod, role in ((prefill, "prefill"), (decode, "decode")):
            assert samples(pod_metrics(pod), "kvpilot_engine_info") == {f"kv_role={role}": 1.0}

        # (2) Through the router: the two legs, KV bytes moved, the aggregated answer.
        rt.start()
        wait_until(
            lambda: MODEL in router.prefill_pools and router.prefill_pools[MODEL].routable(),
            timeout=60,
            what="the router's prefill pool",
        )
        wait_until(lambda: router.pools[MODEL].routable(), timeout=60, what="the router's decode pool")
        code, answer, served_by = complete(rt.url)
        assert code == 200, answer
        assert served_by == decode.name
        code, plain, _ = complete(decode.url)  # the aggregated answer (a plain request on one pod)
        assert code == 200, plain
        assert text_of(answer) == text_of(plain)
        assert samples(rt.metrics_text(), "kvpilot_router_pd_requests_total")["path=disaggregated"] == 1
        sent = samples(pod_metrics(prefill), "kvpilot_kv_transfer_bytes_total")["direction=sent"]
        received = samples(pod_metrics(decode), "kvpilot_kv_transfer_bytes_total")["direction=received"]
        assert sent == received > 0
        assert sum(samples(pod_metrics(decode), "kvpilot_kv_transfer_fallbacks_total").values()) == 0
        figures["kv_bytes_per_request"] = received

        # (3) A role scales on its own replicas: the autoscaler's one merge patch of spec.disaggregation.
        kubectl(
            "patch", "inferencemodel", MODEL, "--type=merge",
            "-p", json.dumps({"spec": {"disaggregation": {"decode": {"replicas": 2}}}}),
        )  # fmt: skip
        wait_until(lambda: len(live_pods(kubelet, "decode")) == 2, timeout=240, what="a second decode pod")
        wait_until(
            lambda: (
                (get_model(api_client, namespace)["status"].get("roles") or {})
                .get("decode", {})
                .get("readyReplicas")
                == 2
            ),
            timeout=60,
            what="status.roles.decode.readyReplicas 2",
        )
        assert len(live_pods(kubelet, "prefill")) == 1
        assert get_model(api_client, namespace)["status"]["roles"]["prefill"]["desiredReplicas"] == 1
        wait_until(
            lambda: len(router.pools[MODEL].routable()) == 2, timeout=60, what="two decode pods routed"
        )
        assert len(router.prefill_pools[MODEL].routable()) == 1

        # (4) The prefill pod is killed between the two legs: the decode pod cannot pull, recomputes the
        # prompt, answers the same, and counts the fallback.
        code, first_leg, _ = complete(
            prefill.url, {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}, OTHER_PROMPT
        )
        assert code == 200, first_leg
        params = {"remote_url": prefill.url, **first_leg["kv_transfer_params"]}
        os.kill(prefill.proc.pid, signal.SIGKILL)
        killed = [prefill.name]
        prefill.proc.wait(timeout=30)
        code, answer, _ = complete(decode.url, {"kv_transfer_params": params}, OTHER_PROMPT)
        assert code == 200, answer
        code, other_plain, _ = complete(decode.url, prompt=OTHER_PROMPT)
        assert code == 200 and text_of(answer) == text_of(other_plain)
        fallbacks = samples(pod_metrics(decode), "kvpilot_kv_transfer_fallbacks_total")
        assert sum(fallbacks.values()) == 1, fallbacks
        figures["decode_fallback_reasons"] = {k: v for k, v in fallbacks.items() if v}

        # A new prefill pod (the crashed one's pod is deleted, as a kubelet restarting it would replace it).
        kubectl("delete", "pod", prefill.name, "--wait=false")
        wait_until(
            lambda: [p for p in live_pods(kubelet, "prefill") if p.name != prefill.name],
            timeout=240,
            what="a new prefill pod",
        )
        (prefill,) = live_pods(kubelet, "prefill")
        wait_until(
            lambda: [p.name for p in router.prefill_pools[MODEL].routable()] == [prefill.name],
            timeout=60,
            what="the new prefill pod routed",
        )

        # (5) The prefill pod dies while it holds a request: the router sends the request to a decode
        # pod instead, and the client gets its answer.
        os.kill(prefill.proc.pid, signal.SIGSTOP)  # it takes the prompt and never answers
        result: dict[str, Any] = {}
        client = threading.Thread(
            target=lambda: result.update(zip(("code", "body", "pod"), complete(rt.url), strict=True))
        )
        client.start()
        wait_until(
            lambda: router.prefill_pools[MODEL].in_flight == 1, timeout=30, what="the prefill leg sent"
        )
        os.kill(prefill.proc.pid, signal.SIGKILL)
        killed.append(prefill.name)
        client.join(timeout=300)
        assert result["code"] == 200, result
        assert text_of(result["body"]) == text_of(plain)
        paths = samples(rt.metrics_text(), "kvpilot_router_pd_requests_total")
        assert paths["path=prefill_failed"] == 1, paths
        assert paths["path=disaggregated"] == 1, paths
        figures["router_paths"] = paths
        # the shim's only complaints: the two runtimes this test killed (it notices an exit on its own
        # schedule: the client's answer can come first)
        expected = sorted(f"pod {name}: runtime exited -9 while its pod existed" for name in killed)
        wait_until(lambda: len(kubelet.errors) >= len(expected), timeout=60, what="the shim saw both exits")
        assert sorted(kubelet.errors) == expected
    finally:
        stop_all(rt.stop, kubelet.stop, operator.stop)
        print("PD_E2E_FIGURES " + json.dumps(figures))


class RoleWatch:
    """Every change of spec.disaggregation.<role>.replicas (what the autoscaler writes), polled."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.api_client, self.namespace = api_client, namespace
        self.changes: list[tuple[float, dict[str, int | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="role-watch", daemon=True)

    def start(self) -> RoleWatch:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            roles = get_model(self.api_client, self.namespace)["spec"].get("disaggregation") or {}
            now = {role: (roles.get(role) or {}).get("replicas") for role in ("prefill", "decode")}
            if not self.changes or self.changes[-1][1] != now:
                self.changes.append((time.time(), now))
            self._stop.wait(0.5)

    def replicas(self, role: str) -> int:
        return (self.changes[-1][1].get(role) or 0) if self.changes else 0

    def most(self, role: str) -> int:
        return max((c.get(role) or 0 for _, c in self.changes), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def autoscaled_disaggregated_model(prometheus_url: str) -> dict[str, Any]:
    model = disaggregated_model()
    model["spec"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetQueueDepth": 2,
        "scaleDownStabilizationSeconds": 600,  # nothing scales down during the test
        "metricsSource": "prometheus",
        "prometheus": {"url": prometheus_url},
    }
    model["spec"]["disaggregation"] = {"minPromptTokens": 64, "transferTimeoutSeconds": 5}
    return model


def test_each_role_scales_on_its_own_signal(
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
    prom = Prometheus(tmp_path, targets)
    router = Router(
        RouterSettings(
            queue=QueueSettings(max_queue=64, queue_timeout_s=300, cold_start_timeout_s=300),
            scrape_interval_s=1,
        )
    )
    router.add_source(LocalPodSource(kube_source(namespace, str(cluster.kubeconfig)), kubelet))
    rt = RouterThread(router)
    operator = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect")
    autoscaler = AutoscalerProcess(
        cluster,
        namespace,
        tmp_path,
        "solo",
        "--metrics-source", "prometheus",
        "--prometheus-url", prom.url,
        "--router-url", rt.url,
        "--interval", "10",
        "--no-leader-elect",
    )  # fmt: skip
    watch = RoleWatch(api_client, namespace)
    try:
        prom.start()
        operator.start()
        kubelet.start()
        kubectl.apply(autoscaled_disaggregated_model(prom.url))
        wait_until(
            lambda: ready_condition(api_client, namespace).get("status") == "True",
            timeout=300,
            what=f"Ready (now {ready_condition(api_client, namespace)})",
        )
        rt.start()
        autoscaler.start()
        watch.start()
        wait_until(lambda: router.pools[MODEL].routable(), timeout=60, what="the decode pool routed")

        # (1) Short prompts (straight to a decode pod) with long answers: the decode role's signal only.
        started = time.time()
        short = asyncio.run(
            closed_loop(
                lambda: [rt.url],
                MODEL,
                concurrency=12,
                max_tokens=48,
                stop=lambda _: watch.replicas("decode") >= 2,
                max_s=300,
            )
        )
        assert watch.replicas("decode") == 2, (watch.changes, autoscaler.log()[-3000:])
        assert watch.most("prefill") <= 1, watch.changes  # prefill had nothing to do: it stayed
        assert [r for r in short if not r.ok] == []
        paths = samples(rt.metrics_text(), "kvpilot_router_pd_requests_total")
        assert paths.get("path=disaggregated", 0) == 0 and paths["path=direct"] == len(short), paths
        figures["decode_scaled_after_s"] = round(time.time() - started, 1)

        # (2) Long prompts with one-token answers: the prefill role's backlog.
        started = time.time()
        long_prompt = PROMPT * 4  # ~400 tokens, well over minPromptTokens
        long = asyncio.run(
            closed_loop(
                lambda: [rt.url],
                MODEL,
                concurrency=12,
                max_tokens=1,
                stop=lambda _: watch.replicas("prefill") >= 2,
                max_s=300,
                prompt=long_prompt,
            )
        )
        assert watch.replicas("prefill") == 2, (watch.changes, autoscaler.log()[-3000:])
        failed: list[RequestRecord] = [r for r in long if not r.ok]
        assert failed == [], [r.error for r in failed[:3]]
        # Every long prompt ran on a prefill pod. Some answer without kv_transfer_params and are
        # recomputed on the decode pod (prefill_failed): a 48 MiB KV pool's pin share (the runtime's
        # --kv-transfer-pin-fraction, half the pool) holds about one ~400-token prompt's blocks until
        # its decode pod pulls them, and 4 prompts run at once on a prefill pod.
        paths = samples(rt.metrics_text(), "kvpilot_router_pd_requests_total")
        took_prefill = paths.get("path=disaggregated", 0) + paths.get("path=prefill_failed", 0)
        assert took_prefill == len(long) and paths.get("path=disaggregated", 0) >= 1, paths
        assert paths["path=direct"] == len(short) and paths.get("path=no_prefill", 0) == 0, paths
        figures["long_prompt_paths"] = paths
        figures["prefill_scaled_after_s"] = round(time.time() - started, 1)
        figures["role_changes"] = [c for _, c in watch.changes]
        # the operator followed both: two Deployments of two pods each, all Ready
        wait_until(
            lambda: (
                get_model(api_client, namespace)["status"].get("roles")
                == {
                    "prefill": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2},
                    "decode": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2},
                }
            ),
            timeout=240,
            what="status.roles at 2 and 2",
        )
        assert kubelet.errors == []
    finally:
        stop_all(watch.stop, autoscaler.stop, rt.stop, kubelet.stop, prom.stop, operator.stop)
        print("PD_SCALING_E2E_FIGURES " + json.dumps(figures))
