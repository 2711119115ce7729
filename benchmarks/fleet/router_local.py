"""The router's cost and what its policies buy. Prints one JSON object.

overhead: a fake pod (a real aiohttp server returning canned SSE, pinned to one CPU) behind
  `kvpilot router` (its own process, pinned to the other CPU). Sequential requests, directly and
  through the router, give the added latency (p50/p99 of the whole streamed request); a closed loop of
  concurrent clients gives proxied requests/s and the router's CPU seconds per request (from
  /proc/PID/stat), so requests per router core-second does not depend on what else shares the machine.

prefix: 3 real `kvpilot serve` SmolLM2 processes behind the router, a multi-turn chat workload with
  shared system prompts (conversations of T turns, each turn resends the history), one run per policy
  with a fresh salt so no run reuses another's cache. Reports each policy's prefix-cache hit rate
  (from the pods' kvpilot_prefix_cache_hits_total / queries, tokens) and TTFT p50/p99, against
  round-robin.

    python benchmarks/router_bench.py overhead --requests 400 --seconds 5 --concurrency 32
    python benchmarks/router_bench.py prefix --conversations 12 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from kvpilot.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, also when run as a script
import harness

MODEL = "smollm2-135m-instruct"


def cpu_info() -> dict[str, Any]:
    """harness.machine() and the 1-minute load average (a shared machine: every hop's wake-up waits
    behind this many runnable processes)."""
    return harness.machine() | {"load_average_1m": round(os.getloadavg()[0], 1)}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/ready", timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout}s")


def pinned(cpu: int | None) -> Any:
    if cpu is None or not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) <= cpu:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def start_router(
    procs: list[subprocess.Popen[bytes]],
    endpoints: str,
    policy: str,
    cpu: int | None = None,
    extra: Sequence[str] = (),
    pod_capacity: int = 4,
) -> str:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvpilot", "router", "--endpoints", endpoints, "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--pod-capacity", str(pod_capacity),
        "--max-queue", "100000", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, preexec_fn=pinned(cpu), stdout=subprocess.DEVNULL)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return url


pct = harness.nearest_rank


def prefix_figures(
    ttfts: list[float], hits: float, queries: float, wall: float, per_pod: dict[str, int]
) -> dict[str, Any]:
    """One policy's row of the prefix workload: hit rate, TTFT p50/p99, wall time, requests per pod."""
    return {
        "requests": len(ttfts),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_ms": {"p50": round(pct(ttfts, 50) * 1000, 1), "p99": round(pct(ttfts, 99) * 1000, 1)},
        "wall_s": round(wall, 1),
        "requests_per_pod": dict(sorted(per_pod.items())),
    }


def compare_to_round_robin(results: dict[str, dict[str, Any]]) -> None:
    """Add each policy's hit-rate ratio and TTFT p50 speedup against the round-robin row, if there is one."""
    base = results.get("round-robin")
    if not base:
        return
    for r in results.values():
        if r["prefix_cache_hit_rate"] and base["prefix_cache_hit_rate"]:
            r["hit_rate_vs_round_robin"] = round(
                r["prefix_cache_hit_rate"] / base["prefix_cache_hit_rate"], 2
            )
        r["ttft_p50_speedup_vs_round_robin"] = round(base["ttft_ms"]["p50"] / r["ttft_ms"]["p50"], 2)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- overhead ---------------------------------------------------------------------------------------

CHUNKS = 8


