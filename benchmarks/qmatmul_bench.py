#!/usr/bin/env python
"""The quantized matmul (kernels/qlinear.py) against torch's bf16 matmul, per row count.

For SmolLM2's layer shapes (QKV 960x576, gate/up 3072x576, down 576x1536, the tied LM head
49152x576), one thread, bfloat16 activations, rows M = 1 (single-stream decode), 5 (a speculative
verification with K = 4), 8..128 (batched decode, chunked prefill), each of:
- `bf16`: torch's F.linear on the bf16 weight (the unquantized model's matmul, the peer);
- `kernel`: the C kernel on int8 / int4 weights in the row layout with int8 activation blocks;
- `tiled`: the same arithmetic on the tiled layout (16 rows a code vector; what loaded models use);
- `kernel_float_act`: the same kernel with KVPILOT_QMATMUL_ACTIVATIONS=float (exact product);
- `dequant_mm`: the many-row path, C dequantization to bf16 then torch's matmul.
Times are the best of several rounds of the thread's CPU time (time.thread_time), which a shared
machine disturbs less than wall time; SMALL_M (the row count up to which `matmul` takes the kernel)
comes from where `kernel` and `dequant_mm` cross.

    python benchmarks/qmatmul_bench.py [--rows 1,5,16,32,64,128] [--shapes qkv,gate_up,down,lm_head]

Prints JSON with the CPU and the kernel's ISA level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_quant import cpu_model

from kvpilot.kernels import isa, qlinear

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def cpu_time_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


def measure(x: torch.Tensor, wb: torch.Tensor, qw: qlinear.QuantizedWeight, calls: int) -> dict[str, float]:
    row = {"bf16_us": cpu_time_us(lambda: F.linear(x, wb), calls)}
    row["kernel_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, qw), calls)
    tiled = qlinear.tile(qw)
    row["tiled_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, tiled), calls)
    qlinear.INT8_ACTIVATIONS = False
    row["kernel_float_act_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, qw), calls)
    qlinear.INT8_ACTIVATIONS = True
    row["dequant_mm_us"] = cpu_time_us(lambda: qlinear.dequantize_matmul(x, qw), calls)
    out = {key: round(v, 1) for key, v in row.items()}
    out["kernel_vs_bf16"] = round(row["bf16_us"] / row["kernel_us"], 2)
    out["int8_act_speedup"] = round(row["kernel_float_act_us"] / row["kernel_us"], 2)
    out["tiled_vs_rows"] = round(row["kernel_us"] / row["tiled_us"], 2)
    out["tiled_vs_bf16"] = round(row["bf16_us"] / row["tiled_us"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,16,32,64,128")
    ap.add_argument("--shapes", default="qkv,gate_up,down,lm_head")
    ap.add_argument("--methods", default="int8,int4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * 0.02
        wb = w.bfloat16()
        for method in args.methods.split(","):
            qw = qlinear.quantize(w, method, 32)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                calls = max(1, int(2e6 // (n * k)))
                row: dict[str, Any] = {"shape": shape, "n": n, "k": k, "method": method, "rows": m}
                row |= measure(x, wb, qw, calls)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "qmatmul",
                "machine": {
                    "cpu": cpu_model(),
                    "kernel_isa": qlinear.built_isa(),
                    "vnni": "avx512_vnni" in isa.cpu_features(),
                    "threads": 1,
                },
                "small_m": qlinear.SMALL_M,
                "results": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
