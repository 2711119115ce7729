"""A Mixture-of-Experts layer's 16/32-bit experts in one C call on CPU (kernels/csrc/moe_cpu.c).

`runtime/models/moe.moe_grouped` runs each active expert as two torch matmuls on its rows; at decode
batch sizes an expert gets a few rows, so each matmul is a small GEMM whose per-call overhead and
weight re-reads dominate. `fused_experts` does the whole layer in one call: assignments counting-sorted
by expert, each active expert's gate/up/down rows read once for all its tokens, silu * mul fused into
the gate/up pass, the routing-weighted combine in the kernel, one OpenMP loop per pass over (expert,
block of weight rows). bfloat16 weights use AVX512-BF16 `vdpbf16ps` where the CPU has it, and are
widened to float32 (a shift) for FMAs on AVX2 CPUs; float32 weights (what `auto` picks without native
bf16) use float32 FMAs. Accumulation is float32 everywhere; with bfloat16 weights the silu * mul
activation is rounded to bfloat16 as torch's per-expert matmuls round it, other intermediates stay
float32 (torch rounds them to bfloat16), so the result is at least as accurate as the torch loop
(the precise statement is at the top of the C source).

It applies up to MAX_ROWS_PER_EXPERT assignments per held expert on average, the measured crossover
above which torch's GEMMs (prefill) are faster (benchmarks/moe_bench.py --cpu-kernel, docs/benchmarks.md run 6).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvpilot.kernels import cbuild

SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.c"
CFLAGS = ["-O3", *cbuild.FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# assignments per held expert (T * top_k / E) up to which the fused call beats the per-expert torch
# matmuls; measured on OLMoE's shapes (docs/benchmarks.md, MoE section)
MAX_ROWS_PER_EXPERT = 16


def _declare(lib: ctypes.CDLL) -> None:
    p, i, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.kvpilot_moe.argtypes = [p, i, p, long, long, long, i, p, p, long, long, p, p, i]
    lib.kvpilot_moe.restype = i
    lib.kvpilot_moe_bf16_dot.argtypes = []
    lib.kvpilot_moe_bf16_dot.restype = i


EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "one torch matmul pair per expert")
_library = EXTENSION.library
built_isa = EXTENSION.built_isa
available = EXTENSION.available


def bf16_dot(level: str | None = None) -> bool:
    """Whether the build at `level` multiplies bfloat16 with AVX512-BF16 (else widened to float32)."""
    return bool(_library(level).kvpilot_moe_bf16_dot())


def applies(x: torch.Tensor, w13: torch.Tensor, assignments: float) -> bool:
    """Whether `fused_experts` takes this input: CPU, float32 or bfloat16 experts in x's dtype, at most
    MAX_ROWS_PER_EXPERT assignments per held expert on average, and the C library built."""
    return (
        x.device.type == "cpu"
        and w13.device.type == "cpu"
        and x.dtype in _DTYPES
        and w13.dtype == x.dtype
        and assignments <= MAX_ROWS_PER_EXPERT * w13.shape[0]
        and available()
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int = 0,
    *,
    level: str | None = None,
) -> torch.Tensor:
    """`moe_grouped(x, w13, w2, weights, ids, expert_offset)` in one C call: x [T, H], w13 [E, 2I, H],
    w2 [E, H, I] (x's dtype, float32 or bfloat16, on CPU), weights/ids [T, k] (global expert ids;
    experts expert_offset .. + E are held here, the others contribute zero)."""
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"fused experts take float32 or bfloat16 x and experts of one dtype, got "
            f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"fused experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit"
        )
    t, k = ids.shape
    x2 = x.contiguous()
    a, b = w13.contiguous(), w2.contiguous()
    out = torch.empty_like(x2)
    ids64 = ids.to(torch.int64).contiguous()
    wts = weights.to(torch.float32).contiguous()
    rc = _library(level).kvpilot_moe(
        x2.data_ptr(),
        _DTYPES[x.dtype],
        out.data_ptr(),
        t,
        h,
        two_i // 2,
        k,
        ids64.data_ptr(),
        wts.data_ptr(),
        e,
        expert_offset,
        a.data_ptr(),
        b.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"fused experts kernel rejected its arguments (code {rc})")
    return out