def fake_pod_main(port: int) -> None:
    """A pod that answers every completion with CHUNKS canned SSE events at once, and a P/D prefill
    request (kv_transfer_params.do_remote_decode) with its transfer params, as a prefill pod does."""
    from aiohttp import web

    event = {"id": "c", "object": "text_completion", "model": "m"}
    chunk = json.dumps({**event, "choices": [{"index": 0, "text": "tok ", "finish_reason": None}]}).encode()
    body = b"".join(b"data: " + chunk + b"\n\n" for _ in range(CHUNKS)) + b"data: [DONE]\n\n"
    params = {"do_remote_prefill": True, "transfer_id": "t", "num_tokens": 1, "block_size": 16}
    prefilled = {**event, "choices": [{"index": 0, "text": "tok", "finish_reason": "length"}]}
    answer = json.dumps({**prefilled, "kv_transfer_params": params}).encode()

    async def handle(request: web.Request) -> web.StreamResponse:
        sent = await request.read()
        if b'"do_remote_decode"' in sent and json.loads(sent).get("kv_transfer_params", {}).get(
            "do_remote_decode"
        ):
            return web.Response(body=answer, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes(
        [web.post("/v1/completions", handle), web.get("/ready", ready), web.get("/metrics", ready)]
    )
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def one(session: aiohttp.ClientSession, url: str, payload: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(
        url + "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
    ) as r:
        data = await r.read()
        if r.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"bad answer {r.status}: {data[:200]!r}")
    return time.perf_counter() - t0


async def sequential(url: str, n: int, payload: bytes) -> list[float]:
    async with aiohttp.ClientSession() as s:
        for _ in range(20):  # warm the connections
            await one(s, url, payload)
        return [await one(s, url, payload) for _ in range(n)]


async def closed_loop(url: str, seconds: float, concurrency: int, payload: bytes) -> int:
    done = 0
    end = time.perf_counter() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < end:
            await one(s, url, payload)
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return done


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    payload = json.dumps(
        {"model": "m", "prompt": "hello " * 50, "max_tokens": CHUNKS, "stream": True}
    ).encode()
    with processes() as procs:
        pod_port = free_port()
        pod = subprocess.Popen(
            [sys.executable, __file__, "_fake_pod", "--port", str(pod_port)], preexec_fn=pinned(1)
        )
        procs.append(pod)
        pod_url = f"http://127.0.0.1:{pod_port}"
        wait_ready(pod_url, pod)
        router_url = start_router(procs, f"m={pod_url}", "round-robin", cpu=0)
        router = procs[-1]
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, {1})  # the client shares the fake pod's CPU, not the router's
        direct = asyncio.run(sequential(pod_url, args.requests, payload))
        proxied = asyncio.run(sequential(router_url, args.requests, payload))
        cpu0 = cpu_seconds(router.pid)
        t0 = time.perf_counter()
        n = asyncio.run(closed_loop(router_url, args.seconds, args.concurrency, payload))
        wall = time.perf_counter() - t0
        router_cpu = cpu_seconds(router.pid) - cpu0
        direct_n = asyncio.run(closed_loop(pod_url, args.seconds, args.concurrency, payload))
    ms = 1000.0
    return {
        "requests_sequential": args.requests,
        "sse_chunks_per_request": CHUNKS,
        "direct_ms": {"p50": pct(direct, 50) * ms, "p99": pct(direct, 99) * ms},
        "router_ms": {"p50": pct(proxied, 50) * ms, "p99": pct(proxied, 99) * ms},
        "added_ms": {
            "p50": (pct(proxied, 50) - pct(direct, 50)) * ms,
            "p99": (pct(proxied, 99) - pct(direct, 99)) * ms,
        },
        "closed_loop": {
            "concurrency": args.concurrency,
            "seconds": round(wall, 2),
            "proxied_requests": n,
            "proxied_rps": round(n / wall, 1),
            "direct_rps": round(direct_n / args.seconds, 1),
            "router_cpu_seconds": round(router_cpu, 2),
            "router_cpu_ms_per_request": round(router_cpu / n * ms, 3) if n else None,
            "proxied_rps_per_router_core": round(n / router_cpu, 1) if router_cpu else None,
        },
    }


# -- prefix-cache workload ----------------------------------------------------------------------------

TOPICS = [
    "a hardware store that sells tools, paint, lumber and garden supplies",
    "a travel agency booking trains, flights and hotels across Europe",
    "a bank's customer service desk for savings accounts and card payments",
    "a public library lending books, films and music, with reading rooms",
    "a bicycle repair shop that also rents city bikes and e-bikes",
    "a university admissions office answering questions about courses",
]


def system_prompt(topic: str, salt: str, repeat: int = 6) -> str:
    rules = (
        "Answer in one short sentence. Be polite and precise. If you do not know, say so. "
        "Never invent prices, opening hours or policies. Refer complex cases to a human colleague. "
        "Use plain words and avoid jargon. Keep personal data private. "
    )
    return f"[{salt}] You are the assistant of {topic}. " + rules * repeat


QUESTIONS = [
    "What are your opening hours?",
    "Can I pay by card?",
    "Do you have a loyalty program?",
    "How do I contact a person?",
    "Is there parking nearby?",
    "Can I change my booking?",
]


