#!/usr/bin/env python
"""One decode step at long context, in thread CPU time: what `long-context` measures in wall time,
without its prefills and steadier on a shared machine (`runtime_vs_peers.py decode-step`; issue 26).

kvpilot's default path on the long-context benchmark's model (SmolLM2-135M-Instruct Q4_1, the
32,768-token copy: benchmarks/peers/long_context.py), one sequence whose first L tokens' K/V fill the
pool with random values (the speed does not depend on them; every step attends to all L keys), per
--kv-cache-dtype: the runner's compiled forward (the decoder stack in one C call where it applies,
else the model's layers) plus the LM head, best of --repeats, in the calling thread's CPU time on
--threads (1: all the work is on that thread). Reports ms per step, the stack's share, tokens/s
and each dtype's step at the longest length over its step at the shortest (issue 26's goal: <= 1.5).

    python benchmarks/runtime_vs_peers.py decode-step --threads 1 --lengths 1024,4096,8000,16384
    python benchmarks/runtime_vs_peers.py decode-step --kv-cache-dtypes auto,int8,fp8
    python benchmarks/runtime_vs_peers.py decode-step --threads 1 --lengths 128 --kv-cache-dtypes auto \
        --model benchmarks/.build/shapes/llama-1b/llama-1b-q4_k_m.gguf     # a single stream's step at 1B
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

from kvpilot.runtime.config import KVCacheDtype

KV_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,8000,16384", help="context lengths in tokens, comma list")
    p.add_argument("--kv-cache-dtypes", default="auto,int8", help=f"comma list of {', '.join(KV_DTYPES)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10, help="steps timed per length; the best is kept")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument(
        "--model",
        default="",
        help="a GGUF file instead of the long-context SmolLM2 copy (e.g. a `runtime_vs_peers.py shapes` file)",
    )
    args = p.parse_args(argv)
    args.lengths = sorted({int(x) for x in args.lengths.split(",") if x})
    if args.model and not Path(args.model).is_file():
        p.error(f"--model: no such file {args.model}")
    if not args.lengths or args.lengths[0] < 1:
        p.error("--lengths takes context lengths of at least 1 token")
    args.kv_cache_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    unknown = set(args.kv_cache_dtypes) - set(KV_DTYPES)
    if unknown or not args.kv_cache_dtypes:
        p.error(f"--kv-cache-dtypes takes {', '.join(KV_DTYPES)}, not {sorted(unknown) or 'nothing'}")
    return args


def fill_random(caches: list[Any]) -> None:
    """Random K/V (and scales) in the whole pool: softmax then sees spread scores, as real text does."""
    import torch

    for c in caches:
        for t in (c.k, c.v):
            if t.dtype.itemsize == 1:  # int8 / float8: random codes, scales ~ a real cache's
                t.view(torch.int8).copy_(torch.randint(-100, 100, t.shape, dtype=torch.int8))
            else:
                t.normal_()
        for s in (c.k_scale, c.v_scale):
            if s is not None:
                s.copy_((torch.rand(s.shape) * 0.05).to(s.dtype))


def step_times(engine: Any, length: int, repeats: int) -> dict[str, float]:
    """(forward + LM head, decoder-stack call) thread CPU seconds of a decode step at `length`, best."""
    import torch

    from kvpilot.kernels import cpu_decoder
    from kvpilot.kernels.attention import AttentionMetadata

    runner = engine.runner
    bs = runner.kv_caches[0].block_size
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([length - 1]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.arange((length + bs - 1) // bs, dtype=torch.int32)[None],
        query_lens_cpu=[1],
        seq_lens_cpu=[length],
        max_query_len=1,
        max_seq_len=length,
    )
    ids, pos = torch.tensor([42]), torch.tensor([length - 1])
    forward = runner.compiled if runner.compiled is not None else runner.model
    stack = [0.0]
    real = cpu_decoder.run

    def timed(*a: Any) -> None:
        t0 = time.thread_time()
        real(*a)
        stack[0] += time.thread_time() - t0

    cpu_decoder.run = timed
    best, best_stack = float("inf"), float("inf")
    try:
        with torch.inference_mode():
            for i in range(repeats + 2):  # two warm-up steps
                stack[0] = 0.0
                t0 = time.thread_time()
                runner.model.compute_logits(forward(ids, pos, runner.kv_caches, meta, runner.backend))
                if i >= 2:
                    best, best_stack = min(best, time.thread_time() - t0), min(best_stack, stack[0])
    finally:
        cpu_decoder.run = real
    return {"step_ms": round(best * 1e3, 2), "stack_ms": round(best_stack * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import workload as wl

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.build import build_engine
    from peers.long_context import LONG_CONTEXT, long_context_copy
    from peers.measure import BUILD_DIR, log, machine_info

    torch.set_num_threads(args.threads)
    gguf = (
        Path(args.model)
        if args.model
        else long_context_copy(
            wl.smollm2_gguf(), BUILD_DIR / "models" / f"SmolLM2-135M-Instruct.Q4_1.ctx{LONG_CONTEXT}.gguf"
        )
    )
    doc: dict[str, Any] = {
        "benchmark": "one decode step at long context, thread CPU time (kvpilot default path)",
        "command": " ".join(["python benchmarks/runtime_vs_peers.py decode-step", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "model": gguf.name,
        "threads": args.threads,
        "results": {},
        "summary": {},
    }
    for kv in args.kv_cache_dtypes:
        cfg = EngineConfig(
            model=str(gguf),
            device="cpu",
            threads=args.threads,
            max_num_seqs=4,
            kv_cache_memory=int(args.kv_gib * 2**30),
            kv_cache_dtype=kv,  # type: ignore[arg-type]
        )
        engine = build_engine(cfg)
        fill_random(engine.runner.kv_caches)
        rows: dict[str, Any] = {
            "kv_storage_dtype": str(engine.runner.geometry.dtype).removeprefix("torch."),
            "decoder_stack": engine.runner.compiled is not None,
        }
        for n in args.lengths:
            log(f"kv {kv}: decode step at {n} tokens")
            got = step_times(engine, n, args.repeats)
            got["tok_per_s"] = round(1e3 / got["step_ms"], 1)
            got["load_avg"] = [round(x, 2) for x in os.getloadavg()]
            rows[str(n)] = got
        short, long_ = str(args.lengths[0]), str(args.lengths[-1])
        doc["results"][kv] = rows
        doc["summary"][f"{kv}: step at {long_} over step at {short}"] = round(
            rows[long_]["step_ms"] / rows[short]["step_ms"], 2
        )
        del engine
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
