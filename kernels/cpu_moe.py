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

Where it applies (`max_rows_per_expert`): bfloat16 experts on a build with the native dot product
(AVX512-BF16) at every row count, prefill included; float32 experts, and bfloat16 widened to float32
(AVX2, AVX-512 without BF16), up to MAX_ROWS_PER_EXPERT assignments per held expert on average,
above which torch's GEMMs (MKL float32; oneDNN bf16) are faster in CPU time. Measured on OLMoE's
shapes (benchmarks/moe_bench.py --cpu-kernel, docs/benchmarks.md, MoE): with native bf16
the fused call and the per-expert torch loop spend the same CPU time at prefill sizes (128 rows per
expert: both compute-bound), but with more than one thread the loop's 2 x (active experts) separate
parallel matmuls each end in a barrier, while the fused call is two dynamically scheduled parallel
loops for the whole layer: 2 threads on a loaded 2-core machine, 1.5-1.6x less wall time than the
loop at T = 1024, 1.5-2.3x at T = 256 (to be re-measured quiet).
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from kvpilot.kernels import cbuild, cpu_ops, isa

SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.c"
CFLAGS = ["-O3", *cbuild.FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_DTYPES = cpu_ops.ACTIVATION_CODES
# assignments per held expert (T * top_k / E) up to which the fused call beats the per-expert torch
# matmuls for float32 experts and for bfloat16 without the native dot product; measured on OLMoE's
# shapes (docs/benchmarks.md, MoE section). bfloat16 with it: no limit (`max_rows_per_expert`).
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
    """Whether the build at `level` (None: the selected one) multiplies bfloat16 with AVX512-BF16
    (else widened to float32)."""
    return _bf16_dot_at(level or isa.selected())


@functools.cache
def _bf16_dot_at(level: str) -> bool:  # asked per MoE forward: one ctypes call per level
    return bool(_library(level).kvpilot_moe_bf16_dot())


def max_rows_per_expert(dtype: torch.dtype, level: str | None = None) -> float:
    """Assignments per held expert on average up to which `fused_experts` is the faster way to run
    experts of `dtype` (the build at `level`): unlimited for bfloat16 with the native dot product
    (prefill too), MAX_ROWS_PER_EXPERT otherwise. The C library must be built."""
    return math.inf if dtype == torch.bfloat16 and bf16_dot(level) else MAX_ROWS_PER_EXPERT


def applies(x: torch.Tensor, w13: torch.Tensor, assignments: float) -> bool:
    """Whether `fused_experts` takes this input: CPU, float32 or bfloat16 experts in x's dtype, the C
    library built, and at most `max_rows_per_expert` assignments per held expert on average."""
    return (
        x.device.type == "cpu"
        and w13.device.type == "cpu"
        and x.dtype in _DTYPES
        and w13.dtype == x.dtype
        and available()
        and assignments <= max_rows_per_expert(x.dtype) * w13.shape[0]
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
