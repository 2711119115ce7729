"""The CPU runtime image, run as a container the way the operator runs model pods: with a memory and a
CPU limit, as uid 10001, with a read-only root filesystem and a tmpfs /tmp. It serves the builtin
SmolLM2 model, and on SIGTERM it lets an in-flight stream finish, then exits 0 before the grace period
ends (Docker's SIGKILL would give 137).

The image is (re)built first with scripts/build_images.sh: seconds when nothing changed (Docker's layer
cache), minutes after a source change, so the container always runs the code under test. Without
docker or a daemon the module skips, and fails under CI=true (tests/needs.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.needs import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import image_startup as images  # noqa: E402

MODEL = "smollm2-135m-instruct"
MEMORY = "2g"
CPUS = "1"
GRACE_S = 90  # docker stop's SIGTERM -> SIGKILL wait; more than the config's shutdown_timeout (60 s)
STREAM_TOKENS = 48

# building the image after a source change takes minutes (pip installs torch)
pytestmark = pytest.mark.timeout(2400)

require_tool("docker", "bash scripts/docker.sh installs Debian's docker.io and starts dockerd")
if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
    missing("a Docker daemon (`docker info` fails)", "bash scripts/docker.sh starts dockerd")


@pytest.fixture(scope="module")
def image() -> str:
    build = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_images.sh"), "runtime-cpu"],
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return images.runtime_image()


@pytest.fixture(scope="module")
def container(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[images.Container]:
    config = images.write_config(tmp_path_factory.mktemp("config") / "config.yaml")
    config.parent.chmod(0o755)
    started = images.run_runtime(image, config, f"kvpilot-test-runtime-{id(config)}", MEMORY, CPUS)
    try:
        images.wait_ready(started)
        yield started
    finally:
        started.remove()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def test_runs_with_the_limits_read_only_root_and_non_root(container: images.Container) -> None:
    info = container.inspect()
    host = info["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["Memory"] == 2 * 2**30 and host["NanoCpus"] == 10**9
    assert info["Config"]["User"] == "10001:10001"
    # the serving process itself (PID 1) runs as 10001, and the root filesystem refuses writes
    status = images.docker("exec", container.name, "cat", "/proc/1/status").stdout
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["10001"] * 4
    write = images.docker("exec", container.name, "touch", "/opt/kvpilot/written", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    # /tmp is where it may write: the CPU kernels it compiled on start are there
    kernels = images.docker("exec", container.name, "ls", "/tmp/.cache/kvpilot/kernels").stdout
    assert ".so" in kernels


def test_serves_models_and_a_completion(container: images.Container) -> None:
    with urllib.request.urlopen(f"{container.url}/v1/models", timeout=30) as resp:
        models = json.loads(resp.read())
    assert [m["id"] for m in models["data"]] == [MODEL]
    doc = post(
        f"{container.url}/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    )
    choice = doc["choices"][0]
    assert choice["text"].strip()
    assert choice["finish_reason"] in ("length", "stop")
    assert doc["usage"]["completion_tokens"] <= 8


def stream_completion(url: str, events: list[dict[str, Any]], first: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=GRACE_S) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
                first.set()
    finally:
        first.set()


def test_sigterm_drains_the_in_flight_stream_then_exits_0(container: images.Container) -> None:
    events: list[dict[str, Any]] = []
    first = threading.Event()
    client = threading.Thread(target=stream_completion, args=(container.url, events, first))
    client.start()
    assert first.wait(GRACE_S) and events, "the stream never started"
    # docker stop: SIGTERM now, SIGKILL after GRACE_S (a pod's terminationGracePeriodSeconds)
    images.docker("stop", "-t", str(GRACE_S), container.name, timeout=GRACE_S + 60)
    client.join(GRACE_S)
    assert not client.is_alive()
    assert events[-1] == {"done": True}
    # every token was generated: the stream ended by its length, not by the drain's abort
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    assert finishes == ["length"]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [STREAM_TOKENS]
    state = container.inspect()["State"]
    assert state["Running"] is False and state["OOMKilled"] is False
    assert state["ExitCode"] == 0, images.docker("logs", "--tail", "20", container.name).stderr
    logs = images.docker("logs", container.name).stderr
    assert "SIGTERM received: draining" in logs
