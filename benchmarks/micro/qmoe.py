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

Set KVPILOT_CPU_ISA=avx2 to measure the avx2 level on an AVX-512 CPU. `--against FILE` also builds
FILE (another version of kernels/csrc/qmatmul_cpu.c, e.g. `git show REV:kernels/csrc/qmatmul_cpu.c`)
for the same level and times its kvpilot_qmoe in alternation with the current one, round by round
(a before/after that load from other work disturbs alike), and checks that both give identical outputs.

    python benchmarks/kernels_bench.py qmoe [--tokens 1,8,32,128,1024] [--methods int8,int4] [--rounds 3]
        [--against /tmp/old_qmatmul_cpu.c]

Prints one JSON line per (method, T), then a summary with the CPU and the kernel's ISA level.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from harness import cpu_model

from kvpilot.kernels import cbuild, isa, qlinear


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


def other_build(source: Path, workdir: Path) -> ctypes.CDLL:
    """`source` built as kernels/csrc/qmatmul_cpu.c is (its headers, flags and the selected level)."""
    name = Path(qlinear.SOURCE).name
    csrc = workdir / "csrc"
    shutil.copytree(Path(qlinear.SOURCE).parent, csrc)
    shutil.copy(source, csrc / name)
    lib = ctypes.CDLL(str(cbuild.build(csrc / name, [*qlinear.CFLAGS, *isa.flags_for(isa.selected())])))
    qlinear._declare(lib)
    return lib


def qmoe_call(
    lib: ctypes.CDLL, x: torch.Tensor, table: qlinear.ExpertTable, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """What qlinear.fused_experts does, on another build of the library."""
    x2, out = x.contiguous(), torch.empty_like(x)
    ids64, w = ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
    rc = lib.kvpilot_qmoe(
        x2.data_ptr(), qlinear._DTYPES[x.dtype], out.data_ptr(), x.shape[0], table.hidden, table.inter,
        ids.shape[1], ids64.data_ptr(), w.data_ptr(), len(table.experts[0]), 0, *table.pointers,
        table.bits, table.group, int(table.tiled), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise SystemExit(f"the --against build's kvpilot_qmoe returned {rc}")
    return out


def time_calls(
    fns: list[Any], rounds: int, wall: bool, budget_s: float = 0.3, median: bool = False
) -> list[float]:
    """Seconds per call of each fn: the best (`median`: the median) of `rounds` rounds (the fns in turn
    within a round) of enough calls to fill about `budget_s`."""
    clock = time.perf_counter if wall else time.thread_time
    t0 = clock()
    fns[0]()
    once = max(clock() - t0, 1e-6)
    calls = max(1, int(budget_s / once))
    per: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            fn()  # warm: the weights the other fn just streamed are no advantage of this one
            t0 = clock()
            for _ in range(calls):
                fn()
            per[i].append((clock() - t0) / calls)
    return [statistics.median(v) if median else min(v) for v in per]


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
    ap.add_argument(
        "--against", type=Path, help="another qmatmul_cpu.c to time in alternation (before/after)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wall = args.threads > 1
    if not (qlinear.available() and qlinear.built_isa() in ("avx512", "avx2")):
        raise SystemExit(
            f"the fused quantized MoE call needs the avx512 or avx2 level (built: {qlinear.built_isa()})"
        )
    workdir = tempfile.TemporaryDirectory()
    other = other_build(args.against, Path(workdir.name)) if args.against else None
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
            fns: list[Any] = [partial(qlinear.fused_experts, x, table, weights, ids)]
            if other is not None:
                fns.append(partial(qmoe_call, other, x, table, weights, ids))
            secs = time_calls(fns, args.rounds, wall)
            sec = secs[0]
            active = int(ids.unique().numel())
            macs = t * args.topk * 3 * args.hidden * args.inter
            unit = "wall_ms" if wall else "cpu_ms"
            row = {
                "method": method,
                "tokens": t,
                "active_experts": active,
                unit: round(sec * 1e3, 3),
                "int8_gops": round(2 * macs / sec / 1e9, 1),
                "active_weight_gbps": round(weight_bytes * active / args.experts / sec / 1e9, 1),
            }
            if other is not None:
                row |= {
                    f"against_{unit}": round(secs[1] * 1e3, 3),
                    "speedup": round(secs[1] / sec, 2),
                    "identical": bool(torch.equal(fns[0](), fns[1]())),
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
        "against": str(args.against) if args.against else None,
        "shape": {"experts": args.experts, "hidden": args.hidden, "inter": args.inter, "topk": args.topk},
        "results": rows,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
