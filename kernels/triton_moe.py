"""Grouped expert GEMM in Triton: every expert multiplies its own contiguous run of tokens in one launch.

Standalone (not wired into a model yet): the MoE layer routes tokens, sorts them by expert, and calls

    out = grouped_expert_gemm(x_sorted, weight, expert_offsets)

with x_sorted [T, K] (the rows of expert e are expert_offsets[e] : expert_offsets[e + 1]), weight
[E, N, K] (each expert's nn.Linear weight, as checkpoints store it) and expert_offsets [E + 1] int32/64
on the device. Row r of out is x_sorted[r] @ weight[e].T for its expert e. No host synchronization (the
grid is sized from T and E, programs past an expert's rows exit at once), so the call can sit inside a
CUDA graph. Accumulates in float32; float32 inputs use exact float32 dots.

Tested on the CPU under Triton's interpreter against a per-expert torch matmul
(tests/kernels/test_triton_moe.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def available() -> bool:
    return HAVE_TRITON


BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32

if HAVE_TRITON:

    @triton.jit
    def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: typed by the JIT
        x_ptr,
        w_ptr,
        out_ptr,
        offsets_ptr,
        n_size,
        k_size,
        tiles_per_expert,
        stride_xt,
        stride_we,
        stride_wn,
        stride_ot,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        e = pid // tiles_per_expert
        tile = pid % tiles_per_expert
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        row0 = start + tile * BLOCK_M
        if row0 < end:
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            r_ok = rows < end
            c_ok = cols < n_size
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            w_base = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, k_size, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_size
                a = tl.load(
                    x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=c_ok[None, :] & k_ok[:, None],
                    other=0.0,
                )
                if DOT_F32:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc += tl.dot(a, b, input_precision=PRECISION)
            o = out_ptr + rows[:, None] * stride_ot + cols[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def grouped_expert_gemm(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """x [T, K] sorted by expert, weight [E, N, K], expert_offsets [E + 1] -> [T, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 3 or expert_offsets.dim() != 1:
        raise ValueError("expected x [T, K], weight [E, N, K], expert_offsets [E + 1]")
    t, k = x.shape
    e, n, kw = weight.shape
    if kw != k:
        raise ValueError(f"x has {k} features, the experts take {kw}")
    if expert_offsets.numel() != e + 1:
        raise ValueError(
            f"expert_offsets has {expert_offsets.numel()} entries for {e} experts (want {e + 1})"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, the expert weights {weight.dtype}")
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or e == 0:
        return out
    # an expert may hold every token: each gets enough tiles for all T rows; unused ones exit at once
    tiles = triton.cdiv(t, BLOCK_M)
    grid = (e * tiles, triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        x,
        weight,
        out,
        expert_offsets,
        n,
        k,
        tiles,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # Triton 3.x's interpreter (CPU tensors) computes bfloat16 dots wrongly; float32 there
        DOT_F32=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: flat expert choices [R] -> (order [R]: the rows grouped by expert, stable; offsets [E + 1])."""
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets
