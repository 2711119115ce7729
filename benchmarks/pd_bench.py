"""Prefill/decode disaggregation on this CPU (issue 25's first goal; docs/disaggregation.md). Prints one
JSON object.

Two fleets of two real `kvpilot serve` SmolLM2 pods, each pod on its own core with `--threads 1`, each
behind `kvpilot router`, run one after the other under the same open-loop load: long prompts (token-id
prompts of --long-tokens, 16 output tokens) every --long-every seconds and short chat requests (64
output tokens) every --chat-every seconds, for --duration seconds, every request streamed.

- aggregated: 2 pods (`--kv-role both`), the router's least-loaded policy;
- disaggregated: 1 `--kv-role prefill` + 1 `--kv-role decode` pod, the router orchestrating
  (`--prefill-endpoints`, `--pd-min-prompt-tokens`: the chats go straight to the decode pod, the long
  prompts take the prefill leg and the KV transfer).

Reported: decode TPOT (per request: (last token - first token) / (tokens - 1)) p50/p99 of the chat
requests and of all, TTFT p50/p99, the ratios aggregated / disaggregated, greedy equality (fixed
probe requests, temperature 0, through both fleets after the load), and the KV transfer's cost from
the decode pod's metrics (seconds per pull, per 1k prompt tokens, bytes).

    python benchmarks/pd_bench.py --duration 90 --output pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, also when run as a script
import harness
from fleet.router_local import cpu_info, pct, pinned, processes, start_router, wait_ready

from kvpilot.net import free_port

MODEL = "smollm2-135m-instruct"
TOPICS = ["rivers", "volcanoes", "bridges", "owls", "comets", "glaciers", "violins", "deserts"]


def start_pod(procs: list[subprocess.Popen[bytes]], role: str, cpu: int, args: argparse.Namespace) -> str:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvpilot", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--threads", "1", "--kv-role", role, "--max-model-len", str(args.long_tokens + 512),
        "--kv-transfer-timeout", str(args.transfer_timeout), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, preexec_fn=pinned(cpu), stdout=subprocess.DEVNULL)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return url


def long_body(rng: random.Random, tokens: int, max_tokens: int = 16) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [rng.randrange(1000, 40000) for _ in range(tokens)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def chat_body(i: int, max_tokens: int = 64) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Request {i}: tell me three facts about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one(session: aiohttp.ClientSession, url: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    start = time.monotonic()
    times: list[float] = []
    text: list[str] = []
    async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
        if resp.status != 200:
            return {"kind": kind, "error": resp.status, "body": (await resp.text())[:300]}
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece:
                times.append(time.monotonic())
                text.append(piece)
    out: dict[str, Any] = {"kind": kind, "text": "".join(text), "ttft": times[0] - start if times else None}
    if len(times) > 1:
        out["tpot"] = (times[-1] - times[0]) / (len(times) - 1)
    return out


async def load(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The open-loop load: arrivals on a fixed schedule, whatever the answers' pace."""
    rng = random.Random(args.seed)
    schedule: list[tuple[float, str, dict[str, Any]]] = []
    t, i = 0.0, 0
    while t < args.duration:
        schedule.append((t, "long", long_body(rng, args.long_tokens)))
        t += args.long_every
    t = args.chat_every / 2
    while t < args.duration:
        schedule.append((t, "chat", chat_body(i)))
        t, i = t + args.chat_every, i + 1
    schedule.sort(key=lambda x: x[0])
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        tasks = []
        for at, kind, body in schedule:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, url, kind, body)))
        return list(await asyncio.gather(*tasks))


