"""`kvpilot router` as a process: its flags, a router replica killed mid-load, and pods (processes of
their own) that stop answering (SIGSTOP) before their answer or mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
        (["--endpoints", "m=http://x", "--first-byte-timeout", "0"], "--first-byte-timeout must be > 0"),
        (
            ["--endpoints", "m=http://x", "--silence-limit", "5"],
            "--silence-limit (5) must be >= --first-byte-timeout and --idle-timeout",
        ),
        (["--endpoints", "m=http://x", "--eject-after", "0"], "--eject-after must be >= 1"),
        (["--endpoints", "m=http://x", "--max-ejection-percent", "150"], "must be in 0..100, got 150"),
        (
            ["--endpoints", "m=http://x", "--ejection-max", "5"],
            "--ejection-max (5) must be >= --ejection-base (10)",
        ),
        (
            ["--endpoints", "m=http://x", "--namespace", "ml"],
            "--endpoints and --namespace exclude each other",
        ),
        ([], "--namespace is required without --endpoints"),
        (
            ["--endpoints", "m=http://x", "--max-queue-per-priority", "urgent=3"],
            "--max-queue-per-priority 'urgent=3': expected CLASS=VALUE",
        ),
        (
            ["--endpoints", "m=http://x", "--queue-timeout-per-priority", "low=0"],
            "--queue-timeout-per-priority 'low=0': expected CLASS=VALUE",
        ),
        (
            ["--endpoints", "m=http://x", "--max-queue-per-tenant", "3"],
            "--max-queue-per-tenant needs --tenant-header",
        ),
        (["--endpoints", "m=http://x", "--slo-tpot-seconds", "0"], "--slo-tpot-seconds must be > 0"),
        (["--endpoints", "m=http://x", "--slo-window", "nan"], "--slo-window must be > 0"),
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
async def router_process(pod_url: str, *extra: str) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = router_cmd(
        "--endpoints", f"m={pod_url}", "--host", "127.0.0.1", "--port", str(port), "--scrape-interval", "0",
        *extra,
    )  # fmt: skip
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


# -- a pod that stops answering (SIGSTOP) ---------------------------------------------------------

FIRST_BYTE_S, IDLE_S, PROBE_S, EJECTION_S = 1.0, 1.0, 0.5, 3.0
# a frozen pod costs a client one deadline and one health probe, then another pod answers
BOUND_S = FIRST_BYTE_S + PROBE_S + 2.5
DEADLINE_FLAGS = (
    "--policy", "round-robin", "--first-byte-timeout", str(FIRST_BYTE_S), "--idle-timeout", str(IDLE_S),
    "--probe-timeout", str(PROBE_S), "--eject-after", "2", "--ejection-base", str(EJECTION_S),
)  # fmt: skip


@contextlib.contextmanager
def pod_processes(n: int, *extra: str) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """n fake pods, each its own process (tests/router/pod_process.py): (URL, process)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pods = []
        for i in range(n):
            argv = [sys.executable, "-m", "tests.router.pod_process", "--name", f"p{i}", *extra]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
            procs.append(proc)
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline().decode() if ready else ""
            assert line.startswith("listening "), f"pod p{i} did not start: {line!r}"
            pods.append((f"http://127.0.0.1:{int(line.split()[1])}", proc))
        yield pods
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def router_metrics(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, frozenset[Any]], float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


