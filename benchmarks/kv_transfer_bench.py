"""The KV transfer between two real pods against this machine's bulk-copy ceiling (issue 25;
docs/disaggregation.md, "Wire protocol"). Prints one JSON object.

Two real `kvpilot serve` SmolLM2 pods, `--kv-role prefill` on core 0 and `--kv-role decode` on core 1
(`--threads 1` each). For each of --repeats random token-id prompts of --tokens tokens:

1. the prefill pod runs the prompt (`max_tokens` 1, `do_remote_decode`) and pins its blocks;
2. the decode pod gets the same prompt with the answer's `kv_transfer_params` and `max_tokens` 1: it
   pulls the blocks (export -> wire -> HTTP -> checks), copies them into its pool and computes the
   last prompt tokens;
3. the decode pod gets the same prompt again, plain: its prefix cache now holds every pulled block,
   so this request computes only what step 2 computed after the import.

`transfer_s` = step 2 - step 3 (the pull, the import into the pool and everything around them, end to
end as a client sees it); `pull_s` = the decode pod's `kvpilot_kv_transfer_seconds` of step 2 (the
pull alone). Both as MB/s and ms per 1k prompt tokens, medians over the repeats.

In the same run, the ceiling: the same number of bytes copied from a process on core 0 to this one on
core 1, over a raw TCP socket (`sendall` / `recv_into`) and over HTTP (aiohttp server and client, one
body with a Content-Length, the client session the pull uses), median of --repeats each. On a loaded machine the absolute figures move;
the ratios to the ceiling are the result.

`--profile` adds where the time goes inside one process (core 1): the prefill side's export of every
layer (gather + checksum), the decode side's check of the frames, and the import into a pool laid out
as the CPU kernels store it.

    python benchmarks/kv_transfer_bench.py --tokens 4096 --repeats 5 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, also when run as a script
import harness
from fleet.router_local import cpu_info, pinned, processes, wait_ready

from kvpilot.net import free_port
from kvpilot.runtime.engine.kv_transfer.client import new_session

MODEL = "smollm2-135m-instruct"


def start_pod(procs: list[subprocess.Popen[bytes]], role: str, cpu: int, args: argparse.Namespace) -> str:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvpilot", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--threads", "1", "--kv-role", role, "--max-model-len", str(args.tokens + 64),
        "--kv-cache-dtype", args.kv_cache_dtype, "--kv-cache-memory", str(args.kv_cache_memory),
        "--kv-transfer-timeout", "60", "--log-level", "warning",
    ]  # fmt: skip
    env = os.environ | {"TQDM_DISABLE": "1"}
    proc = subprocess.Popen(argv, preexec_fn=pinned(cpu), stdout=subprocess.DEVNULL, env=env)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return url


def post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - start, out


def metric(url: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line.split("}", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


def transfers(prefill: str, decode: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.repeats + 1):  # the first one warms both pods up and is not counted
        body = {"model": MODEL, "prompt": [rng.randrange(1000, 40000) for _ in range(args.tokens)],
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        _, out = post(prefill, {**body, "kv_transfer_params": {"do_remote_decode": True}})
        params = out["kv_transfer_params"]
        assert params is not None, "the prefill pod pinned nothing (raise --kv-cache-memory)"
        seconds0 = metric(decode, "kvpilot_kv_transfer_seconds_sum")
        bytes0 = metric(decode, "kvpilot_kv_transfer_bytes_total", 'direction="received"')
        falls0 = metric(decode, "kvpilot_kv_transfer_fallbacks_total")
        t_pull, pulled = post(decode, {**body, "kv_transfer_params": params})
        pull_s = metric(decode, "kvpilot_kv_transfer_seconds_sum") - seconds0
        size = metric(decode, "kvpilot_kv_transfer_bytes_total", 'direction="received"') - bytes0
        fallbacks = metric(decode, "kvpilot_kv_transfer_fallbacks_total") - falls0
        t_cached, cached = post(decode, body)
        same = pulled["choices"][0]["text"] == cached["choices"][0]["text"]
        rows.append({"pull_s": pull_s, "transfer_s": t_pull - t_cached, "bytes": size,
                     "fallbacks": fallbacks, "same_token": same})  # fmt: skip
    rows = rows[1:]
    block_tokens = (args.tokens - 1) // params["block_size"] * params["block_size"]
    size = statistics.median(r["bytes"] for r in rows)
    out: dict[str, Any] = {"block_tokens": block_tokens, "bytes": int(size),
                           "bytes_per_token": round(size / block_tokens) if block_tokens else None,
                           "fallbacks": sum(r["fallbacks"] for r in rows),
                           "first_token_same_as_cached": all(r["same_token"] for r in rows)}  # fmt: skip
    for key in ("pull_s", "transfer_s"):
        s = statistics.median(r[key] for r in rows)
        out[key.removesuffix("_s")] = {"seconds": round(s, 4), "mb_s": round(size / s / 1e6, 1) if s > 0 else None,
                                       "ms_per_1k_tokens": round(s * 1e6 / block_tokens, 2)}  # fmt: skip
    return out


# -- the ceiling: the same bytes, core 0 -> core 1 -------------------------------------------------


def _socket_server(sock: socket.socket, size: int, repeats: int, cpu: int) -> None:
    if pinned(cpu):
        os.sched_setaffinity(0, {cpu})
    data = bytes(size)
    for _ in range(repeats):
        conn, _ = sock.accept()
        with conn:
            conn.sendall(data)


def _http_server(port: int, size: int, cpu: int) -> None:
    from aiohttp import web

    if pinned(cpu):
        os.sched_setaffinity(0, {cpu})
    data = bytes(size)

    async def get(_: web.Request) -> web.Response:
        return web.Response(body=data, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/bytes", get)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


def socket_copy(size: int, repeats: int) -> list[float]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.Process(target=_socket_server, args=(sock, size, repeats, 0), daemon=True)
    server.start()
    buf = memoryview(bytearray(size))
    times = []
    for _ in range(repeats):
        with socket.create_connection(sock.getsockname(), timeout=60) as c:
            start, got = time.perf_counter(), 0
            while got < size:
                n = c.recv_into(buf[got:])
                if not n:
                    raise RuntimeError("the bulk-copy server closed early")
                got += n
            times.append(time.perf_counter() - start)
    server.join(10)
    sock.close()
    return times


async def _http_reads(url: str, size: int, repeats: int) -> list[float]:
    times = []
    async with new_session() as session:  # the pull's own settings
        for _ in range(repeats + 1):
            start = time.perf_counter()
            async with asyncio.timeout(60), session.get(url) as resp:
                body = await resp.read()
            assert len(body) == size
            times.append(time.perf_counter() - start)
    return times[1:]  # the first opens the connection


def http_copy(size: int, repeats: int) -> list[float]:
    port = free_port()
    server = multiprocessing.Process(target=_http_server, args=(port, size, 0), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        return asyncio.run(_http_reads(f"http://127.0.0.1:{port}/bytes", size, repeats))
    finally:
        server.terminate()
        server.join(10)


def ceiling(size: int, repeats: int, block_tokens: int) -> dict[str, Any]:
    out = {}
    for name, times in (
        ("raw_socket", socket_copy(size, repeats)),
        ("http_aiohttp", http_copy(size, repeats)),
    ):
        s = statistics.median(times)
        out[name] = {"seconds": round(s, 4), "mb_s": round(size / s / 1e6, 1),
                     "ms_per_1k_tokens": round(s * 1e6 / block_tokens, 2)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens per transfer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="auto", help="both pods' --kv-cache-dtype")
    ap.add_argument("--kv-cache-memory", default="2GiB", help="both pods' --kv-cache-memory")
    ap.add_argument("--profile", action="store_true", help="also time the transfer's parts in this process")
    ap.add_argument("--seed", type=int, default=0)
    harness.add_output_arg(ap)
    args = ap.parse_args(argv)
    if pinned(1):
        os.sched_setaffinity(0, {1})  # the client side of every copy runs where the decode pod does
    doc: dict[str, Any] = {"benchmark": "kv_transfer_bench", "machine": cpu_info(),
                           "settings": {k: v for k, v in vars(args).items() if k != "output"} | {"model": MODEL}}  # fmt: skip
    with processes() as procs:
        prefill, decode = start_pod(procs, "prefill", 0, args), start_pod(procs, "decode", 1, args)
        doc["transfer"] = tr = transfers(prefill, decode, args)
    doc["ceiling"] = ceil = ceiling(tr["bytes"], args.repeats, tr["block_tokens"])
    for key in ("pull", "transfer"):
        doc[f"{key}_vs_http_ceiling"] = round(ceil["http_aiohttp"]["seconds"] / tr[key]["seconds"], 3)
        doc[f"{key}_vs_socket_ceiling"] = round(ceil["raw_socket"]["seconds"] / tr[key]["seconds"], 3)
    if args.profile:
        from micro.kv_transfer_parts import profile

        doc["profile"] = profile(args.kv_cache_dtype, tr["block_tokens"], args.repeats)
    doc["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 1)
    harness.emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
