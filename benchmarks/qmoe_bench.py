#!/usr/bin/env python
"""The fused quantized Mixture-of-Experts call (kernels/qlinear.fused_experts -> kvpilot_qmoe) per token count.

One MoE block's experts at OLMoE-1B-7B's shapes (hidden 2048, 64 experts of intermediate width 1024,
top-8), random weights quantized as `--quantization int8|int4` does at load (runtime/quantization:
int8 per output channel, int4 group 32) and put into the CPU kernel's tiled layout (qlinear.tile, as
tile_for_cpu does), random top-k routing; bfloat16 activations. For each token count T (1: single
stream, 8..32: batched decode, 128..1024: prefill chunks) it times one `fused_experts` call with the
calling thread's CPU time (time.thread_time; the best of --rounds rounds), one thread by default,
which a shared machine disturbs far less than wall time. `--threads N` runs the C call on N OpenMP
threads and reports wall time instead (thread time would miss the workers).

Set KVPILOT_CPU_ISA=avx2 to measure the avx2 level on an AVX-512 CPU.

    python benchmarks/qmoe_bench.py [--tokens 1,8,32,128,1024] [--methods int8,int4] [--rounds 3]

Prints one JSON line per (method, T), then a summary with the CPU and the kernel's ISA level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_quant import cpu_model

from kvpilot.kernels import isa, qlinear


def build_table(method: str, experts: int, hidden: int, inter: int, group: int) -> qlinear.ExpertTable:
    """`experts` random experts quantized and tiled as at load (one expert's float weights at a time)."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = [], []
    for _ in range(experts):
        w13.append(
            qlinear.tile(
                qlinear.quantize(torch.randn(2 * inter, hidden, generator=gen) * 0.02, method, group)
            )
        )
        w2.append(
            qlinear.tile(qlinear.quantize(torch.randn(hidden, inter, generator=gen) * 0.02, method, group))
        )
    table = qlinear.expert_table(w13, w2)
    if table is None or not table.tiled:
        raise SystemExit("the experts did not make a tiled expert table")
    return table


def routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return weights, ids


def time_call(fn: Any, rounds: int, wall: bool, budget_s: float = 0.3) -> float:
    """Seconds per call: the best of `rounds` rounds of enough calls to fill about `budget_s`."""
    clock = time.perf_counter if wall else time.thread_time
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-6)
    calls = max(1, int(budget_s / once))
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,128,1024")
    ap.add_argument("--methods", default="int8,int4")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--group", type=int, default=32, help="int4 group size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="OpenMP threads for the C call (above 1: wall time)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wall = args.threads > 1
    if not (qlinear.available() and qlinear.built_isa() in ("avx512", "avx2")):
        raise SystemExit(
            f"the fused quantized MoE call needs the avx512 or avx2 level (built: {qlinear.built_isa()})"
        )
    rows: list[dict[str, Any]] = []
    for method in args.methods.split(","):
        table = build_table(method, args.experts, args.hidden, args.inter, args.group)
        weight_bytes = sum(q.nbytes for part in table.experts for q in part)
        for t in map(int, args.tokens.split(",")):
            weights, ids = routing(t, args.experts, args.topk, seed=t)
            x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            if qlinear.fused_experts(x, table, weights, ids) is None:  # beyond max_kernel_rows
                row = {"method": method, "tokens": t, "fused": False}
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            sec = time_call(partial(qlinear.fused_experts, x, table, weights, ids), args.rounds, wall)
            active = int(ids.unique().numel())
            macs = t * args.topk * 3 * args.hidden * args.inter
            row = {
                "method": method,
                "tokens": t,
                "active_experts": active,
                ("wall_ms" if wall else "cpu_ms"): round(sec * 1e3, 3),
                "int8_gops": round(2 * macs / sec / 1e9, 1),
                "active_weight_gbps": round(weight_bytes * active / args.experts / sec / 1e9, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {
        "benchmark": "qmoe",
        "machine": {
            "cpu": cpu_model(),
            "kernel_isa": qlinear.built_isa(),
            "vnni": "avx512_vnni" in isa.cpu_features(),
            "threads": args.threads,
            "clock": "wall" if wall else "thread_cpu",
        },
        "shape": {"experts": args.experts, "hidden": args.hidden, "inter": args.inter, "topk": args.topk},
        "results": rows,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