async def ask(session: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, str, bytes, float]:
    """(status, serving pod, body, seconds taken) of one completion through the router."""
    started = time.monotonic()
    body = {"model": "m", "prompt": "x", "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as r:
        data = await r.read()
        return r.status, r.headers.get("X-Kvpilot-Pod", ""), data, time.monotonic() - started


def complete(data: bytes, stream: bool) -> bool:
    if stream:
        return data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data
    return json.loads(data)["choices"][0]["finish_reason"] == "length"


async def test_a_frozen_pod_costs_a_client_one_deadline_is_ejected_and_comes_back_resumed() -> None:
    with pod_processes(3) as pods:
        urls = [u for u, _ in pods]
        frozen_url, frozen = pods[1]
        async with (
            router_process(",".join(urls), *DEADLINE_FLAGS) as (url, _),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        ):
            assert {(await ask(session, url, False))[1] for _ in range(3)} == set(urls)  # all three serve
            os.kill(frozen.pid, signal.SIGSTOP)
            # a burst: round-robin hands the frozen pod every third request
            burst = await asyncio.gather(*(ask(session, url, i % 2 == 1) for i in range(6)))
            # then one at a time (2 failures in a row eject it)
            sequential = [await ask(session, url, i % 2 == 1) for i in range(6)]
            for i, (status, pod, data, took) in enumerate([*burst, *sequential]):
                assert status == 200 and pod != frozen_url and complete(data, i % 2 == 1), (status, pod, data)
                assert took < BOUND_S, f"request {i} took {took:.1f}s"
            m = await router_metrics(session, url)
            assert sample(m, "kvpilot_router_pod_ejections_total", model_name="m", pod=frozen_url) == 1
            assert sample(m, "kvpilot_router_ejected_pods", model_name="m") == 1
            timeouts = sample(m, "kvpilot_router_upstream_timeouts_total", model_name="m", phase="first_byte")
            assert timeouts >= 2
            assert sample(m, "kvpilot_router_upstream_retries_total", model_name="m") == timeouts
            assert sample(m, "kvpilot_router_requests_total", model_name="m", code="200") == 15

            os.kill(frozen.pid, signal.SIGCONT)
            deadline = time.monotonic() + EJECTION_S + 30
            while (await ask(session, url, False))[1] != frozen_url:  # back after its backoff
                assert time.monotonic() < deadline, "the resumed pod never came back"
                await asyncio.sleep(0.2)
            m = await router_metrics(session, url)
            assert sample(m, "kvpilot_router_ejected_pods", model_name="m") == 0


async def stream_and_freeze(
    session: aiohttp.ClientSession, url: str, by_url: dict[str, subprocess.Popen[bytes]], **extra: Any
) -> tuple[str, list[Any], float]:
    """A stream whose pod is frozen after its first event: (that pod, the events after it, the
    seconds from the freeze to the stream's end)."""
    body = {"model": "m", "prompt": "x", "stream": True, **extra}
    async with session.post(url + "/v1/completions", json=body) as r:
        first = await r.content.readuntil(b"\n\n")
        os.kill(by_url[r.headers["X-Kvpilot-Pod"]].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        rest = await r.read()  # ends: the router closes the stream
        took = time.monotonic() - frozen_at
    assert r.status == 200 and json.loads(first[len(b"data: ") :])["choices"][0]["text"]
    events = [e[len("data: ") :] for e in rest.decode().strip().split("\n\n")]
    return r.headers["X-Kvpilot-Pod"], [e if e == "[DONE]" else json.loads(e) for e in events], took


async def test_a_pod_frozen_mid_stream_ends_a_guided_stream_with_an_error_event() -> None:
    with pod_processes(2, "--chunks", "40", "--chunk-delay", "0.1") as pods:
        by_url = dict(pods)
        async with (
            router_process(",".join(by_url), *DEADLINE_FLAGS) as (url, _),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        ):
            frozen, events, took = await stream_and_freeze(session, url, by_url, guided_regex="p.*")
            assert events[-1]["error"]["code"] == "upstream_timeout"
            assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
            assert all("choices" in e for e in events[:-1]) and len(events) < 40
            assert took < IDLE_S + PROBE_S + 2.5, f"the stream took {took:.1f}s to end"
            m = await router_metrics(session, url)
            assert sample(m, "kvpilot_router_upstream_timeouts_total", model_name="m", phase="idle") == 1
            assert sample(m, "kvpilot_router_upstream_failures_total", model_name="m") == 1
            assert sample(m, "kvpilot_router_stream_migrations_total", model_name="m") == 0
            # the next request is served by the other pod
            status, pod, data, _ = await ask(session, url, True)
            assert status == 200 and pod != frozen and complete(data, True)


async def test_a_pod_frozen_mid_stream_hands_a_plain_stream_to_another_pod() -> None:
    with pod_processes(2, "--chunks", "40", "--chunk-delay", "0.1") as pods:
        by_url = dict(pods)
        async with (
            router_process(",".join(by_url), *DEADLINE_FLAGS) as (url, _),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        ):
            frozen, events, _ = await stream_and_freeze(session, url, by_url)
            (other,) = set(by_url) - {frozen}
            frozen_name, other_name = (f"p{list(by_url).index(u)}" for u in (frozen, other))
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            texts = [e["choices"][0]["text"] for e in events[:-1]]
            # the frozen pod's events, then the other pod's whole answer (a fake pod ignores the prompt)
            cut = next(i for i, t in enumerate(texts) if t.startswith(other_name))
            assert all(t.startswith(frozen_name) for t in texts[:cut])
            assert texts[cut:] == [f"{other_name}-{i} " for i in range(40)]
            assert {e["id"] for e in events[:-1]} == {"cmpl-test"}
            m = await router_metrics(session, url)
            assert sample(m, "kvpilot_router_stream_migrations_total", model_name="m") == 1
            assert sample(m, "kvpilot_router_upstream_timeouts_total", model_name="m", phase="idle") == 1
            assert sample(m, "kvpilot_router_slo_requests_total", model_name="m", outcome="failed") == 0
