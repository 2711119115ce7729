"""The fleet router on the local control plane with real `kvpilot serve` runtimes. Prints one JSON object.

Every scenario runs in a fresh namespace of the e2e cluster (e2e/cluster; started if needed): the CRD,
`kvpilot operator`, e2e/localpods.py running a real SmolLM2 `kvpilot serve` per Running pod, a real
Prometheus scraping them, the router (kvpilot.router.server.Router, discovering the model's pods
through the API server; e2e/localrouter.py maps each pod to its local process) and, where the
scenario scales, `kvpilot autoscaler run` (reading the router's queue with --router-url).

    python benchmarks/router_bench.py e2e wake      # scale from zero: the first request's TTFT and where it goes
    python benchmarks/router_bench.py e2e burst     # a burst on 1 replica (max 2): central queue vs a Service
    python benchmarks/router_bench.py e2e prefix    # multi-turn chats on 3 replicas, each policy in one run
    python benchmarks/router_bench.py e2e all

wake: a model at minReplicas 0; one streamed request through the router. Time to first token split
  into decision (request sent -> spec.replicas 0 -> 1), scheduling (-> the pod Running and its process
  started: operator, Deployment, scheduler, kwok, local kubelet), runtime start (process start -> its
  "loading model" log line: Python imports, the HTTP server), model load (-> "model loaded; ready"),
  the readiness probe (-> /ready answered 200, polled every 0.5 s) and the rest (the router sees the
  pod Ready, forwards, prefill).
burst: minReplicas 1, maxReplicas 2, maxNumSeqs 4, closed-loop clients for --seconds; once through the
  router (central queue: a pod takes requests up to maxNumSeqs, the rest wait in the router), once
  straight to the pods round-robin at send time (a Service: each request queues on the pod it hit).
  Same autoscaler (through the router it also reads the router's queue). Reports per-pod requests
  started (first token) per 5 s, when the new replica became Ready and how many requests it served
  that were sent before that (the backlog it took over), TTFT p50/p99, failures.
prefix: 3 replicas, no autoscaler; the InferenceModel's spec.routing.policy is switched between
  phases (the router follows it), each phase a fresh salt so no phase reuses another's cache; the
  chat workload and hit-rate reading are fleet/router_local.py's (shared system prompts, multi-turn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from e2e.harness import Cluster, release_cluster, start_cluster, wait_until  # noqa: E402
from e2e.localpods import LocalKubelet  # noqa: E402
from e2e.localrouter import LocalPodSource, RequestRecord, RouterThread, closed_loop, stream_completion  # noqa: E402
from e2e.processes import OperatorProcess  # noqa: E402
from e2e.test_autoscaler_e2e import AutoscalerProcess, Prometheus, get_model  # noqa: E402
from fleet.router_local import compare_to_round_robin, conversations, cpu_info, pct, prefix_figures, prom_sum  # noqa: E402
from kvpilot.router.kube_discovery import kube_source  # noqa: E402
from kvpilot.router.pool import QueueSettings  # noqa: E402
from kvpilot.router.server import Router, RouterSettings  # noqa: E402

MODEL = "smollm2-135m-instruct"  # bench_router's chat workload sends this name
CRD_NAME = "inferencemodels.kvpilot.dev"


def model_spec(
    prom_url: str, *, slots: int, min_r: int, max_r: int, policy: str, autoscale: bool
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": "builtin://smollm2-135m-instruct", "servedName": MODEL},
        "resources": {"gpus": 1},
        "runtime": {"maxNumSeqs": slots, "shutdownTimeoutSeconds": 30},
        "routing": {"policy": policy},
    }
    if autoscale:
        spec["autoscaling"] = {
            "minReplicas": min_r,
            "maxReplicas": max_r,
            "targetQueueDepth": 2,
            "scaleDownStabilizationSeconds": 600,
            "metricsSource": "prometheus",
            "prometheus": {"url": prom_url},
        }
    else:
        spec["replicas"] = min_r
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "bench"},
        "spec": spec,
    }


@dataclass
class Stack:
    cluster: Cluster
    namespace: str
    workdir: Path
    api_client: Any
    kubelet: LocalKubelet
    prom: Prometheus
    router: RouterThread
    autoscaler: AutoscalerProcess | None


@contextlib.contextmanager
def stack(
    cluster: Cluster,
    *,
    slots: int,
    min_r: int,
    max_r: int,
    policy: str,
    autoscale: bool,
    router_queue_to_autoscaler: bool = True,
    runtime_flags: tuple[str, ...] = ("--device", "cpu", "--kv-cache-memory", "48MiB", "--threads", "1"),
) -> Iterator[Stack]:
    from kubernetes import config

    namespace = f"bench-router-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    wait_until(
        lambda: cluster.kubectl.exists("serviceaccount", "default", "-n", namespace),
        timeout=30,
        what="default SA",
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-e2e-"))
    api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    targets = workdir / "targets.json"
    kubelet = LocalKubelet(
        api_client,
        namespace,
        "kvpilot.dev/model=bench",
        workdir / "pods",
        extra_args=runtime_flags,
        targets_file=targets,
    )
    prom = Prometheus(workdir, targets).start()
    operator = OperatorProcess(cluster, namespace, workdir, "--no-leader-elect").start()
    router = Router(
        RouterSettings(
            policy=policy,
            queue=QueueSettings(max_queue=512, queue_timeout_s=600, cold_start_timeout_s=600),
            scrape_interval_s=1,
        )
    )
    router.add_source(LocalPodSource(kube_source(namespace, str(cluster.kubeconfig)), kubelet))
    rt = RouterThread(router)
    autoscaler = None
    try:
        kubelet.start()
        cluster.kubectl.in_namespace(namespace).apply(
            model_spec(prom.url, slots=slots, min_r=min_r, max_r=max_r, policy=policy, autoscale=autoscale)
        )
        rt.start()
        if autoscale:
            extra = ["--router-url", rt.url] if router_queue_to_autoscaler else []
            autoscaler = AutoscalerProcess(
                cluster, namespace, workdir, "bench",
                "--metrics-source", "prometheus", "--prometheus-url", prom.url,
                "--interval", "15", "--no-leader-elect", *extra,
            ).start()  # fmt: skip
        yield Stack(cluster, namespace, workdir, api_client, kubelet, prom, rt, autoscaler)
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        rt.stop()
        kubelet.stop()
        prom.stop()
        operator.stop()
        api_client.close()
        cluster.kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)


def replicas_of(api_client: Any, namespace: str) -> int:
    spec = get_model(api_client, namespace, "bench")["spec"]
    return int(spec.get("replicas", spec.get("autoscaling", {}).get("minReplicas", 1)))


class Replicas:
    """spec.replicas over time (0.25 s polls)."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        import threading

        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    r = replicas_of(api_client, namespace)
                    if not self.changes or self.changes[-1][1] != r:
                        self.changes.append((time.time(), r))
                self._stop.wait(0.25)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def runtime_phases(log_path: Path) -> tuple[float, float] | None:
    """(time the runtime logged "loading model", time it logged "model loaded; ready"), from its log's
    timestamps (local time, ms); None when either line is missing."""
    marks: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        for key, text in (
            ("loading", "kvpilot.serve: loading model"),
            ("loaded", "kvpilot.serve: model loaded"),
        ):
            if text in line and key not in marks:
                stamp = line[:23]  # 2026-12-01 18:25:14,370
                with contextlib.suppress(ValueError):
                    t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000
                    marks[key] = t
    if "loading" in marks and "loaded" in marks:
        return marks["loading"], marks["loaded"]
    return None


