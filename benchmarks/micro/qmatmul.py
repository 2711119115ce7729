#!/usr/bin/env python
"""The quantized matmul (kernels/qlinear.py) against torch's bf16 matmul, per row count.

For SmolLM2's layer shapes (QKV 960x576, gate/up 3072x576, down 576x1536, the tied LM head
49152x576), one thread, bfloat16 activations (`--dtype float32`: float32, what kvpilot runs at the
avx2 level), rows M = 1 (single-stream decode), 5 (a speculative verification with K = 4), 8..128
(batched decode, chunked prefill), each of:
- `bf16` (or `f32`): torch's F.linear on the unquantized weight in that dtype (the peer);
- `kernel`: the small-M C kernel on int8 / int4 weights in the row layout, int8 activation blocks;
- `tiled`: the same arithmetic on the tiled layout (16 rows a code vector; what loaded CPU models use);
- `kernel_float_act`: the same kernel with float activations (`--qmatmul-activations float`) (exact product);
- `tiled_float_act`: float activations on the tiled layout (kvpilot_qmatmul_tiled_float: codes widened
  to float32 in registers, the exact product; what loaded CPU models use under float activations);
- `tiled_bf16_act`: activations rounded to bfloat16 on the tiled layout (kvpilot_qmatmul_tiled_bf16:
  int4 codes times bf16 pairs by vdpbf16ps where the CPU has AVX512-BF16, else the float kernel; the
  default path's on such CPUs); TILED_BF16_MAX_M from where it and `dequant_mm` would cross;
- `tiled_i16_act`: activations rounded to int16 per block of 32 on the tiled layout
  (kvpilot_qmatmul_tiled_i16: codes widened to int16 once a pass, vpmaddwd; the default path's at the
  avx2 level);
- `dequant_mm`: C dequantization to the activations' dtype then torch's matmul (the many-row path
  with float activations, and where the GEMM below does not apply);
- `gemm` (`--gemm`): the int8-activation GEMM of kernels/csrc/qgemm_cpu.c (many rows).
Times are the best of several rounds of the thread's CPU time (time.thread_time), which a shared
machine disturbs less than wall time; SMALL_M (the row count up to which `matmul` takes the kernel)
comes from where `kernel` and `dequant_mm` cross, GEMM_MIN_ROWS (from how many rows a format takes
the GEMM, per level) from where `gemm` beats both. Set KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 to measure the avx2 level on an AVX-512 CPU (the
last one caps torch's float32 matmul, MKL's sgemm).

    python benchmarks/kernels_bench.py qmatmul [--rows 1,5,16,32,64,128] [--shapes qkv,gate_up,down,lm_head]
    python benchmarks/kernels_bench.py qmatmul --shapes qkv_1b,o_1b,gate_up_1b,down_1b --rows 1,64 --methods int4

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from harness import cpu_model

from kvpilot.kernels import isa, qlinear, switches

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
# Llama-3.2-1B's (benchmarks/peers/shapes.py, llama-1b): QKV 3072x2048, gate/up 16384x2048, down 2048x8192,
# the tied LM head 128256x2048
SHAPES_1B = {
    "qkv_1b": (3072, 2048),
    "o_1b": (2048, 2048),
    "gate_up_1b": (16384, 2048),
    "down_1b": (2048, 8192),
    "lm_head_1b": (128256, 2048),
}
SHAPES |= SHAPES_1B


def cpu_time_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


def measure(
    x: torch.Tensor, wb: torch.Tensor, qw: qlinear.QuantizedWeight, calls: int, gemm: bool, small: bool
) -> dict[str, float]:
    peer = "bf16" if x.dtype == torch.bfloat16 else "f32"
    row = {f"{peer}_us": cpu_time_us(lambda: F.linear(x, wb), calls)}
    if small:
        row["kernel_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, qw), calls)
        tiled = qlinear.tile(qw)
        row["tiled_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, tiled), calls)
        with switches.using(qmatmul_activations="float"):
            row["kernel_float_act_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, qw), calls)
            row["tiled_float_act_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, tiled), calls)
        with switches.using(qmatmul_activations="bf16"):
            row["tiled_bf16_act_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, tiled), calls)
        with switches.using(qmatmul_activations="int16"):
            row["tiled_i16_act_us"] = cpu_time_us(lambda: qlinear.kernel_matmul(x, tiled), calls)
    row["dequant_mm_us"] = cpu_time_us(lambda: qlinear.dequantize_matmul(x, qw), calls)
    if gemm:
        row["gemm_us"] = cpu_time_us(lambda: qlinear.gemm_matmul(x, qw), calls)
    out = {key: round(v, 1) for key, v in row.items()}
    if small:
        out[f"kernel_vs_{peer}"] = round(row[f"{peer}_us"] / row["kernel_us"], 2)
        out["int8_act_speedup"] = round(row["kernel_float_act_us"] / row["kernel_us"], 2)
        out["tiled_vs_rows"] = round(row["kernel_us"] / row["tiled_us"], 2)
        out[f"tiled_vs_{peer}"] = round(row[f"{peer}_us"] / row["tiled_us"], 2)
        out["tiled_float_vs_rows"] = round(row["kernel_float_act_us"] / row["tiled_float_act_us"], 2)
        out[f"tiled_float_vs_{peer}"] = round(row[f"{peer}_us"] / row["tiled_float_act_us"], 2)
        out["tiled_float_vs_dequant_mm"] = round(row["dequant_mm_us"] / row["tiled_float_act_us"], 2)
        out["tiled_bf16_vs_float"] = round(row["tiled_float_act_us"] / row["tiled_bf16_act_us"], 2)
        out["tiled_bf16_vs_dequant_mm"] = round(row["dequant_mm_us"] / row["tiled_bf16_act_us"], 2)
        out["tiled_i16_vs_float"] = round(row["tiled_float_act_us"] / row["tiled_i16_act_us"], 2)
        out["tiled_i16_vs_int8"] = round(row["tiled_us"] / row["tiled_i16_act_us"], 2)
    if gemm:
        out[f"gemm_vs_{peer}"] = round(row[f"{peer}_us"] / row["gemm_us"], 2)
        out["gemm_vs_dequant_mm"] = round(row["dequant_mm_us"] / row["gemm_us"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,16,32,64,128")
    ap.add_argument("--shapes", default="qkv,gate_up,down,lm_head")
    ap.add_argument("--methods", default="int8,int4")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--gemm", action="store_true", help="also time the int8-activation GEMM (qgemm_cpu.c)")
    ap.add_argument("--no-small", action="store_true", help="skip the small-M kernel's columns")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * 0.02
        dtype = getattr(torch, args.dtype)
        wb = w.to(dtype)
        for method in args.methods.split(","):
            qw = qlinear.quantize(w, method, 32)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                calls = max(1, int(2e6 // (n * k)))
                row: dict[str, Any] = {"shape": shape, "n": n, "k": k, "method": method, "rows": m}
                row |= measure(x, wb, qw, calls, args.gemm, not args.no_small)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "qmatmul",
                "machine": {
                    "cpu": cpu_model(),
                    "kernel_isa": qlinear.built_isa(),
                    "aten_isa": torch.backends.cpu.get_cpu_capability(),
                    "dtype": args.dtype,
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
