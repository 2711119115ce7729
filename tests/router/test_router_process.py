"""`kvpilot router` as a process: its flags, and a router replica killed mid-load."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvpilot.net import free_port
from tests.router.upstreams import FakePod


def router_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpilot", "router", *args]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--endpoints", "m"], "--endpoints 'm': expected MODEL=URL"),
        (["--endpoints", "m=ftp://x"], "is not an http(s) URL"),
        (["--endpoints", "m=http://x", "--max-queue", "0"], "--max-queue must be >= 1"),
        (["--endpoints", "m=http://x", "--queue-timeout", "0"], "--queue-timeout must be > 0"),
        (
            ["--endpoints", "m=http://x", "--namespace", "ml"],
            "--endpoints and --namespace exclude each other",
        ),
        ([], "--namespace is required without --endpoints"),
        (["--endpoints", "m=http://x", "--fallback", "m=small"], "'small' is not a model of --endpoints"),
        (["--endpoints", "m=http://x", "--adapters", "n=sql"], "--adapters 'n=sql': 'n' is not a model"),
        (["--namespace", "ml", "--adapters", "m=sql"], "--adapters needs --endpoints"),
        (
            ["--endpoints", "m=http://x", "--fallback", "m=m"],
            "expected MODEL=OTHER with two different models",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    proc = subprocess.run(router_cmd(*args), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_unknown_policy_is_refused_by_the_parser() -> None:
    proc = subprocess.run(
        router_cmd("--endpoints", "m=http://x", "--policy", "random"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--policy" in proc.stderr


@contextlib.asynccontextmanager
async def router_process(pod_url: str) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = router_cmd(
        "--endpoints", f"m={pod_url}", "--host", "127.0.0.1", "--port", str(port), "--scrape-interval", "0"
    )
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(urllib.request.urlopen, url + "/ready", None, 1)
                break
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            await asyncio.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def stream(session: aiohttp.ClientSession, url: str, first: asyncio.Event) -> bytes:
    body = {"model": "m", "prompt": "x", "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        out = await r.content.readuntil(b"\n\n")
        first.set()
        return out + await r.read()


async def test_a_killed_router_replica_loses_only_its_own_streams() -> None:
    hold = asyncio.Event()
    pod = await FakePod("p0", hold_after_first=hold).start()
    try:
        async with (
            router_process(pod.url) as (url_a, proc_a),
            router_process(pod.url) as (url_b, _),
            aiohttp.ClientSession() as session,
        ):
            firsts = [asyncio.Event() for _ in range(6)]
            via_a = [asyncio.create_task(stream(session, url_a, firsts[i])) for i in range(3)]
            via_b = [asyncio.create_task(stream(session, url_b, firsts[3 + i])) for i in range(3)]
            for e in firsts:
                await asyncio.wait_for(e.wait(), 30)  # all 6 streams are mid-flight
            proc_a.kill()  # router replica A dies with 3 streams open
            proc_a.wait(10)
            for _ in range(300):
                if pod.cancelled == 3:
                    break
                await asyncio.sleep(0.02)
            hold.set()
            a_results = await asyncio.gather(*via_a, return_exceptions=True)
            b_results = await asyncio.gather(*via_b, return_exceptions=True)
        assert all(isinstance(r, aiohttp.ClientError) for r in a_results), a_results
        assert all(isinstance(r, bytes) and r.endswith(b"data: [DONE]\n\n") for r in b_results), b_results
        # exactly A's 3 streams were lost, and the pod saw them go (it aborts, freeing their KV)
        assert pod.cancelled == 3 and pod.finished == 3
    finally:
        await pod.stop()
