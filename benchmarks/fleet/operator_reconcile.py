"""Operator benchmark against a running cluster (e.g. `e2e/cluster up`); prints JSON.

1. apply latency: for N models one after another, the time from starting `kubectl apply` to the
   Deployment appearing (seen by a watch), and from the apply returning to the Deployment appearing.
2. cold start: M InferenceModels exist, the operator starts, and we time until every one has
   status.observedGeneration (all children applied, status written); then the operator's peak RSS.
3. warm restart: the operator restarts over the same M reconciled models; time until it has
   reconciled all of them, and how many writes that took (should be 0).

    python benchmarks/operator_bench.py --kubeconfig e2e/.state/kubeconfig [--models 50 --cold 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from kvpilot.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, also when run as a script
import harness

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "kvpilot.dev", "v1alpha1", "inferencemodels"


percentile = harness.nearest_rank


def manifest(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "replicas": replicas,
            "resources": {"gpus": 0, "cpu": "100m", "memory": "256Mi"},
        },
    }


class Operator:
    def __init__(self, kubeconfig: str, namespace: str, log: Path) -> None:
        self.metrics_port = free_port()
        args = [
            sys.executable, "-m", "kvpilot", "operator", "--kubeconfig", kubeconfig, "--namespace", namespace,
            "--no-leader-elect", "--metrics-port", str(self.metrics_port), "--health-port", "0",
            "--resync-seconds", "3600", "--log-level", "WARNING",
        ]  # fmt: skip
        self.log = log.open("ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.peak_rss_kib = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _sample_rss(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_rss_kib = max(self.peak_rss_kib, int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvpilot_operator_"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def watch_deployments(
    apps: client.AppsV1Api, namespace: str, seen: dict[str, float], stop: threading.Event
) -> None:
    w = watch.Watch()
    while not stop.is_set():
        for event in w.stream(apps.list_namespaced_deployment, namespace, timeout_seconds=5):
            name = event["object"].metadata.name
            seen.setdefault(name, time.perf_counter())
            if stop.is_set():
                w.stop()
                break


def bench_apply_latency(
    kubectl: list[str], apps: client.AppsV1Api, namespace: str, n: int, replicas: int
) -> dict[str, Any]:
    seen: dict[str, float] = {}
    stop = threading.Event()
    threading.Thread(target=watch_deployments, args=(apps, namespace, seen, stop), daemon=True).start()
    time.sleep(1.0)
    from_start, from_created = [], []
    for i in range(n):
        name = f"lat-{i:03d}"
        t0 = time.perf_counter()
        subprocess.run(
            [*kubectl, "apply", "-n", namespace, "-f", "-"],
            input=json.dumps(manifest(name, replicas)),
            text=True,
            check=True,
            capture_output=True,
        )
        t1 = time.perf_counter()
        deadline = t1 + 60
        while name not in seen and time.perf_counter() < deadline:
            time.sleep(0.002)
        if name not in seen:
            raise TimeoutError(f"deployment {name} did not appear")
        from_start.append(seen[name] - t0)
        from_created.append(max(0.0, seen[name] - t1))
    stop.set()
    return {
        "models": n,
        "apply_to_deployment_s": {"p50": percentile(from_start, 50), "p95": percentile(from_start, 95),
                                  "max": max(from_start)},
        "created_to_deployment_s": {"p50": percentile(from_created, 50), "p95": percentile(from_created, 95),
                                    "mean": statistics.fmean(from_created)},
    }  # fmt: skip


def all_reconciled(custom: client.CustomObjectsApi, namespace: str, m: int) -> int:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    return sum(
        1
        for o in items
        if o.get("status", {}).get("observedGeneration") == o["metadata"]["generation"]
        and o.get("status", {}).get("conditions")
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kubeconfig", default=os.environ.get("KUBECONFIG", str(ROOT / "e2e/.state/kubeconfig"))
    )
    parser.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    parser.add_argument("--models", type=int, default=50, help="models for the apply-latency run")
    parser.add_argument("--cold", type=int, default=300, help="models for the cold-start run")
    parser.add_argument("--replicas", type=int, default=0,
                        help="replicas per model (0 keeps pods out of the measurement)")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the benchmark namespaces")
    args = parser.parse_args()

    config.load_kube_config(config_file=args.kubeconfig)
    core, apps, custom = client.CoreV1Api(), client.AppsV1Api(), client.CustomObjectsApi()
    kubectl = [args.kubectl, f"--kubeconfig={args.kubeconfig}"]
    subprocess.run([*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds")],
                   check=True, capture_output=True)  # fmt: skip
    stamp = time.strftime("%H%M%S")
    ns_lat, ns_cold = f"bench-latency-{stamp}", f"bench-cold-{stamp}"
    for ns in (ns_lat, ns_cold):
        core.create_namespace({"metadata": {"name": ns}})
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    result: dict[str, Any] = {
        "benchmark": "operator",
        "machine": harness.machine(),
        "kubernetes": client.VersionApi().get_code().git_version,
        "replicas_per_model": args.replicas,
    }
    try:
        op = Operator(args.kubeconfig, ns_lat, logs / "operator-bench-latency.log")
        time.sleep(2)
        result["apply_latency"] = bench_apply_latency(kubectl, apps, ns_lat, args.models, args.replicas)
        op.stop()

        for i in range(args.cold):  # created while no operator runs
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns_cold, PLURAL, manifest(f"cold-{i:04d}", args.replicas)
            )
        t0 = time.perf_counter()
        op = Operator(args.kubeconfig, ns_cold, logs / "operator-bench-cold.log")
        while (done := all_reconciled(custom, ns_cold, args.cold)) < args.cold:
            if time.perf_counter() - t0 > 600:
                raise TimeoutError(f"only {done}/{args.cold} reconciled after 600 s")
            time.sleep(0.25)
        cold_s = time.perf_counter() - t0
        # Then wait until the operator is idle: the Deployments' own status updates come back as
        # events and are reconciled into status too (readiness, rollout complete).
        last, quiet_since = -1.0, time.perf_counter()
        while time.perf_counter() - quiet_since < 3.0:
            count = op.metric("kvpilot_operator_reconcile_total")
            if count != last or op.metric("kvpilot_operator_queue_depth") > 0:
                last, quiet_since = count, time.perf_counter()
            time.sleep(0.25)
        settled_s = quiet_since - t0
        result["cold_start"] = {
            "models": args.cold,
            "seconds_to_all_reconciled": cold_s,
            "models_per_second": args.cold / cold_s,
            "seconds_to_idle": settled_s,
            "reconciles": op.metric("kvpilot_operator_reconcile_total"),
            "child_applies": op.metric('kvpilot_operator_child_apply_total{action="applied"'),
            "status_patches": op.metric("kvpilot_operator_status_patch_total"),
            "peak_rss_mib": op.peak_rss_kib / 1024,
        }
        op.stop()

        t0 = time.perf_counter()
        op = Operator(args.kubeconfig, ns_cold, logs / "operator-bench-warm.log")
        while op.metric("kvpilot_operator_reconcile_total") < args.cold:
            if time.perf_counter() - t0 > 600:
                raise TimeoutError("warm restart did not reconcile everything")
            time.sleep(0.1)
        warm_s = time.perf_counter() - t0
        result["warm_restart"] = {
            "models": args.cold,
            "seconds_including_startup": warm_s,
            "children_applied": op.metric('kvpilot_operator_child_apply_total{action="applied"'),
            "status_patches": op.metric("kvpilot_operator_status_patch_total"),
            "peak_rss_mib": op.peak_rss_kib / 1024,
        }
        op.stop()
    finally:
        if not args.keep:
            for ns in (ns_lat, ns_cold):
                subprocess.run([*kubectl, "delete", "namespace", ns, "--wait=false"], capture_output=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
