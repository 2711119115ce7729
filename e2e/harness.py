"""Test-side helpers for the e2e control plane: start it through `e2e/cluster` (the same entry point a
person uses) and drive it with the real kubectl.

Several pytest sessions (say the operator's and the autoscaler's e2e suites) may share one cluster:
each registers itself in the state folder, and the cluster is stopped by the last session to leave,
and only if a session started it. A cluster someone started by hand with `e2e/cluster up` is left
running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

E2E_DIR = Path(__file__).resolve().parent
CLUSTER = E2E_DIR / "cluster"
E2E_NODE_LABEL = "kvpilot.dev/e2e-node"

T = TypeVar("T")


class ClusterUnavailable(Exception):
    """The binaries are missing and building them is switched off (KVPILOT_E2E_BUILD=0)."""


def cluster_command(
    *args: str, check: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `e2e/cluster ARGS`, capturing output; on failure the error carries it."""
    result = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"e2e/cluster {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def binaries_built() -> bool:
    return cluster_command("build", "--check", check=False).returncode == 0


def build_allowed() -> bool:
    return os.environ.get("KVPILOT_E2E_BUILD", "1") != "0"


def cluster_info() -> dict[str, Any]:
    info: dict[str, Any] = json.loads(cluster_command("env", "--json").stdout)
    return info


class KubectlError(RuntimeError):
    def __init__(self, args: Sequence[str], result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        self.result = result


@dataclass(frozen=True)
class Kubectl:
    """The real kubectl against the e2e cluster, optionally bound to a namespace."""

    binary: Path
    kubeconfig: Path
    namespace: str | None = None

    def run(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), f"--kubeconfig={self.kubeconfig}"]
        if self.namespace is not None:
            argv.append(f"--namespace={self.namespace}")
        result = subprocess.run(
            [*argv, *args], input=input_text, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise KubectlError(args, result)
        return result

    def __call__(self, *args: str, input_text: str | None = None, timeout: float = 120) -> str:
        """stdout of a kubectl command that must succeed."""
        return self.run(*args, input_text=input_text, timeout=timeout).stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def apply(self, manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
        """Apply YAML text, an object, or a list of objects."""
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, Mapping):
            text = json.dumps(manifest)
        else:
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifest)})
        return self("apply", "-f", "-", input_text=text)

    def exists(self, *resource: str) -> bool:
        return self.run("get", *resource, "--ignore-not-found", "-o", "name", check=True).stdout.strip() != ""

    def in_namespace(self, namespace: str) -> Kubectl:
        return Kubectl(self.binary, self.kubeconfig, namespace)


def wait_until(
    condition: Callable[[], T | None], timeout: float = 60, interval: float = 0.5, what: str = "condition"
) -> T:
    """Poll until `condition` returns something truthy, and return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def stop_all(*stops: Callable[[], object]) -> None:
    """Run every stop (a test's processes, in order) even when an earlier one raises, then raise the
    first error: a failing stop must not leave the later processes (Prometheus, runtimes) running."""
    errors: list[BaseException] = []
    for stop in stops:
        try:
            stop()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


@dataclass
class Cluster:
    kubeconfig: Path
    server: str
    binaries: dict[str, Path]
    kubectl: Kubectl
    state_dir: Path
    started_here: bool = field(default=False)

    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG and the binaries' folder on PATH, for running other tools."""
        dirs = sorted({str(p.parent) for p in self.binaries.values()})
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": os.pathsep.join([*dirs, os.environ["PATH"]]),
        }


@contextlib.contextmanager
def _users_lock(state_dir: Path) -> Iterator[Path]:
    users = state_dir / "users"
    users.mkdir(parents=True, exist_ok=True)
    with (state_dir / ".users.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield users
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live_users(users: Path) -> list[int]:
    alive = []
    for entry in users.iterdir():
        with contextlib.suppress(ValueError):
            pid = int(entry.name)
            if Path(f"/proc/{pid}").exists():
                alive.append(pid)
                continue
        entry.unlink(missing_ok=True)  # a session that died without cleaning up
    return alive


def start_cluster() -> Cluster:
    """Bring the cluster up (building the binaries first if allowed) and register this process as a user."""
    if not binaries_built():
        if not build_allowed():
            raise ClusterUnavailable(
                "e2e control-plane binaries are not built and KVPILOT_E2E_BUILD=0; run `e2e/cluster build`"
            )
        cluster_command("build")
    info = cluster_info()
    state_dir = Path(info["state_dir"])
    state_dir.mkdir(parents=True, exist_ok=True)
    with _users_lock(state_dir) as users:
        was_running = cluster_command("status", "--quiet", check=False).returncode == 0
        if not was_running:
            try:
                out = cluster_command("up").stdout.strip().splitlines()
            except RuntimeError:
                cluster_command("down", check=False)  # leave nothing half-started; logs stay in the state dir
                raise
            assert out and out[-1].startswith("export KUBECONFIG="), out
            (state_dir / "started-by-pytest").touch()
        (users / str(os.getpid())).touch()
    binaries = {name: Path(path) for name, path in cluster_info()["binaries"].items()}
    kubeconfig = Path(info["kubeconfig"])
    return Cluster(
        kubeconfig=kubeconfig,
        server=info["server"],
        binaries=binaries,
        kubectl=Kubectl(binaries["kubectl"], kubeconfig),
        state_dir=state_dir,
        started_here=not was_running,
    )


def release_cluster(cluster: Cluster) -> None:
    """Unregister; the last session out stops a cluster that pytest started (KVPILOT_E2E_KEEP=1 keeps it)."""
    with _users_lock(cluster.state_dir) as users:
        (users / str(os.getpid())).unlink(missing_ok=True)
        marker = cluster.state_dir / "started-by-pytest"
        if _live_users(users) or not marker.exists() or os.environ.get("KVPILOT_E2E_KEEP") == "1":
            return
        marker.unlink()
        cluster_command("down")