async def probes(url: str, args: argparse.Namespace) -> list[str]:
    """Fixed greedy requests (one long, two chats), one at a time: their texts are compared across fleets."""
    rng = random.Random(args.seed + 1)
    bodies = [long_body(rng, args.long_tokens, 32), chat_body(1001, 32), chat_body(1002, 32)]
    async with aiohttp.ClientSession() as session:
        return [str((await one(session, url, "probe", b))["text"]) for b in bodies]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f",{v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = out.get(key, 0.0) + s.value
    return out


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r and r.get("ttft") is not None]

    def ms(values: list[float], q: float) -> float | None:
        return round(pct(values, q) * 1000, 1) if values else None

    out: dict[str, Any] = {"requests": len(results), "errors": len(results) - len(ok)}
    statuses = [str(r.get("error")) for r in results if "error" in r]
    out["error_statuses"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    out["error_examples"] = {str(r["error"]): r.get("body") for r in results if "error" in r}
    for name, rows in (
        ("chat", [r for r in ok if r["kind"] == "chat"]),
        ("long", [r for r in ok if r["kind"] == "long"]),
        ("all", ok),
    ):
        tpot = [r["tpot"] for r in rows if "tpot" in r]
        ttft = [r["ttft"] for r in rows]
        out[name] = {
            "n": len(rows),
            "tpot_ms": {"p50": ms(tpot, 50), "p99": ms(tpot, 99)},
            "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
        }
    return out


def run_fleet(disaggregated: bool, args: argparse.Namespace) -> dict[str, Any]:
    with processes() as procs:
        if disaggregated:
            prefill, decode = start_pod(procs, "prefill", 0, args), start_pod(procs, "decode", 1, args)
            extra = ["--prefill-endpoints", f"{MODEL}={prefill}", "--pd-min-prompt-tokens", str(args.min_prompt_tokens),
                     "--pd-transfer-timeout", str(args.transfer_timeout)]  # fmt: skip
            router = start_router(procs, f"{MODEL}={decode}", "least-loaded", extra=extra)
            pods = [prefill, decode]
        else:
            pods = [start_pod(procs, "both", cpu, args) for cpu in (0, 1)]
            router = start_router(procs, f"{MODEL}={','.join(pods)}", "least-loaded")
        asyncio.run(probes(router, args))  # warm-up: the kernels, the first allocations
        before = [scrape(p) for p in pods]
        started = time.monotonic()
        results = asyncio.run(load(router, args))
        wall = time.monotonic() - started
        after = [scrape(p) for p in pods]
        texts = asyncio.run(probes(router, args))
        doc = figures(results) | {"wall_s": round(wall, 1), "probe_texts": texts}
        if disaggregated:
            doc["kv_transfer"] = transfer_figures(before[1], after[1], before[0], after[0])
            doc["router_pd_requests"] = {
                k.split(",", 1)[1]: v
                for k, v in scrape(router).items()
                if k.startswith("kvpilot_router_pd_requests_total,")
            }
        return doc


def transfer_figures(
    d0: dict[str, float], d1: dict[str, float], p0: dict[str, float], p1: dict[str, float]
) -> dict[str, Any]:
    def delta(a: dict[str, float], b: dict[str, float], key: str) -> float:
        return b.get(key, 0.0) - a.get(key, 0.0)

    pulls = delta(d0, d1, "kvpilot_kv_transfer_seconds_count")
    seconds = delta(d0, d1, "kvpilot_kv_transfer_seconds_sum")
    received = delta(d0, d1, "kvpilot_kv_transfer_bytes_total,received")
    fallbacks = {
        k.split(",", 1)[1]: delta(d0, d1, k)
        for k in d1
        if k.startswith("kvpilot_kv_transfer_fallbacks_total,") and delta(d0, d1, k)
    }
    return {"pulls": pulls, "bytes_received": received, "bytes_sent": delta(p0, p1, "kvpilot_kv_transfer_bytes_total,sent"),
            "seconds_per_pull": round(seconds / pulls, 4) if pulls else None, "seconds_total": round(seconds, 3),
            "fallbacks": fallbacks}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load per fleet")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--long-every", type=float, default=15.0, help="seconds between long prompts")
    ap.add_argument("--chat-every", type=float, default=1.5, help="seconds between chat requests")
    ap.add_argument("--min-prompt-tokens", type=int, default=512, help="the router's --pd-min-prompt-tokens")
    ap.add_argument("--transfer-timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    harness.add_output_arg(ap)
    args = ap.parse_args(argv)
    machine = cpu_info()
    agg = run_fleet(False, args)
    pd = run_fleet(True, args)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    tr = pd["kv_transfer"]
    block_tokens = (args.long_tokens - 1) // 16 * 16
    doc = {
        "benchmark": "pd_bench",
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "output"}
        | {"model": MODEL, "threads_per_pod": 1, "orchestrated_by": "kvpilot router"},
        "aggregated": agg,
        "disaggregated": pd,
        "decode_tpot_p99_ratio_chat": ratio(agg["chat"]["tpot_ms"]["p99"], pd["chat"]["tpot_ms"]["p99"]),
        "decode_tpot_p99_ratio_all": ratio(agg["all"]["tpot_ms"]["p99"], pd["all"]["tpot_ms"]["p99"]),
        "ttft_p50_ratio_all": ratio(pd["all"]["ttft_ms"]["p50"], agg["all"]["ttft_ms"]["p50"]),
        "ttft_p50_ratio_long": ratio(pd["long"]["ttft_ms"]["p50"], agg["long"]["ttft_ms"]["p50"]),
        "greedy_identical": agg["probe_texts"] == pd["probe_texts"],
        "transfer_ms_per_1k_prompt_tokens": round(tr["seconds_per_pull"] * 1000 / (block_tokens / 1000), 1)
        if tr["seconds_per_pull"]
        else None,
        "transfer_bytes_per_token": round(tr["bytes_received"] / (tr["pulls"] * block_tokens))
        if tr["pulls"]
        else None,
    }
    harness.emit(doc, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
