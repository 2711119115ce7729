"""The servers benchmarks/load_tools_bench.py points the load tools at, each a context manager that
yields the base URL once the server answers, and stops what it started:

- kvpilot: one `kvpilot serve` process (the builtin SmolLM2 GGUF unless a model is given);
- router: `kvpilot router` (fleet/router_local.py's start_router) with a policy in front of N
  `kvpilot serve` processes of one thread each (OMP_NUM_THREADS=1), each pod's --max-num-seqs the
  router's --pod-capacity;
- vllm: `vllm serve` of vLLM's CPU build (an executable and a Hugging Face checkpoint directory,
  e.g. what scripts/vllm_cpu.sh installs and converts), started as peers/vllm_cpu.py says.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvpilot.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, also when run as a script
from fleet.router_local import processes, start_router
from peers import vllm_cpu


def wait_ok(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until GET `url` answers 200; fails when the process exits first or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))!r} exited {proc.returncode}")  # type: ignore[arg-type]
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 in {timeout:g} s")


def serve_argv(model: str | None, served: str, port: int, threads: int) -> list[str]:
    return [
        sys.executable, "-m", "kvpilot", "serve", *([model] if model else []),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served,
        "--device", "cpu", "--threads", str(threads), "--log-level", "warning",
    ]  # fmt: skip


def _start(
    procs: list[subprocess.Popen[bytes]], argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    procs.append(proc)
    return proc


@contextlib.contextmanager
def kvpilot(model: str | None, served: str, threads: int, logs: Path, timeout: float) -> Iterator[str]:
    with processes() as procs:
        port = free_port()
        proc = _start(procs, serve_argv(model, served, port, threads), logs / "kvpilot-serve.log")
        url = f"http://127.0.0.1:{port}"
        wait_ok(url + "/ready", proc, timeout)
        yield url


@contextlib.contextmanager
def router(
    model: str | None, served: str, pods: int, policy: str, capacity: int, logs: Path, timeout: float
) -> Iterator[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with processes() as procs:
        urls = []
        for i in range(pods):
            port = free_port()
            argv = [*serve_argv(model, served, port, 1), "--max-num-seqs", str(capacity)]
            urls.append((f"http://127.0.0.1:{port}", _start(procs, argv, logs / f"pod-{i}.log", env)))
        for url, proc in urls:
            wait_ok(url + "/ready", proc, timeout)
        yield start_router(procs, f"{served}={','.join(u for u, _ in urls)}", policy, pod_capacity=capacity)


@contextlib.contextmanager
def vllm(
    exe: str, model_dir: str, served: str, extra: Sequence[str], logs: Path, timeout: float
) -> Iterator[str]:
    env = vllm_cpu.serve_env(os.environ, Path(exe))  # vLLM's own thread binding (`auto`)
    with processes() as procs:
        port = free_port()
        proc = _start(
            procs, vllm_cpu.serve_argv(exe, model_dir, served, port, extra), logs / "vllm-serve.log", env
        )
        url = f"http://127.0.0.1:{port}"
        wait_ok(url + "/v1/models", proc, timeout)
        yield url
