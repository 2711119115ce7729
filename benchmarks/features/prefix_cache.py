"""Prefix caching, on against off, in one run on the same engine settings.

Workloads:
- shared-system-prompt: N requests that share a long system prompt (default 1,024 tokens) with
  distinct short questions (default 32 tokens), all submitted at once.
- multi-turn: C conversations of T turns; each turn resends the whole history plus a new user message.

Reports TTFT percentiles, output-token throughput and the prefix-cache hit rate. Prints JSON.
    python benchmarks/runtime_features.py prefix-cache --requests 64 --system-tokens 1024 --question-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.sequence import Sequence


def corpus_ids(engine: LLMEngine, n: int, seed: int) -> list[int]:
    """Real English token ids: module docstrings of the standard library, shuffled by seed."""
    import importlib

    docs: list[str] = []
    for name in (
        "argparse",
        "asyncio",
        "collections",
        "dataclasses",
        "functools",
        "json",
        "logging",
        "pathlib",
        "subprocess",
        "textwrap",
        "typing",
        "unittest",
        "email",
        "http",
        "shutil",
    ):
        doc = importlib.import_module(name).__doc__
        if doc:
            docs.append(doc)
    random.Random(seed).shuffle(docs)
    ids = engine.tokenizer.encode("\n\n".join(docs))
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, outputs: list[list[int]] | None = None
) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    mono0 = time.monotonic()
    seqs: list[Sequence] = []
    for i, p in enumerate(prompts):
        rid = f"b{time.monotonic_ns()}-{i}"
        engine.add_request(rid, p, params, arrival_time=mono0)
        seqs.append(engine.requests[rid].seq)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    after = engine.stats()
    ttft = [float(s.first_token_time - s.arrival_time) for s in seqs if s.first_token_time is not None]
    out_tokens = sum(s.num_output_tokens for s in seqs)
    if outputs is not None:
        outputs.extend(s.output_token_ids for s in seqs)
    q = after.prefix_cache_queries - before.prefix_cache_queries
    h = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": round(percentile(ttft, 0.9), 4),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "wall_s": round(wall, 2),
        "prefix_hit_rate": round(h / q, 4) if q else 0.0,
    }


def shared_system_prompt(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float]:
    ids = corpus_ids(engine, args.system_tokens + args.requests * args.question_tokens, args.seed)
    system = ids[: args.system_tokens]
    rest = ids[args.system_tokens :]
    prompts = [
        system + rest[i * args.question_tokens : (i + 1) * args.question_tokens] for i in range(args.requests)
    ]
    return run_batch(engine, prompts, args.output_tokens)


def multi_turn(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float]:
    ids = corpus_ids(engine, args.conversations * args.turns * 2 * args.turn_tokens + 64, args.seed + 1)
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    pos = 0
    per_turn: list[dict[str, float]] = []
    for _ in range(args.turns):
        prompts = []
        for h in histories:
            h.extend(ids[pos : pos + args.turn_tokens])  # the new user message
            pos += args.turn_tokens
            prompts.append(list(h))
        replies: list[list[int]] = []
        per_turn.append(run_batch(engine, prompts, args.turn_tokens, replies))
        for h, reply in zip(histories, replies, strict=True):  # the reply is resent in the next turn
            h.extend(reply)
    later = per_turn[1:] or per_turn
    return {
        "ttft_p50_s_later_turns": round(statistics.median(t["ttft_p50_s"] for t in later), 4),
        "output_tokens_per_s": round(statistics.mean(t["output_tokens_per_s"] for t in per_turn), 2),
        "prefix_hit_rate_later_turns": round(statistics.mean(t["prefix_hit_rate"] for t in later), 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="shared,multi-turn", help="comma-separated: shared, multi-turn")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {}
    for caching in (False, True):
        cfg = EngineConfig(
            model=args.model,
            dtype=args.dtype,  # type: ignore[arg-type]
            threads=args.threads,
            enable_prefix_caching=caching,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=1 << 30,
        )
        engine = build_engine(cfg)
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))  # warm-up
        key = "caching_on" if caching else "caching_off"
        chosen = set(args.workloads.split(","))
        results[key] = {}
        if "shared" in chosen:
            results[key]["shared_system_prompt"] = shared_system_prompt(engine, args)
        if "multi-turn" in chosen:
            results[key]["multi_turn"] = multi_turn(engine, args)
        del engine
    off, on = results["caching_off"], results["caching_on"]
    gain: dict[str, float] = {}
    if "shared_system_prompt" in off:
        a, b = off["shared_system_prompt"], on["shared_system_prompt"]
        gain["shared_ttft_p50_x"] = round(a["ttft_p50_s"] / b["ttft_p50_s"], 2)
        gain["shared_throughput_x"] = round(b["output_tokens_per_s"] / a["output_tokens_per_s"], 2)
    if "multi_turn" in off:
        a, b = off["multi_turn"], on["multi_turn"]
        gain["multi_turn_ttft_x"] = round(a["ttft_p50_s_later_turns"] / b["ttft_p50_s_later_turns"], 2)
    results["gain"] = gain
    print(
        json.dumps(
            {
                "benchmark": "prefix_cache",
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                    "loadavg": os.getloadavg(),
                    "python": sys.version.split()[0],
                    "torch": torch.__version__,
                },
                "settings": vars(args),
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
