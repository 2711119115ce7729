"""Long-running kvpilot processes that e2e tests start against the local control plane."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from e2e.harness import Cluster, wait_until
from kvpilot.net import free_port

ROOT = Path(__file__).resolve().parents[1]


def stop_process(
    proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 30
) -> int | None:
    """Signal a running process and wait for it (killed after `timeout`); its exit code, None if never started."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class OperatorProcess:
    """`kvpilot operator` as a subprocess, with its /metrics readable."""

    def __init__(self, cluster: Cluster, namespace: str, log_dir: Path, *extra: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.log_path = log_dir / f"operator-{self.metrics_port}.log"
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        args = [
            sys.executable, "-m", "kvpilot", "operator",
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--namespace", self.namespace,
            "--image", "kvpilot/kvpilot:e2e",
            "--metrics-port", str(self.metrics_port),
            "--health-port", str(self.health_port),
            "--resync-seconds", "3600",
            "--leader-election-namespace", self.namespace,
            *self.extra,
        ]  # fmt: skip
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.cluster.env()
        )
        wait_until(self.healthy, timeout=30, what="operator /healthz")
        return self

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Samples of the operator's own metrics, keyed by 'name{labels}'."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvpilot_operator_"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)
