"""The router's own cost of P/D orchestration. Prints one JSON object.

Two fake pods (real aiohttp servers: a streamed completion of CHUNKS canned events, and a prefill
answer with `kv_transfer_params` at once, pinned to one CPU) and `kvpilot router` (its own process,
pinned to the other CPU). One run measures side by side, sequentially and in a closed loop: the pod
directly, the router with the model aggregated (one pod), and the router with the model disaggregated
(`--prefill-endpoints`, `--pd-min-prompt-tokens 0`: every request takes the prefill leg, then the
decode leg). The difference between the last two is what the second leg costs the router (latency,
CPU per request); the pods answer at once, so no model time hides it.

    python benchmarks/router_bench.py pd --requests 400 --seconds 5 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, also when run as a script
from fleet.router_local import (
    CHUNKS,
    closed_loop,
    cpu_info,
    cpu_seconds,
    fake_pod_main,
    pct,
    pinned,
    processes,
    sequential,
    start_router,
    wait_ready,
)
from kvpilot.net import free_port


def figures(
    router: subprocess.Popen[bytes], url: str, args: argparse.Namespace, payload: bytes
) -> dict[str, Any]:
    latencies = asyncio.run(sequential(url, args.requests, payload))
    cpu0 = cpu_seconds(router.pid)
    t0 = time.perf_counter()
    n = asyncio.run(closed_loop(url, args.seconds, args.concurrency, payload))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(router.pid) - cpu0
    return {
        "sequential_ms": {
            "p50": round(pct(latencies, 50) * 1000, 3),
            "p99": round(pct(latencies, 99) * 1000, 3),
        },
        "closed_loop_rps": round(n / wall, 1),
        "router_cpu_ms_per_request": round(cpu / n * 1000, 3) if n else None,
    }


def pd_overhead(args: argparse.Namespace) -> dict[str, Any]:
    payload = json.dumps(
        {"model": "m", "prompt": "hello " * 50, "max_tokens": CHUNKS, "stream": True}
    ).encode()
    out: dict[str, Any] = {}
    with processes() as procs:
        urls = []
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, __file__, "_fake_pod", "--port", str(port)], preexec_fn=pinned(1)
            )
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            wait_ready(urls[-1], proc)
        decode, prefill = urls
        aggregated_url = start_router(procs, f"m={decode}", "round-robin", cpu=0)
        aggregated = procs[-1]
        pd_url = start_router(
            procs,
            f"m={decode}",
            "round-robin",
            cpu=0,
            extra=("--prefill-endpoints", f"m={prefill}", "--pd-min-prompt-tokens", "0"),
        )
        disaggregated = procs[-1]
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, {1})  # the client shares the fake pods' CPU, not the router's
        direct = asyncio.run(sequential(decode, args.requests, payload))
        out["direct_ms"] = {"p50": round(pct(direct, 50) * 1000, 3), "p99": round(pct(direct, 99) * 1000, 3)}
        out["aggregated"] = figures(aggregated, aggregated_url, args, payload)
        out["disaggregated"] = figures(disaggregated, pd_url, args, payload)
        aggregated.terminate()
    agg, pd = out["aggregated"], out["disaggregated"]
    out["prefill_leg_added_ms_p50"] = round(pd["sequential_ms"]["p50"] - agg["sequential_ms"]["p50"], 3)
    if agg["router_cpu_ms_per_request"] and pd["router_cpu_ms_per_request"]:
        out["router_cpu_ratio_disaggregated_vs_aggregated"] = round(
            pd["router_cpu_ms_per_request"] / agg["router_cpu_ms_per_request"], 2
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="sequential requests per setting")
    p.add_argument("--seconds", type=float, default=5.0, help="closed loop per setting")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)  # the fake pods' own processes
    p.add_argument("role", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "_fake_pod":
        fake_pod_main(args.port)
        return
    result = {"benchmark": "router-pd-overhead", "machine": cpu_info(), "sse_chunks_per_request": CHUNKS}
    result.update(pd_overhead(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
