"""Drain on SIGTERM, on a real `kvpilot serve` process (SmolLM2 on CPU; no cluster needed).

What scale-down relies on: with 32 streaming requests in flight (half running, half still waiting),
SIGTERM makes /ready answer 503 and new requests get 503, every in-flight stream still runs to its
full length and ends with finish_reason and [DONE], and the process exits 0 within the shutdown
timeout.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from e2e.harness import wait_until
from kvpilot.net import free_port

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT = 32
MAX_TOKENS = 48
SHUTDOWN_TIMEOUT_S = 120.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log_path = tmp_path / "serve.log"
    argv = [
        sys.executable, "-m", "kvpilot", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--threads", "1",
        "--max-num-seqs", "16", "--kv-cache-memory", "128MiB",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
    ]  # fmt: skip
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until(lambda: _ready(srv), timeout=180, what="kvpilot serve /ready")
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ready(srv: Server) -> bool:
    if srv.proc.poll() is not None:
        raise RuntimeError(f"kvpilot serve exited {srv.proc.returncode}:\n{srv.log()}")
    try:
        return srv.status("/ready") == 200
    except OSError:
        return False


@dataclass
class StreamResult:
    finish_reason: str | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    error: str | None = None


async def _stream(client: openai.AsyncOpenAI, i: int) -> StreamResult:
    out = StreamResult()
    try:
        stream = await client.completions.create(
            model="smollm2-135m-instruct",
            prompt=f"Request {i}: describe a harbour at dawn.",
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            out.chunks += 1
            for choice in chunk.choices:
                if choice.finish_reason:
                    out.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def test_sigterm_drains_32_streams_and_exits_0(server: Server) -> None:
    async def scenario() -> tuple[list[StreamResult], dict[str, float], int]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        tasks = [asyncio.create_task(_stream(client, i)) for i in range(IN_FLIGHT)]

        def all_admitted() -> bool:
            running = server.metric("kvpilot_num_requests_running")
            waiting = server.metric("kvpilot_num_requests_waiting")
            return running + waiting >= IN_FLIGHT and running > 0

        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(all_admitted):
            assert time.monotonic() < deadline, "the 32 requests never were in flight together"
            await asyncio.sleep(0.1)
        figures = {
            "running_at_sigterm": server.metric("kvpilot_num_requests_running"),
            "waiting_at_sigterm": server.metric("kvpilot_num_requests_waiting"),
        }
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)

        # /ready flips to 503 while the streams are still going.
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(server.status, "/ready") != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
            await asyncio.sleep(0.05)
        figures["ready_503_after_s"] = time.monotonic() - sigterm_at
        unfinished = sum(1 for t in tasks if not t.done())
        assert unfinished > 0, "every stream had finished before /ready was checked: nothing was drained"
        figures["streams_unfinished_at_ready_503"] = unfinished
        # A new request during the drain is refused with 503 (not accepted, not cut later).
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="smollm2-135m-instruct", prompt="late", max_tokens=4)
        assert refused.value.status_code == 503

        results = await asyncio.gather(*tasks)
        figures["streams_done_after_s"] = time.monotonic() - sigterm_at
        await client.close()
        code = await asyncio.to_thread(server.proc.wait, SHUTDOWN_TIMEOUT_S + 10)
        figures["exit_after_s"] = time.monotonic() - sigterm_at
        return results, figures, code

    results, figures, code = asyncio.run(scenario())
    print("DRAIN_FIGURES " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    errors = [r.error for r in results if r.error]
    assert errors == [], errors[:5]
    assert [r.finish_reason for r in results] == ["length"] * IN_FLIGHT
    assert [r.completion_tokens for r in results] == [MAX_TOKENS] * IN_FLIGHT  # none cut short
    assert code == 0, server.log()
    assert figures["exit_after_s"] < SHUTDOWN_TIMEOUT_S
    assert figures["waiting_at_sigterm"] > 0  # queued requests were drained too, not only running ones
