"""The autoscaler end to end, with real parts only.

- the local control plane (kube-apiserver, controller-manager, scheduler, kwok GPU nodes) and the CRD;
- `kvpilot operator` rendering the InferenceModel into a Deployment;
- e2e/localpods.py running a real `kvpilot serve` (SmolLM2 on CPU) for each of the model's Running pods,
  draining it (preStop, SIGTERM) when its pod goes away;
- a real Prometheus (the Debian package's binary) scraping the runtimes through file_sd every second;
- `kvpilot autoscaler run --metrics-source prometheus` scaling through the scale subresource;
- a load generator on the official `openai` async client.

Two `kvpilot autoscaler run` processes also contend for the Lease: one decides, the other takes over.

Figures (time from sustained overload to the scale decision, ...) are printed as one JSON line that
starts with AUTOSCALER_E2E_FIGURES (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import Cluster, Kubectl, stop_all, wait_until
from e2e.localpods import LocalKubelet, openai_load
from e2e.processes import OperatorProcess, stop_process
from kvpilot.net import free_port
from tests.needs import require_tool

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"
MODEL = "smol"
# Small enough that three runtimes share two busy cores; the flags override the rendered config file.
RUNTIME_FLAGS = ("--device", "cpu", "--kv-cache-memory", "64MiB", "--threads", "1", "--max-num-seqs", "8")
TARGET_QUEUE = 4
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture
def api_client(cluster: Cluster) -> Iterator[Any]:
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()


def get_model(api_client: Any, namespace: str, name: str = MODEL) -> dict[str, Any]:
    from kubernetes import client

    resp: Any = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        "kvpilot.dev", "v1alpha1", namespace, "inferencemodels", name, _preload_content=False
    )
    obj: dict[str, Any] = json.loads(resp.data)
    return obj


def autoscaled_model(prometheus_url: str, **autoscaling: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "resources": {"gpus": 1},
            "runtime": {"maxNumSeqs": 8, "shutdownTimeoutSeconds": 30},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "targetQueueDepth": TARGET_QUEUE,
                "metricsSource": "prometheus",
                "prometheus": {"url": prometheus_url},
                **autoscaling,
            },
        },
    }


class Prometheus:
    """The real Prometheus binary on 127.0.0.1, scraping file_sd targets every second."""

    def __init__(self, workdir: Path, targets_file: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "kvpilot-runtime",
                            # the runtime's own model_name label wins over the target's
                            "honor_labels": True,
                            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
                        }
                    ],
                }
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        assert PROMETHEUS is not None
        if PROMTOOL is not None:  # what a user would run before deploying the config
            subprocess.run([PROMTOOL, "check", "config", str(self.config)], check=True, capture_output=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_until(self.ready, timeout=60, what="Prometheus /-/ready")
        return self

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"prometheus exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class AutoscalerProcess:
    """`kvpilot autoscaler run` as a subprocess."""

    def __init__(self, cluster: Cluster, namespace: str, log_dir: Path, identity: str, *extra: str) -> None:
        self.cluster = cluster
        self.identity = identity
        self.log_path = log_dir / f"autoscaler-{identity}.log"
        # Own ports: two of these run at once (the Lease test), and 8080/8081 may be taken on the host.
        self.health_port, self.metrics_port = free_port(), free_port()
        self.args = [
            sys.executable, "-m", "kvpilot", "autoscaler", "run",
            "--kubeconfig", str(cluster.kubeconfig),
            "--namespace", namespace,
            "--identity", identity,
            "--health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port),
            *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AutoscalerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.cluster.env()
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return stop_process(self.proc, sig)


class ReplicaWatch:
    """Poll spec.replicas every 0.25 s and keep (time, replicas) at every change."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                spec = get_model(self.api_client, self.namespace)["spec"]
                replicas = int(spec.get("replicas", spec["autoscaling"]["minReplicas"]))
                if not self.changes or self.changes[-1][1] != replicas:
                    self.changes.append((time.time(), replicas))
            except Exception:  # a slow API server: try again
                pass
            self._stop.wait(0.25)

    @property
    def current(self) -> int:
        return self.changes[-1][1] if self.changes else 0

    def first_time_above(self, n: int) -> float | None:
        return next((t for t, r in self.changes if r > n), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def sustained_overload_start(prom: Prometheus, namespace: str, before: float) -> tuple[float, float] | None:
    """(time of the first scrape of the run of scrapes with queue > target per ready replica that was
    still going on at `before`, queue it showed). Raw samples, not a rate or an average."""
    sel = f'kvpilot_num_requests_waiting{{namespace="{namespace}",model_name="{MODEL}"}}'
    series = prom.query(f"{sel}[5m]", at=before)
    points: dict[float, float] = {}
    pods: dict[float, int] = {}
    for s in series:
        for ts, value in s["values"]:
            points[float(ts)] = points.get(float(ts), 0.0) + float(value)
            pods[float(ts)] = pods.get(float(ts), 0) + 1
    start: tuple[float, float] | None = None
    # Scrapes of different pods land at different instants; with one ready replica (before the first
    # scale-up) each instant is one pod's queue.
    for ts in sorted(points):
        if ts > before:
            break
        if points[ts] > TARGET_QUEUE * max(1, pods[ts]):
            if start is None:
                start = (ts, points[ts])
        else:
            start = None
    return start


# -- the scaling test --------------------------------------------------------------------------


def test_prometheus_driven_scale_up_and_down_with_real_runtimes(
    cluster: Cluster, crds: None, namespace: str, kubectl: Kubectl, api_client: Any, tmp_path: Path
) -> None:
    require_tool("prometheus", "apt-get install prometheus")
    figures: dict[str, Any] = {}
    targets = tmp_path / "targets.json"
    operator = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect").start()
    kubelet = LocalKubelet(
        api_client,
        namespace,
        f"kvpilot.dev/model={MODEL}",
        tmp_path / "pods",
        extra_args=RUNTIME_FLAGS,
        targets_file=targets,
    )
    prom = Prometheus(tmp_path, targets).start()
    autoscaler = AutoscalerProcess(
        cluster,
        namespace,
        tmp_path,
        "solo",
        "--metrics-source", "prometheus",
        "--prometheus-url", prom.url,
        "--interval", "2",
        "--no-leader-elect",
        "--scale-down-rule", "1,0,10",
    )  # fmt: skip
    watch = ReplicaWatch(api_client, namespace)
    try:
        t0 = time.time()
        kubectl.apply(autoscaled_model(prom.url, scaleDownStabilizationSeconds=20))
        kubelet.start()
        wait_until(lambda: kubelet.endpoints(), timeout=180, what="the first runtime /ready")
        figures["first_runtime_ready_s"] = round(time.time() - t0, 1)
        kv = f'kvpilot_kv_cache_usage_ratio{{namespace="{namespace}",model_name="{MODEL}"}}'
        wait_until(lambda: prom.query(kv), timeout=30, what="Prometheus scraping the runtime")

        autoscaler.start()
        watch.start()

        def reporting() -> bool:
            last = (
                get_model(api_client, namespace).get("status", {}).get("autoscaler", {}).get("lastDecision")
            )
            return bool(last and last["metrics"]["reporting"] == 1)

        wait_until(reporting, timeout=60, what="an autoscaler decision with the runtime reporting")
        assert watch.current == 1, watch.changes

        # Load: 24 closed-loop clients on one replica of 8 sequences: 16 waiting, 4x the target.
        scaled_since: list[float] = []

        def enough() -> bool:
            # Stop once two or more replicas have served together for 15 s.
            if len(kubelet.endpoints()) >= 2:
                scaled_since.append(time.monotonic())
                return time.monotonic() - scaled_since[0] >= 15
            return False

        load_start = time.time()
        load = asyncio.run(
            openai_load(
                kubelet.endpoints,
                MODEL,
                concurrency=24,
                max_requests=600,
                duration_s=150,
                max_tokens=48,
                stop=enough,
            )
        )
        load_end = time.time()
        figures["load"] = {
            "requests": load.requests,
            "failed": load.failed,
            "duration_s": round(load_end - load_start, 1),
            "per_endpoint": sorted(load.endpoints_used.values(), reverse=True),
            "latency_p50_s": round(sorted(load.latencies_s)[len(load.latencies_s) // 2], 2),
            "latency_max_s": round(max(load.latencies_s), 2),
        }
        assert load.requests > 0
        assert load.failed == 0, load.errors[:10]
        assert all(s == 200 for s in load.statuses)
        assert set(load.finish_reasons) == {"length"}, set(load.finish_reasons)  # ignore_eos: all full
        assert len(load.endpoints_used) >= 2, "no request reached a replica the autoscaler added"

        scale_up_at = watch.first_time_above(1)
        assert scale_up_at is not None, f"never scaled up: {watch.changes}"
        peak = max(r for _, r in watch.changes)
        figures["peak_replicas"] = peak
        overload = sustained_overload_start(prom, namespace, scale_up_at)
        assert overload is not None, "no scrape showed the queue above target before the scale-up"
        figures["overload_first_scrape_queue"] = overload[1]
        figures["time_to_scale_decision_s"] = round(scale_up_at - overload[0], 2)
        figures["load_start_to_scale_decision_s"] = round(scale_up_at - load_start, 2)
        events = kubectl.json("get", "events", "--field-selector", "reason=ScaledUp")["items"]
        assert events, "no ScaledUp Event"
        figures["scale_up_reason"] = events[0]["message"]

        # After the load: back to minReplicas, each removed replica drained and exited 0.
        wait_until(lambda: watch.current == 1, timeout=150, what=f"scale back to 1 (changes {watch.changes})")
        back_at = next(t for t, r in reversed(watch.changes) if r == 1)
        figures["load_end_to_min_replicas_s"] = round(back_at - load_end, 1)
        figures["replica_changes"] = [(round(t - load_start, 1), r) for t, r in watch.changes]
        wait_until(lambda: len(kubelet.live()) == 1, timeout=90, what="drained runtimes to exit")
        stopped = [p for p in kubelet.all_pods() if p.exit_code is not None]
        assert len(stopped) == peak - 1
        for p in stopped:
            assert p.exit_code == 0 and not p.killed and not p.crashed, (p.name, p.exit_code, p.log_tail())
            assert p.sigterm_at is not None and p.deleted_at is not None
        assert kubelet.errors == []
        status = get_model(api_client, namespace)["status"]
        assert status["autoscaler"]["lastDecision"]["toReplicas"] == 1
        assert status["autoscaler"]["decidedBy"] == "solo"
        assert "kvCacheUsage" in status
    finally:
        codes: list[int | None] = []
        stop_all(watch.stop, lambda: codes.append(autoscaler.stop()), kubelet.stop, prom.stop, operator.stop)
        print("AUTOSCALER_E2E_FIGURES " + json.dumps(figures))
    assert codes == [0], autoscaler.log()[-3000:]


# -- the closed loop: measured attainment --------------------------------------------------------


def test_slow_replicas_are_scaled_up_by_the_measured_attainment_rule(
    cluster: Cluster, crds: None, namespace: str, kubectl: Kubectl, api_client: Any, tmp_path: Path
) -> None:
    """Replicas slower than the SLO: the SLO (20 ms TTFT, 12 ms TPOT) is what the planner's replica
    model (an H100) delivers with room to spare, one replica being plenty for the load (4 clients, 8
    batch slots: no queue, little KV), but the CPU runtimes are slower on both counts.
    No router: the attainment comes from the pods' own latency histograms through Prometheus. Only
    the measured-attainment rule can grow the fleet, within two syncs of the first one that judged
    enough requests, and the decision's reason must say so."""
    require_tool("prometheus", "apt-get install prometheus")
    interval = 2.0
    figures: dict[str, Any] = {}
    targets = tmp_path / "targets.json"
    operator = OperatorProcess(cluster, namespace, tmp_path, "--no-leader-elect").start()
    kubelet = LocalKubelet(
        api_client,
        namespace,
        f"kvpilot.dev/model={MODEL}",
        tmp_path / "pods",
        extra_args=RUNTIME_FLAGS,
        targets_file=targets,
    )
    prom = Prometheus(tmp_path, targets).start()
    autoscaler = AutoscalerProcess(
        cluster,
        namespace,
        tmp_path,
        "loop",
        "--metrics-source", "prometheus",
        "--prometheus-url", prom.url,
        "--interval", str(interval),
        "--no-leader-elect",
        # The completion-rate estimate would see slow replicas too, and a second replica for
        # redundancy would come first; this test is about the loop.
        "--no-arrival-rate",
        "--redundancy-replicas", "1",
    )  # fmt: skip
    decisions: list[dict[str, Any]] = []
    stop = threading.Event()

    def record() -> None:  # every decision the autoscaler writes, once
        while not stop.is_set():
            try:
                a = get_model(api_client, namespace).get("status", {}).get("autoscaler", {})
                last = a.get("lastDecision")
                if last and (not decisions or decisions[-1]["time"] != last["time"]):
                    decisions.append({**last, "slo": a.get("slo") or {}})
            except Exception:  # a slow API server: try again
                pass
            stop.wait(0.2)

    recorder = threading.Thread(target=record, daemon=True)
    # An H100 replica model serves ~37 requests/s of these within 20 ms TTFT and 12 ms TPOT; the CPU
    # runtimes (one thread each) take longer for both.
    slo = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 0.02, "tpotSeconds": 0.012}
    try:
        kubectl.apply(autoscaled_model(prom.url, maxReplicas=2, slo=slo))
        kubelet.start()
        wait_until(lambda: kubelet.endpoints(), timeout=180, what="the first runtime /ready")
        kv = f'kvpilot_kv_cache_usage_ratio{{namespace="{namespace}",model_name="{MODEL}"}}'
        wait_until(lambda: prom.query(kv), timeout=30, what="Prometheus scraping the runtime")
        autoscaler.start()
        recorder.start()
        wait_until(lambda: len(decisions) >= 2, timeout=60, what="two autoscaler decisions")
        grown = lambda: any(d["toReplicas"] > d["fromReplicas"] for d in decisions)  # noqa: E731
        load = asyncio.run(
            openai_load(
                kubelet.endpoints,
                MODEL,
                concurrency=4,
                max_requests=400,
                duration_s=240,
                max_tokens=4,
                stop=grown,
            )
        )
        assert load.failed == 0, load.errors[:10]
        up = next((d for d in decisions if d["toReplicas"] > d["fromReplicas"]), None)
        assert up is not None, [d["reason"] for d in decisions][-5:]
        assert (up["fromReplicas"], up["toReplicas"]) == (1, 2)
        assert "[signal: measured attainment]" in up["reason"], up["reason"]
        assert up["reason"].startswith("measured attainment "), up["reason"]
        assert up["slo"]["source"] == "pods" and up["slo"]["attainment"] < 0.99
        # Within two sync periods of the first decision whose window held enough requests to judge.
        i_up = decisions.index(up)
        judged = next(i for i, d in enumerate(decisions) if d["slo"].get("requests", 0) >= 20)
        figures["syncs_from_enough_requests_to_scale_up"] = i_up - judged
        assert i_up - judged <= 2, [(d["reason"][:120], d["slo"].get("requests")) for d in decisions]
        events = kubectl.json("get", "events", "--field-selector", "reason=ScaledUp")["items"]
        assert any("[signal: measured attainment]" in e["message"] for e in events)
        figures["scale_up_reason"] = up["reason"]
        figures["attainment_at_scale_up"] = up["slo"]["attainment"]
    finally:
        stop.set()
        codes: list[int | None] = []
        stop_all(lambda: codes.append(autoscaler.stop()), kubelet.stop, prom.stop, operator.stop)
        print("AUTOSCALER_LOOP_E2E_FIGURES " + json.dumps(figures))
    assert codes == [0], autoscaler.log()[-3000:]


# -- leader election ---------------------------------------------------------------------------


def test_two_autoscalers_one_decides_the_other_takes_over(
    cluster: Cluster, crds: None, namespace: str, kubectl: Kubectl, api_client: Any, tmp_path: Path
) -> None:
    """No operator and no runtimes: the model has no Ready pod, so each sync is a "no metrics" hold,
    which still writes status.autoscaler (with decidedBy) every interval."""
    kubectl.apply(autoscaled_model("http://127.0.0.1:1"))
    common = ("--metrics-source", "prometheus", "--interval", "1", "--leader-namespace", namespace)
    a = AutoscalerProcess(cluster, namespace, tmp_path, "as-a", *common).start()
    b = AutoscalerProcess(cluster, namespace, tmp_path, "as-b", *common).start()
    procs = {"as-a": a, "as-b": b}

    def holder() -> str | None:
        lease = kubectl.run("get", "lease", "kvpilot-autoscaler", "-o", "json", check=False)
        if lease.returncode != 0:
            return None
        return json.loads(lease.stdout)["spec"].get("holderIdentity") or None

    def decided_by() -> tuple[str, str] | None:
        block = get_model(api_client, namespace).get("status", {}).get("autoscaler") or {}
        last = block.get("lastDecision") or {}
        return (block["decidedBy"], last["time"]) if block.get("decidedBy") else None

    def observe(seconds: float) -> set[str]:
        """Who wrote decisions during the next `seconds` (and that decisions kept coming)."""
        writers, times = set(), set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            d = decided_by()
            if d:
                writers.add(d[0])
                times.add(d[1])
            time.sleep(0.3)
        assert len(times) >= 2, "decisions stopped"
        return writers

    try:
        leader = wait_until(holder, timeout=30, what="a Lease holder")
        wait_until(lambda: (decided_by() or ("",))[0] == leader, timeout=30, what="a decision by the leader")
        assert observe(6) == {leader}
        standby = "as-b" if leader == "as-a" else "as-a"

        # A clean stop releases the Lease: the standby takes over within its retry period.
        stopped_at = time.monotonic()
        assert procs[leader].stop() == 0
        wait_until(lambda: holder() == standby, timeout=20, what=f"{standby} to take the Lease")
        wait_until(lambda: (decided_by() or ("",))[0] == standby, timeout=20, what=f"decisions by {standby}")
        takeover_clean_s = time.monotonic() - stopped_at
        assert observe(4) == {standby}

        # A crash (SIGKILL) leaves the Lease held: the restarted one takes over after it expires.
        restarted = AutoscalerProcess(cluster, namespace, tmp_path, f"{leader}-2", *common).start()
        procs[f"{leader}-2"] = restarted
        time.sleep(3)
        assert holder() == standby
        killed_at = time.monotonic()
        procs[standby].stop(signal.SIGKILL)
        wait_until(lambda: holder() == f"{leader}-2", timeout=45, what="takeover after the Lease expired")
        wait_until(lambda: (decided_by() or ("",))[0] == f"{leader}-2", timeout=20, what="decisions")
        takeover_crash_s = time.monotonic() - killed_at
        assert observe(4) == {f"{leader}-2"}
        print(
            "AUTOSCALER_E2E_FIGURES "
            + json.dumps(
                {
                    "takeover_after_stop_s": round(takeover_clean_s, 1),
                    "takeover_after_kill_s": round(takeover_crash_s, 1),
                }
            )
        )
        assert takeover_clean_s < 15
    except BaseException:
        for name, p in procs.items():
            print(f"--- {name} ---\n{p.log()[-2000:]}")
        raise
    finally:
        for p in procs.values():
            p.stop()