def prom_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def chat_turn(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    session_id: str | None,
) -> tuple[float, str, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"X-Session-ID": session_id} if session_id else {}
    t0 = time.perf_counter()
    ttft: float | None = None
    text = []
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        pod = r.headers.get("X-Kvpilot-Pod", "")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), pod


async def conversations(
    url: str,
    n_conv: int,
    turns: int,
    max_tokens: int,
    salt: str,
    concurrency: int,
    use_session: bool,
    system_repeat: int,
) -> tuple[list[float], dict[str, int]]:
    rng = random.Random(7)
    convs = [(i, TOPICS[i % len(TOPICS)]) for i in range(n_conv)]
    ttfts: list[float] = []
    per_pod: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)

    async def run_conv(i: int, topic: str, s: aiohttp.ClientSession) -> None:
        messages = [{"role": "system", "content": system_prompt(topic, salt, system_repeat)}]
        questions = rng.sample(QUESTIONS, turns)
        for q in questions:
            messages.append({"role": "user", "content": q})
            async with sem:
                ttft, answer, pod = await chat_turn(
                    s, url, messages, max_tokens, f"{salt}-{i}" if use_session else None
                )
            ttfts.append(ttft)
            per_pod[pod] = per_pod.get(pod, 0) + 1
            messages.append({"role": "assistant", "content": answer})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(run_conv(i, t, s) for i, t in convs))
    return ttfts, per_pod


def prefix(args: argparse.Namespace) -> dict[str, Any]:
    policies = args.policies.split(",")
    results: dict[str, Any] = {}
    with processes() as procs:
        pods = []
        for _ in range(args.pods):
            port = free_port()
            argv = [
                sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--device", "cpu", "--threads", "1", "--max-num-seqs", "4",
                "--kv-cache-memory", args.kv_cache_memory, "--enable-prefix-caching", "--log-level", "warning",
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
            pods.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(pods, procs, strict=True):
            wait_ready(url, proc)
        for policy in policies:
            router_url = start_router(procs, f"{MODEL}={','.join(pods)}", policy)
            hits0 = sum(prom_sum(p, "kvpilot_prefix_cache_hits_total") for p in pods)
            queries0 = sum(prom_sum(p, "kvpilot_prefix_cache_queries_total") for p in pods)
            t0 = time.perf_counter()
            ttfts, per_pod = asyncio.run(
                conversations(
                    router_url, args.conversations, args.turns, args.max_tokens, f"run-{policy}",
                    args.concurrency, args.session, args.system_repeat,
                )
            )  # fmt: skip
            wall = time.perf_counter() - t0
            hits = sum(prom_sum(p, "kvpilot_prefix_cache_hits_total") for p in pods) - hits0
            queries = sum(prom_sum(p, "kvpilot_prefix_cache_queries_total") for p in pods) - queries0
            router = procs.pop()
            router.terminate()
            router.wait(30)
            results[policy] = prefix_figures(ttfts, hits, queries, wall, per_pod)
    compare_to_round_robin(results)
    return {
        "pods": args.pods,
        "conversations": args.conversations,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "session_header": args.session,
        "kv_cache_memory": args.kv_cache_memory,
        "system_prompt_chars": len(system_prompt(TOPICS[0], "run-x", args.system_repeat)),
        "policies": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=400)
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--concurrency", type=int, default=32)
    f = sub.add_parser("prefix")
    f.add_argument("--pods", type=int, default=3)
    f.add_argument("--conversations", type=int, default=12)
    f.add_argument("--turns", type=int, default=3)
    f.add_argument("--max-tokens", type=int, default=4)
    f.add_argument("--concurrency", type=int, default=3)
    f.add_argument(
        "--kv-cache-memory", default="24MiB", help="per pod: small, so a pod cannot cache every prefix"
    )
    f.add_argument("--system-repeat", type=int, default=6, help="system prompt length (x 230 characters)")
    f.add_argument("--session", action="store_true", help="send X-Session-ID per conversation")
    f.add_argument("--policies", default="round-robin,least-loaded,prefix-affinity,kv-aware")
    fp = sub.add_parser("_fake_pod")
    fp.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    if args.what == "_fake_pod":
        fake_pod_main(args.port)
        return
    out: dict[str, Any] = {"benchmark": f"router-{args.what}", "machine": cpu_info()}
    out.update(overhead(args) if args.what == "overhead" else prefix(args))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
