"""Leader handover on SIGTERM: two `kvpilot operator` replicas, the leader gets SIGTERM; prints JSON.

Per run: from the SIGTERM to (a) the Lease being released (holderIdentity empty), (b) the old leader's
exit, (c) the standby holding the Lease, (d) the standby's kvpilot_operator_leader gauge at 1. The
terminated replica is started again as the next run's standby, so runs alternate roles.

    eval "$(e2e/cluster env)"; python benchmarks/operator_bench.py handover --kubeconfig e2e/.state/kubeconfig --runs 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, config

from kvpilot.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, also when run as a script
import harness

ROOT = Path(__file__).resolve().parents[2]
LEASE = "kvpilot-operator"


class Replica:
    def __init__(self, kubeconfig: str, namespace: str, identity: str, log_dir: Path) -> None:
        self.identity = identity
        self.metrics_port, self.health_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "kvpilot", "operator", "--kubeconfig", kubeconfig,
            "--namespace", namespace, "--leader-election-namespace", namespace, "--identity", identity,
            "--image", "kvpilot/kvpilot:bench", "--resync-seconds", "3600",
            "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
        ]  # fmt: skip
        log = (log_dir / f"{identity}.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def leader_gauge(self) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("kvpilot_operator_leader "):
                        return float(line.split()[1])
        except OSError:
            pass
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def holder(coord: client.CoordinationV1Api, namespace: str) -> str | None:
    try:
        lease = coord.read_namespaced_lease(LEASE, namespace)
    except client.ApiException:
        return None
    return lease.spec.holder_identity or None


def wait_for(check: Any, timeout: float, what: str, poll: float = 0.02) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic()
        time.sleep(poll)
    raise TimeoutError(what)


def one_handover(
    coord: client.CoordinationV1Api, namespace: str, replicas: dict[str, Replica]
) -> tuple[str, dict[str, float]]:
    """SIGTERM the current leader; (its identity, the times from the signal)."""
    wait_for(lambda: holder(coord, namespace) in replicas, 60, "a leader")
    leader_id = holder(coord, namespace)
    assert leader_id is not None
    standby_id = next(n for n in replicas if n != leader_id)
    standby, leader = replicas[standby_id], replicas[leader_id]
    wait_for(lambda: standby.leader_gauge() == 0 and standby.proc.poll() is None, 60, "standby up")
    time.sleep(1.0)  # the standby is in its retry loop, as in a steady state
    t0 = time.monotonic()
    leader.proc.send_signal(signal.SIGTERM)
    released = wait_for(lambda: holder(coord, namespace) != leader_id, 60, "release")
    acquired = wait_for(lambda: holder(coord, namespace) == standby_id, 60, "standby acquires")
    leading = wait_for(lambda: standby.leader_gauge() == 1, 60, "standby leads", poll=0.05)
    leader.proc.wait(30)
    exited = time.monotonic()
    return leader_id, {
        "released_s": round(released - t0, 3),
        "old_leader_exited_s": round(exited - t0, 3),
        "standby_holds_lease_s": round(acquired - t0, 3),
        "standby_leading_s": round(leading - t0, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()

    kubectl = [args.kubectl, f"--kubeconfig={args.kubeconfig}"]
    subprocess.run(
        [*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds")],
        check=True, capture_output=True,
    )  # fmt: skip
    config.load_kube_config(args.kubeconfig)
    coord = client.CoordinationV1Api()
    namespace = f"bench-handover-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api().create_namespace({"metadata": {"name": namespace}})
    log_dir = Path(args.log_dir)
    replicas = {name: Replica(args.kubeconfig, namespace, name, log_dir) for name in ("op-a", "op-b")}
    runs: list[dict[str, float]] = []
    try:
        for _ in range(args.runs):
            leader_id, run = one_handover(coord, namespace, replicas)
            runs.append(run)
            replicas[leader_id] = Replica(args.kubeconfig, namespace, leader_id, log_dir)  # next standby
    finally:
        for r in replicas.values():
            r.stop()
        subprocess.run([*kubectl, "delete", "namespace", namespace, "--wait=false"], capture_output=True)
    acquire = [r["standby_holds_lease_s"] for r in runs]
    print(
        json.dumps(
            {
                "benchmark": "leader_handover_on_sigterm",
                "cpu": harness.cpu_model(),
                "runs": runs,
                "standby_holds_lease_s": {
                    "median": statistics.median(acquire),
                    "min": min(acquire),
                    "max": max(acquire),
                },
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
