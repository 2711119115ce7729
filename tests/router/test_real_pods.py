"""The router in front of real `kvpilot serve` processes (SmolLM2 on the CPU), through the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from kvpilot.net import free_port
from kvpilot.router.discovery import StaticSource, parse_endpoints
from kvpilot.router.server import POD_HEADER, Router, RouterSettings
from tests.router.upstreams import LiveRouter, start_router

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def start_pod(port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--threads", "1", "--max-num-seqs", "2", "--kv-cache-memory", "64MiB",
        "--enable-prefix-caching", *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"kvpilot serve not ready in {timeout}s: {log.read_text()[-2000:]}")


def metric_value(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[int, subprocess.Popen[bytes]]]]:
    logs = tmp_path_factory.mktemp("pods")
    started = []
    try:
        for i in range(2):
            port = free_port()
            started.append((port, start_pod(port, logs / f"pod{i}.log"), logs / f"pod{i}.log"))
        for port, proc, log in started:
            wait_ready(port, proc, log)
        yield [(port, proc) for port, proc, _ in started]
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.asynccontextmanager
async def live(urls: list[str], policy: str) -> AsyncIterator[LiveRouter]:
    router = Router(RouterSettings(policy=policy, scrape_interval_s=0.5))
    router.add_source(StaticSource(parse_endpoints([f"{MODEL}={','.join(urls)}"], capacity=2)))
    lr = await start_router(router)
    try:
        yield lr
    finally:
        await lr.runner.cleanup()


async def test_openai_client_through_router_to_real_pods(
    pods: list[tuple[int, subprocess.Popen[bytes]]],
) -> None:
    urls = [f"http://127.0.0.1:{port}" for port, _ in pods]
    async with live(urls, "kv-aware") as lr:
        client = openai.AsyncOpenAI(base_url=lr.url + "/v1", api_key="none", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        system = "You are a helpful assistant for a hardware store. Answer briefly and politely. " * 3
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Do you sell hammers?"},
        ]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")
        # the pod was given back when its [DONE] arrived, before the client could read it: the next
        # turn, sent at once, finds the first pod free with its prefix cached (a race before: one
        # failure in a loaded full run, when the pod was still counted busy with this stream)
        assert lr.router.pools[MODEL].in_flight == 0

        # the same conversation, one turn later: kv-aware sends it where its prefix is cached
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": "And nails?"},
            ],  # type: ignore[list-item]
            max_tokens=8,
            temperature=0,
        )
        first_pod = raw.headers[POD_HEADER]
        answer = raw.parse()
        assert answer.choices[0].message.content
        port = int(first_pod.rsplit(":", 1)[1])
        assert metric_value(port, "kvpilot_prefix_cache_hits_total") > 0

        completion = await client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=4
        )
        assert completion.choices[0].text and completion.usage is not None
        assert completion.usage.completion_tokens == 4
        await client.close()


async def test_a_killed_pod_is_retried_around(pods: list[tuple[int, subprocess.Popen[bytes]]]) -> None:
    """Runs last: it kills one pod. Requests after the kill are all served by the survivor."""
    urls = [f"http://127.0.0.1:{port}" for port, _ in pods]
    _, victim = pods[0]
    victim.kill()
    victim.wait()
    async with live(urls, "round-robin") as lr:
        client = openai.AsyncOpenAI(base_url=lr.url + "/v1", api_key="none", max_retries=0)
        results = await asyncio.gather(
            *(
                client.completions.with_raw_response.create(
                    model=MODEL, prompt=f"Count to {i}:", max_tokens=3
                )
                for i in range(4)
            )
        )
        assert {r.headers[POD_HEADER] for r in results} == {urls[1]}
        assert all(r.parse().choices[0].text for r in results)
        retries = lr.router.metrics.registry.get_sample_value(
            "kvpilot_router_upstream_retries_total", {"model_name": MODEL}
        )
        assert retries is not None and retries >= 1
        await client.close()
