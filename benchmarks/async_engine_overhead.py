#!/usr/bin/env python
"""What the server's engine thread costs: the same batch through the in-process `LLMEngine` and
through `AsyncEngine` (what `kvpilot serve` runs, without HTTP), alternating, in fresh processes.

    python benchmarks/async_engine_overhead.py                       # offline, then async; twice
    python benchmarks/async_engine_overhead.py --load own-thread,executor   # both loads, alternating

`--load own-thread` loads the model as `kvpilot serve` does (`lifecycle.in_own_thread`: a thread that
ends with the load); `--load executor` as it did before (asyncio.to_thread), which keeps that thread's
OpenMP team alive beside the engine thread's (docs/runtime.md, "How it works"). The workload is
runtime_vs_peers.py's batch (benchmarks/workload.py, 128 requests, seed 0). Prints JSON: output
tokens/s per run, each async mode's best over the offline best, and per run the machine's idle share
and the process's voluntary context switches a second (threads sleeping at OpenMP barriers: robust
where tokens/s on a shared machine move ±10% between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as wl

LOADS = ("own-thread", "executor")


def cpu_counters() -> tuple[int, int, int]:
    """(this process's voluntary context switches over its threads, the machine's idle and total jiffies)."""
    switches = 0
    for status in Path("/proc/self/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches += int(line.split()[1])
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return switches, fields[3] + fields[4], sum(fields[:8])


def figures(before: tuple[int, int, int], tokens: int, seconds: float) -> dict[str, float]:
    """Output tokens/s of a run that started at `before` (cpu_counters()) and just ended, with the
    machine's idle share and this process's voluntary context switches a second over it (threads that
    sleep at barriers)."""
    s1, i1, t1 = cpu_counters()
    s0, i0, t0 = before
    return {
        "tok_per_s": tokens / seconds,
        "idle_share": (i1 - i0) / max(1, t1 - t0),
        "switches_per_s": (s1 - s0) / seconds,
    }


def greedy(max_tokens: int) -> Any:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_config(args: argparse.Namespace, gguf: Path) -> Any:
    from kvpilot.runtime.config import EngineConfig

    return EngineConfig(
        model=str(gguf),
        device="cpu",
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory=int(args.kv_gib * 2**30),
    )


def setup(args: argparse.Namespace) -> tuple[Any, list[wl.Request]]:
    """(the engine's config, the batch) for `--model`."""
    gguf, tokenizer_gguf = wl.resolve_model(args.model)
    corpus = wl.corpus_token_ids(str(tokenizer_gguf))
    return engine_config(args, gguf), wl.make_requests(args.num_requests, (32, 512), (64, 512), 0, corpus)


def run_offline(args: argparse.Namespace) -> dict[str, float]:
    from kvpilot.runtime.engine.build import build_engine

    cfg, reqs = setup(args)
    engine = build_engine(cfg)
    engine.generate([reqs[0].prompt_ids[:32]], greedy(4))
    for r in reqs:
        engine.add_request(f"r{r.index}", r.prompt_ids, greedy(r.max_tokens))
    before, t0 = cpu_counters(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return figures(before, sum(r.max_tokens for r in reqs), time.perf_counter() - t0)


async def run_async(args: argparse.Namespace) -> dict[str, float]:
    from kvpilot.runtime.engine.build import build_async_engine
    from kvpilot.runtime.serving.lifecycle import in_own_thread

    cfg, reqs = setup(args)
    if args.load == "own-thread":
        engine = await in_own_thread(lambda: build_async_engine(cfg), "kvpilot-load")
    else:
        engine = await asyncio.to_thread(build_async_engine, cfg)
    engine.start()

    async def one(request_id: str, prompt: list[int], max_tokens: int) -> int:
        n = 0
        async for out in engine.add_request(request_id, prompt, greedy(max_tokens)):
            n += len(out.output.new_token_ids)
        return n

    await one("warm", reqs[0].prompt_ids[:32], 4)
    before, t0 = cpu_counters(), time.perf_counter()
    counts = await asyncio.gather(*(one(f"r{r.index}", r.prompt_ids, r.max_tokens) for r in reqs))
    result = figures(before, sum(counts), time.perf_counter() - t0)
    await engine.shutdown()
    return result


def without_option(argv: list[str], name: str) -> list[str]:
    """`argv` less `name VALUE` and `name=VALUE`."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="as runtime_vs_peers.py --model")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2, help="offline/async pairs, alternating")
    p.add_argument(
        "--load",
        default="own-thread",
        help="how AsyncEngine's model loads, a comma list to compare (own-thread: as kvpilot serve; executor: "
        "asyncio.to_thread, as it did before)",
    )
    p.add_argument("--one", choices=["offline", "async"], help=argparse.SUPPRESS)  # a child run
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one == "offline":
        print(json.dumps(run_offline(args)))
        return 0
    if args.one == "async":
        print(json.dumps(asyncio.run(run_async(args))))
        return 0
    loads = args.load.split(",")
    if not set(loads) <= set(LOADS):
        raise SystemExit(f"--load: expected a comma list of {', '.join(LOADS)}, got {args.load!r}")
    forwarded = without_option(list(argv if argv is not None else sys.argv[1:]), "--load")
    runs: dict[str, list[float]] = {"offline": [], **{f"async ({load})": [] for load in loads}}
    idle: dict[str, list[float]] = {m: [] for m in runs}
    switches: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(args.rounds):  # a fresh process each: no OpenMP team carried over
        for mode in runs:
            load = mode[len("async (") : -1] if mode != "offline" else LOADS[0]
            child = [sys.executable, __file__, *forwarded, "--load", load, "--one", mode.split()[0]]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            runs[mode].append(round(got["tok_per_s"], 1))
            idle[mode].append(round(got["idle_share"], 3))
            switches[mode].append(round(got["switches_per_s"]))
    doc = {
        "benchmark": "in-process LLMEngine vs AsyncEngine (kvpilot serve's engine thread), same batch",
        "threads": args.threads,
        "num_requests": args.num_requests,
        "output_tok_per_s": runs,
        "machine_idle_share": idle,
        "voluntary_switches_per_s": switches,
        "vs_offline_best": {
            m: round(max(v) / max(runs["offline"]), 3) for m, v in runs.items() if m != "offline"
        },
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
