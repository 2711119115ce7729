"""P/D through the router with real `kvpilot serve` pods (SmolLM2 on the CPU): a `--kv-role prefill`
and a `--kv-role decode` pod behind the router give the greedy output of an aggregated pod, the decode
pod pulls the prompt's KV from the prefill pod, and a prefill pod killed while it holds a request
leaves the answer to the decode pod (counted)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvpilot.net import free_port
from kvpilot.router.discovery import StaticSource
from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint
from kvpilot.router.server import POD_HEADER, Router, RouterSettings
from tests.router.test_real_pods import MODEL, metric_value, start_pod, wait_ready
from tests.router.test_server import until
from tests.router.upstreams import LiveRouter, start_router

pytestmark = pytest.mark.slow

ROLES = ("prefill", "decode", "both")
SYSTEM = "You are a careful assistant for a hardware store. Answer briefly and politely. " * 4


@pytest.fixture(scope="module")
def pods(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[int, subprocess.Popen[bytes]]]]:
    """One pod of each role (float32: prefill and decode round alike, so greedy output matches)."""
    logs = tmp_path_factory.mktemp("pd-pods")
    started: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        for role in ROLES:
            port = free_port()
            started[role] = (
                port,
                start_pod(port, logs / f"{role}.log", "--kv-role", role, "--dtype", "float32"),
            )
        for role, (port, proc) in started.items():
            wait_ready(port, proc, logs / f"{role}.log")
        yield started
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in started.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


async def start(pods: dict[str, tuple[int, subprocess.Popen[bytes]]]) -> LiveRouter:
    endpoints = [
        Endpoint("prefill", url(pods["prefill"][0]), 2, "prefill"),
        Endpoint("decode", url(pods["decode"][0]), 2, "decode"),
    ]
    router = Router(RouterSettings(scrape_interval_s=0))
    pd = PdSettings(min_prompt_tokens=32, transfer_timeout_s=60)
    router.add_source(StaticSource({MODEL: endpoints}, disaggregation={MODEL: pd}))
    lr = await start_router(router)
    await until(lambda: router.synced)
    return lr


async def stream(base: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """A streamed greedy request: its text and the pod that served it."""
    async with aiohttp.ClientSession() as s, s.post(base + path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        text: list[str] = []
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices") or ():
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(text), r.headers.get(POD_HEADER)


def paths(lr: LiveRouter) -> dict[str, float]:
    get = lr.router.metrics.registry.get_sample_value
    return {
        p: get("kvpilot_router_pd_requests_total", {"model_name": MODEL, "path": p}) or 0.0
        for p in ("disaggregated", "direct", "prefill_failed")
    }


CHAT = {
    "model": MODEL,
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell hammers?"}],
    "max_tokens": 12,
    "temperature": 0,
}
COMPLETION = {
    "model": MODEL,
    "prompt": SYSTEM + "Q: Do you sell nails?\nA:",
    "max_tokens": 12,
    "temperature": 0,
}


async def test_disaggregated_greedy_output_is_the_aggregated_pods(
    pods: dict[str, tuple[int, subprocess.Popen[bytes]]],
) -> None:
    aggregated = url(pods["both"][0])
    lr = await start(pods)
    try:
        structured = {
            **CHAT,
            "response_format": {"type": "json_object"},
        }  # the grammar runs on the decode pod
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", COMPLETION),
            ("/v1/chat/completions", structured),
        ):
            expected, _ = await stream(aggregated, path, body)
            got, pod = await stream(lr.url, path, body)
            assert got == expected and expected and pod == "decode"
        assert paths(lr) == {"disaggregated": 3, "direct": 0, "prefill_failed": 0}
        # the decode pod pulled the prompts' KV from the prefill pod, and used it
        decode_port = pods["decode"][0]
        assert metric_value(decode_port, "kvpilot_kv_transfer_bytes_total") > 0
        assert metric_value(decode_port, "kvpilot_kv_transfer_fallbacks_total") == 0
    finally:
        await lr.runner.cleanup()


async def test_a_prefill_pod_killed_while_it_holds_the_request_leaves_the_answer_to_the_decode_pod(
    pods: dict[str, tuple[int, subprocess.Popen[bytes]]],
) -> None:
    """Runs last: it kills the prefill pod. The pod is frozen first, so the prefill request the router
    sends (its connection accepted by the frozen pod's kernel) is unanswered when the pod dies and its
    connection resets; a kill before the request left would be a refused connection: the same path."""
    expected, _ = await stream(url(pods["both"][0]), "/v1/completions", COMPLETION)
    lr = await start(pods)
    _, prefill = pods["prefill"]
    try:
        prefill.send_signal(signal.SIGSTOP)
        request = asyncio.create_task(stream(lr.url, "/v1/completions", COMPLETION))
        await until(lambda: lr.router.prefill_pools[MODEL].in_flight == 1, timeout=30)
        prefill.kill()
        prefill.wait()
        got, pod = await asyncio.wait_for(request, 120)
        assert got == expected and pod == "decode"
        assert paths(lr) == {"disaggregated": 0, "direct": 0, "prefill_failed": 1}
    finally:
        await lr.runner.cleanup()
