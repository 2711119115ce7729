"""The router's failover goals on three real `kvpilot serve` pods (SmolLM2 on the CPU):

- with one of three pods frozen, every client request completes (retried before its first byte);
- a pod killed mid-stream: the stream continues on another pod, and its greedy text is the text of an
  uninterrupted run (completions, then chat through continue_final_message).

Runs in order: the freeze first (the pod comes back), then two kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpilot.net import free_port
from kvpilot.router.discovery import StaticSource, parse_endpoints
from kvpilot.router.outlier import OutlierSettings
from kvpilot.router.server import POD_HEADER, Router, RouterSettings
from tests.router.test_real_pods import MODEL, start_pod, wait_ready
from tests.router.upstreams import LiveRouter, start_router

pytestmark = pytest.mark.slow

Pods = list[tuple[str, subprocess.Popen[bytes]]]
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}  # ignore_eos: always 40 tokens


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    logs = tmp_path_factory.mktemp("pods")
    started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for i in range(3):
            port = free_port()
            log = logs / f"pod{i}.log"
            # float32: the runtime's prefill and decode then agree on every greedy choice; with bf16
            # matmuls (auto on a bf16 CPU) a near-tie can flip where the continuation's prefill
            # recomputes what decode steps computed (docs/router.md, "Mid-stream migration")
            proc = start_pod(port, log, "--dtype", "float32")
            started.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in started:
            wait_ready(int(url.rsplit(":", 1)[1]), proc, log)
        yield [(url, proc) for url, proc, _ in started]
    finally:
        for _, proc, _ in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.asynccontextmanager
async def live(pods: Pods) -> AsyncIterator[LiveRouter]:
    settings = RouterSettings(
        policy="round-robin",
        scrape_interval_s=0,
        first_byte_timeout_s=3.0,
        idle_timeout_s=3.0,
        probe_timeout_s=1.0,
        max_retries=2,
        outliers=OutlierSettings(consecutive_failures=2, base_ejection_s=5.0),
    )
    router = Router(settings)
    urls = [url for url, proc in pods if proc.poll() is None]
    router.add_source(StaticSource(parse_endpoints([f"{MODEL}={','.join(urls)}"], capacity=2)))
    lr = await start_router(router)
    try:
        yield lr
    finally:
        await lr.runner.cleanup()


def metric(lr: LiveRouter, name: str, **labels: str) -> float:
    return lr.router.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0


def stream_text(raw: bytes, chat: bool) -> tuple[str, list[Any]]:
    events = [e[len("data: ") :] for e in raw.decode().strip().split("\n\n")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    key = "delta" if chat else None
    text = "".join(
        (c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"]
        for c in chunks
        if c["choices"]
    )
    return text, chunks


async def test_a_frozen_pod_of_three_costs_no_request(pods: Pods) -> None:
    by_url = dict(pods)
    frozen_url, frozen = pods[0]
    async with (
        live(pods) as lr,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s,
    ):
        os.kill(frozen.pid, signal.SIGSTOP)
        try:

            async def ask(i: int) -> tuple[int, str, bytes]:
                body = {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 4, "stream": i % 2 == 1}
                async with s.post(lr.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get(POD_HEADER, ""), await r.read()

            results = [await ask(i) for i in range(6)]  # round-robin: two of them go to the frozen pod first
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        for i, (status, pod, data) in enumerate(results):
            assert status == 200 and pod in by_url and pod != frozen_url, (status, pod, data)
            if i % 2:
                assert stream_text(data, chat=False)[0]
            else:
                assert json.loads(data)["choices"][0]["text"]
        assert metric(lr, "kvpilot_router_upstream_retries_total") >= 1
        assert metric(lr, "kvpilot_router_slo_requests_total", outcome="failed") == 0


async def reference(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> str:
    """The uninterrupted greedy answer, straight from a pod."""
    async with s.post(url + path, json={**body, "stream": False}) as r:
        answer = await r.json()
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


async def stream_killing_its_pod(
    lr: LiveRouter, s: aiohttp.ClientSession, by_url: dict[str, subprocess.Popen[bytes]], path: str, body: Any
) -> tuple[str, bytes]:
    """Stream through the router; after the first content event, stop its pod where it is and kill
    it. (the killed pod, the whole stream)."""
    async with s.post(lr.url + path, json={**body, "stream": True}) as r:
        assert r.status == 200
        pod = r.headers[POD_HEADER]
        head = b""
        while b'"content"' not in head and b'"text"' not in head:
            head += await r.content.readuntil(b"\n\n")
        proc = by_url[pod]
        os.kill(proc.pid, signal.SIGSTOP)  # no token after this point comes from it
        proc.kill()
        proc.wait()
        return pod, head + await r.read()


@pytest.mark.parametrize(
    ("path", "chat"),
    [("/v1/completions", False), ("/v1/chat/completions", True)],
    ids=["completions", "chat"],
)
async def test_a_pod_killed_mid_stream_hands_it_over_with_the_uninterrupted_greedy_text(
    pods: Pods, path: str, chat: bool
) -> None:
    alive = [(u, p) for u, p in pods if p.poll() is None]
    by_url = dict(alive)
    if chat:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about the history of bicycles."}],
            **GREEDY,
        }
    else:
        body = {"model": MODEL, "prompt": "The history of the bicycle began", **GREEDY}
    async with (
        live(alive) as lr,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s,
    ):
        expected = await reference(s, alive[-1][0], path, body)
        killed, raw = await stream_killing_its_pod(lr, s, by_url, path, body)
        text, chunks = stream_text(raw, chat)
        assert text == expected
        assert metric(lr, "kvpilot_router_stream_migrations_total") == 1
        assert len({c["id"] for c in chunks}) == 1  # one stream, as the client sees it
        if chat:  # one opening chunk (the role), not one per pod
            assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
        await asyncio.sleep(0.1)  # the handler judges the request after the last byte went out
        assert metric(lr, "kvpilot_router_slo_requests_total", outcome="failed") == 0
        assert killed not in [u for u, p in pods if p.poll() is None]
