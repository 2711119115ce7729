"""Start the runtime image as a container and time it from `docker run` to /ready 200 (image present).

    python benchmarks/image_startup.py [--image ghcr.io/kvpilot/kvpilot-runtime:0.1.0-cpu] [--runs 3]
        [--memory 2g] [--cpus 1] [--output FILE]

The container runs as the operator runs model pods: read-only root filesystem, a writable /tmp (a tmpfs
here, an emptyDir in a pod), non-root, the config mounted at /etc/kvpilot/config.yaml, with a memory
and a CPU limit. Each run is a fresh container, so each pays what a new pod pays: Python and torch
imports, reading the GGUF, compiling the CPU kernels into /tmp. Prints one JSON document (machine,
settings, seconds per run and the median). Needs a Docker daemon and the image
(bash scripts/build_images.sh runtime-cpu). tests/images/ runs its containers through this module.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

ROOT = harness.ROOT
CONFIG_PATH = "/etc/kvpilot/config.yaml"  # what the operator mounts and the image's CMD reads
HTTP_PORT = 8000
# /tmp is the only writable path (HOME, caches and the CPU kernels' build cache live there). Docker's
# --tmpfs default is noexec: the compiled kernels are loaded from it, so `exec` is needed (a pod's
# emptyDir has no noexec).
TMPFS = "/tmp:rw,exec,nosuid,nodev,size=512m,mode=1777"
# What the test and the figures run with: SmolLM2 on the CPU, a small KV pool, a drain long enough
# for the in-flight streams.
CONFIG = {"device": "cpu", "kv_cache_memory": 128 * 2**20, "shutdown_timeout": 60}


def app_version() -> str:
    for line in (ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return line.split(":", 1)[1].strip().strip('"')
    raise RuntimeError("no appVersion in charts/kvpilot/Chart.yaml")


def runtime_image() -> str:
    """The tag scripts/build_images.sh gives the CPU runtime image."""
    return f"ghcr.io/kvpilot/kvpilot-runtime:{app_version()}-cpu"


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


@dataclass
class Container:
    name: str
    port: int  # the host port (127.0.0.1) published for the container's HTTP_PORT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inspect(self) -> dict[str, Any]:
        doc: list[dict[str, Any]] = json.loads(docker("inspect", self.name).stdout)
        return doc[0]

    def remove(self) -> None:
        docker("rm", "-f", self.name, check=False)


def run_runtime(image: str, config_file: Path, name: str, memory: str = "2g", cpus: str = "1") -> Container:
    """`docker run -d` the runtime image with limits, read-only root, /tmp tmpfs and the config mounted;
    the HTTP port is published on 127.0.0.1 (a free port)."""
    docker(
        "run",
        "-d",
        "--name",
        name,
        "--memory",
        memory,
        "--memory-swap",
        memory,  # no swap on top: the limit is the limit
        "--cpus",
        cpus,
        "--read-only",
        "--tmpfs",
        TMPFS,
        "-v",
        f"{config_file}:{CONFIG_PATH}:ro",
        "-p",
        f"127.0.0.1::{HTTP_PORT}",
        image,
    )
    ports = docker("port", name, str(HTTP_PORT)).stdout.split()
    return Container(name, int(ports[0].rsplit(":", 1)[1]))


def write_config(path: Path) -> Path:
    path.write_text("".join(f"{k}: {v}\n" for k, v in CONFIG.items()))
    path.chmod(0o644)  # read by uid 10001 in the container
    return path


def wait_ready(container: Container, timeout: float = 300) -> None:
    """Return when GET /ready answers 200; raise if the container exits or `timeout` passes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            with urllib.request.urlopen(f"{container.url}/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        state = container.inspect()["State"]
        if not state["Running"]:
            logs = docker("logs", "--tail", "30", container.name, check=False)
            raise RuntimeError(f"{container.name} exited with {state['ExitCode']}: {logs.stderr[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{container.name} not ready after {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--image", default=None, help="the runtime image (default: the CPU one build_images.sh tags)"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="2g", help="docker run --memory (and --memory-swap)")
    ap.add_argument("--cpus", default="1", help="docker run --cpus")
    harness.add_output_arg(ap)
    args = ap.parse_args()
    image = args.image or runtime_image()
    config = write_config(Path(f"/tmp/kvpilot-image-startup-{time.time_ns()}.yaml"))
    seconds = []
    try:
        for i in range(args.runs):
            start = time.monotonic()
            container = run_runtime(
                image, config, f"kvpilot-startup-{i}-{time.time_ns()}", args.memory, args.cpus
            )
            try:
                wait_ready(container)
                seconds.append(round(time.monotonic() - start, 2))
            finally:
                container.remove()
    finally:
        config.unlink(missing_ok=True)
    harness.emit(
        {
            "benchmark": "image_startup",
            "machine": harness.machine(),
            "image": image,
            "image_size_bytes": int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout),
            "limits": {"memory": args.memory, "cpus": args.cpus},
            "config": CONFIG,
            "start_to_ready_s": seconds,
            "median_s": round(statistics.median(seconds), 2),
        },
        args.output,
    )


if __name__ == "__main__":
    main()
