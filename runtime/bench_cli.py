"""`kvpilot bench`: offline throughput of the engine on synthetic requests (all submitted at once).

Takes the same engine flags as `kvpilot serve`. For the comparison against other engines, see
benchmarks/runtime_vs_peers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

from kvpilot.runtime import cli as serve_cli
from kvpilot.runtime.engine.build import build_engine

WORKLOAD_FLAGS = {"num_prompts", "input_len", "output_len", "bench_seed"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_cli.add_arguments(parser)
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=serve_cli._positive_int, default=32, help="requests (default 32)")
    g.add_argument(
        "--input-len", type=serve_cli._positive_int, default=256, help="prompt tokens (default 256)"
    )
    g.add_argument(
        "--output-len", type=serve_cli._positive_int, default=128, help="output tokens (default 128)"
    )
    g.add_argument("--bench-seed", type=int, default=0, help="seed of the synthetic prompts")


def run(args: argparse.Namespace) -> int:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    engine_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in WORKLOAD_FLAGS})
    try:
        cfg = serve_cli.build_config(engine_args)
    except ValueError as e:
        print(f"kvpilot bench: {e}", file=sys.stderr)
        return 2
    engine = build_engine(cfg)
    rng = random.Random(args.bench_seed)
    vocab = engine.tokenizer.vocab_size
    special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(vocab) if i not in special]
    prompts = [[rng.choice(ids) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up (kernels, allocator)
    start = time.perf_counter()
    seqs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    out_tokens = sum(s.num_output_tokens for s in seqs)
    stats = engine.stats()
    print(
        json.dumps(
            {
                "model": engine.model_name,
                "dtype": str(engine.runner.geometry.dtype),
                "attention_backend": engine.runner.backend.name,
                "threads": cfg.threads or os.cpu_count(),
                "machine": platform.machine(),
                "num_prompts": args.num_prompts,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "wall_s": round(wall, 3),
                "output_tokens_per_s": round(out_tokens / wall, 2),
                "total_tokens_per_s": round((out_tokens + args.num_prompts * args.input_len) / wall, 2),
                "preemptions": stats.num_preemptions,
                "steps": stats.num_steps,
            },
            indent=2,
        )
    )
    return 0