async def one(url: str, max_tokens: int) -> RequestRecord:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        return await stream_completion(s, url, MODEL, "Tell me about lighthouses.", max_tokens)


def wake(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for _ in range(args.wakes):
        with stack(cluster, slots=4, min_r=0, max_r=1, policy="least-loaded", autoscale=True) as st:
            wait_until(
                lambda: MODEL in st.router.router.pools, timeout=60, what="the router to list the model"
            )
            reps = Replicas(st.api_client, st.namespace)
            time.sleep(3)
            assert not st.kubelet.all_pods()
            rec = asyncio.run(one(st.router.url, args.max_tokens))
            reps.stop()
            pods = st.kubelet.all_pods()
            decided = next((t for t, r in reps.changes if r >= 1), None)
            run: dict[str, Any] = {
                "status": rec.status,
                "finish_reason": rec.finish_reason,
                "error": rec.error,
            }
            if rec.ok and decided is not None and len(pods) == 1 and pods[0].ready_at and rec.first_token:
                p = pods[0]
                run.update(
                    ttft_s=round(rec.first_token - rec.sent, 2),
                    decision_s=round(decided - rec.sent, 2),
                    scheduling_s=round(p.started_at - decided, 2),
                    runtime_start_and_load_s=round(p.ready_at - p.started_at, 2),
                    ready_to_first_token_s=round(rec.first_token - p.ready_at, 2),
                    total_s=round((rec.done or rec.first_token) - rec.sent, 2),
                )
                phases = runtime_phases(p.log_path)
                if phases is not None:  # the process's own split: start (imports, server), load, probe
                    run.update(
                        runtime_start_s=round(phases[0] - p.started_at, 2),
                        model_load_s=round(phases[1] - phases[0], 2),
                        readiness_probe_s=round(p.ready_at - phases[1], 2),
                    )
            runs.append(run)
    return {"max_tokens": args.max_tokens, "runs": runs}


def timeline(
    records: list[RequestRecord], t0: float, names: dict[str, str], bucket_s: float = 5.0
) -> list[dict[str, Any]]:
    out: dict[int, dict[str, int]] = {}
    for r in records:
        if r.first_token is None or r.pod is None:
            continue
        b = int((r.first_token - t0) // bucket_s)
        row = out.setdefault(b, {})
        name = names.get(r.pod, r.pod)
        row[name] = row.get(name, 0) + 1
    return [{"t_s": b * bucket_s, **out[b]} for b in sorted(out)]


def burst_once(cluster: Cluster, args: argparse.Namespace, through_router: bool) -> dict[str, Any]:
    with stack(
        cluster, slots=4, min_r=1, max_r=2, policy="least-loaded", autoscale=True,
        router_queue_to_autoscaler=through_router,
    ) as st:  # fmt: skip
        wait_until(lambda: st.kubelet.endpoints(), timeout=180, what="the first runtime /ready")
        wait_until(
            lambda: st.router.router.pools.get(MODEL) and st.router.router.pools[MODEL].routable(), timeout=30
        )
        reps = Replicas(st.api_client, st.namespace)
        targets = (lambda: [st.router.url]) if through_router else st.kubelet.endpoints
        t0 = time.time()
        records = asyncio.run(
            closed_loop(
                targets, MODEL, concurrency=args.concurrency, max_tokens=args.max_tokens,
                stop=lambda recs: False, max_s=args.seconds,
            )
        )  # fmt: skip
        reps.stop()
        pods = sorted(st.kubelet.all_pods(), key=lambda p: p.started_at)
        # the pods by name; straight to the pods, a record names the pod's URL
        names = {p.url: p.name for p in pods} | {p.name: p.name for p in pods}
        short = {p.name: f"pod{i + 1}" for i, p in enumerate(pods)}
        for r in records:
            if r.pod is not None:
                r.pod = short.get(names.get(r.pod, r.pod), r.pod)
        ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
        out: dict[str, Any] = {
            "mode": "router (central queue, least-loaded)"
            if through_router
            else "service (round-robin per request)",
            "requests": len(records),
            "failed": sum(1 for r in records if not r.ok),
            "errors": [r.error for r in records if r.error][:5],
            "ttft_s": {"p50": round(pct(ttfts, 50), 2), "p99": round(pct(ttfts, 99), 2)} if ttfts else None,
            "per_pod": {short[p.name]: sum(1 for r in records if r.pod == short[p.name]) for p in pods},
            "replica_changes_s": [(round(t - t0, 1), n) for t, n in reps.changes],
            "pods_ready_s": {short[p.name]: round(p.ready_at - t0, 1) for p in pods if p.ready_at},
            "first_tokens_per_5s": timeline(records, t0, {}),
        }
        if len(pods) >= 2 and pods[1].ready_at:
            new = pods[1]
            mine = [r for r in records if r.pod == short[new.name] and r.first_token]
            out["new_pod"] = {
                "ready_s": round(new.ready_at - t0, 1),
                "first_token_after_ready_s": round(min(r.first_token for r in mine) - new.ready_at, 2)
                if mine
                else None,  # type: ignore[type-var]
                "served_requests_sent_before_it_was_ready": sum(1 for r in mine if r.sent < new.ready_at),
                "old_pod_backlog_started_after_new_ready": sum(
                    1
                    for r in records
                    if r.pod == "pod1"
                    and r.sent < new.ready_at
                    and r.first_token
                    and r.first_token > new.ready_at
                ),
            }
        return out


def burst(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "max_tokens": args.max_tokens,
        "runs": [burst_once(cluster, args, True), burst_once(cluster, args, False)],
    }


def prefix(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    policies = args.policies.split(",")
    flags = (
        "--device", "cpu", "--kv-cache-memory", args.kv_cache_memory, "--threads", "1", "--enable-prefix-caching",
    )  # fmt: skip
    results: dict[str, Any] = {}
    with stack(
        cluster, slots=4, min_r=3, max_r=3, policy=policies[0], autoscale=False, runtime_flags=flags
    ) as st:
        wait_until(lambda: len(st.kubelet.endpoints()) == 3, timeout=300, what="3 runtimes /ready")
        pool = lambda: st.router.router.pools.get(MODEL)  # noqa: E731
        wait_until(
            lambda: pool() is not None and len(pool().routable()) == 3, timeout=60, what="3 pods routable"
        )  # type: ignore[union-attr]
        urls = st.kubelet.endpoints()
        for policy in policies:
            st.cluster.kubectl.in_namespace(st.namespace)(
                "patch",
                "inferencemodel",
                "bench",
                "--type=merge",
                "-p",
                json.dumps({"spec": {"routing": {"policy": policy}}}),
            )
            wait_until(
                lambda p=policy: pool() is not None and pool().policy.name == p,
                timeout=30,
                what=f"policy {policy}",
            )  # type: ignore[union-attr]
            hits0 = sum(prom_sum(u, "kvpilot_prefix_cache_hits_total") for u in urls)
            queries0 = sum(prom_sum(u, "kvpilot_prefix_cache_queries_total") for u in urls)
            t0 = time.perf_counter()
            ttfts, per_pod = asyncio.run(
                conversations(
                    st.router.url, args.conversations, args.turns, args.chat_max_tokens, f"e2e-{policy}",
                    args.chat_concurrency, False, args.system_repeat,
                )
            )  # fmt: skip
            wall = time.perf_counter() - t0
            hits = sum(prom_sum(u, "kvpilot_prefix_cache_hits_total") for u in urls) - hits0
            queries = sum(prom_sum(u, "kvpilot_prefix_cache_queries_total") for u in urls) - queries0
            results[policy] = prefix_figures(ttfts, hits, queries, wall, per_pod)
    compare_to_round_robin(results)
    return {
        "pods": 3,
        "conversations": args.conversations,
        "turns": args.turns,
        "max_tokens": args.chat_max_tokens,
        "concurrency": args.chat_concurrency,
        "kv_cache_memory": args.kv_cache_memory,
        "policies": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("scenario", choices=("wake", "burst", "prefix", "all"))
    parser.add_argument("--wakes", type=int, default=1, help="wake: fresh models woken one after another")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="wake, burst: tokens per request (ignore_eos)"
    )
    parser.add_argument("--concurrency", type=int, default=12, help="burst: closed-loop clients")
    parser.add_argument("--seconds", type=float, default=60.0, help="burst: length of each run")
    parser.add_argument("--policies", default="round-robin,least-loaded,prefix-affinity,kv-aware")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--chat-max-tokens", type=int, default=4)
    parser.add_argument("--chat-concurrency", type=int, default=3)
    parser.add_argument("--system-repeat", type=int, default=6)
    parser.add_argument("--kv-cache-memory", default="24MiB")
    args = parser.parse_args()
    for flag, value in (
        ("--wakes", args.wakes),
        ("--concurrency", args.concurrency),
        ("--max-tokens", args.max_tokens),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1")
    cluster = start_cluster()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    out: dict[str, Any] = {"benchmark": "router-e2e", "machine": cpu_info()}
    started = time.time()
    try:
        for name, fn in (("wake", wake), ("burst", burst), ("prefix", prefix)):
            if args.scenario in (name, "all"):
                out[name] = fn(cluster, args)
    finally:
        release_cluster(cluster)
    out["wall_s"] = round(time.time() - started, 1)
    out["load_average_1m_end"] = cpu_info()["load_average_1m"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
