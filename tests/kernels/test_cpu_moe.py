"""The fused CPU Mixture-of-Experts call for 16/32-bit experts (kernels/cpu_moe.py, csrc/moe_cpu.c) at
every ISA level this CPU runs, against its specification in float64 and against the torch
per-expert loop (`moe_grouped`): odd widths, one token, tokens that pick one expert twice, experts
nobody picks, experts held elsewhere (expert parallelism) and split widths (tensor parallelism).

Tolerances. The kernel accumulates every dot product in float32 and keeps g, u, the per-expert
outputs and the combine in float32; with bfloat16 weights it rounds silu(g) * u to bfloat16 (as
torch does) and the result once. `spec` is that arithmetic in float64. float32: the only difference
is float32 summation over at most a few hundred terms of size ~1, so 1e-5 relative/absolute holds
with margin (the errors seen are ~3e-7 of scale). bfloat16: the result's rounding is at most half a
bfloat16 step (2^-9 relative, within rtol 2^-8), and an activation whose float32 and float64 values
round to neighbouring bfloat16 values moves the output by one activation step (2^-8 of it) times a
w2 weight: atol 2^-8 of the output's scale covers a few of those.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_moe, isa
from kvpilot.runtime.models.moe import moe_grouped, route
from tests.needs import missing

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _built(cpu_isa: str) -> None:
    if not cpu_moe.available(cpu_isa):
        missing("kernels/csrc/moe_cpu.c built", "a C compiler (gcc/cc) on PATH")


def _moe(
    t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


def spec(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """The kernel's arithmetic in float64 (silu(g) * u rounded to x's dtype), not rounded at the end."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - offset
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e].double() @ x[t].double()
            g, u = gu[:inter], gu[inter:]
            act = (g * torch.sigmoid(g) * u).to(x.dtype).double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    scale = float(want.abs().max()) or 1.0
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2**-8 * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i"),
    [
        (1, 4, 2, 64, 32),
        (7, 8, 2, 33, 17),
        (13, 16, 4, 128, 64),
        (33, 6, 6, 70, 35),
        (5, 3, 1, 16, 1),
        (300, 8, 2, 96, 48),
    ],  # the last: prefill-sized, ~75 rows per expert (many token tiles each)
)
def test_matches_spec_and_torch_loop(
    cpu_isa: str, dtype: torch.dtype, t: int, e: int, k: int, h: int, i: int
) -> None:
    x, w13, w2, weights, ids = _moe(t, e, k, h, i, dtype, seed=t + h)
    got = cpu_moe.fused_experts(x, w13, w2, weights, ids, level=cpu_isa)
    want = spec(x, w13, w2, weights, ids)
    check(got, want, dtype)
    # the torch loop rounds g, u, each expert's output and the combine to x's dtype: the kernel is
    # at least about as close to the float64 truth (float32: both at float32 rounding)
    loop = moe_grouped(x, w13, w2, weights, ids)
    err = float((got.double() - want).norm())
    err_loop = float((loop.double() - want).norm())
    assert err <= 1.25 * err_loop + 1e-6 * float(want.norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeated_and_unpicked_experts(cpu_isa: str, dtype: torch.dtype) -> None:
    """A token that names one expert in two slots gets it twice (each with its weight); experts
    nobody picks are never read (NaN weights there change nothing)."""
    x, w13, w2, _, _ = _moe(6, 8, 3, 48, 24, dtype, seed=4)
    ids = torch.tensor([[2, 2, 5], [5, 2, 2], [7, 7, 7], [2, 5, 7], [5, 5, 2], [7, 2, 5]])
    weights = torch.rand(6, 3, generator=torch.Generator().manual_seed(1))
    for unused in (0, 1, 3, 4, 6):
        w13[unused] = float("nan")
        w2[unused] = float("nan")
    got = cpu_moe.fused_experts(x, w13, w2, weights, ids, level=cpu_isa)
    assert not got.isnan().any()
    check(got, spec(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expert_and_tensor_parallel_splits_sum_to_whole(cpu_isa: str, dtype: torch.dtype) -> None:
    """Expert parallelism: each rank holds E / 2 whole experts (global ids, an offset); tensor
    parallelism: each rank holds every expert's gate/up rows and w2 columns for half of I. Either
    way the ranks' partial sums add up to the whole layer."""
    x, w13, w2, weights, ids = _moe(9, 8, 3, 40, 24, dtype, seed=2)
    whole = spec(x, w13, w2, weights, ids)
    ep = [
        cpu_moe.fused_experts(x, w13[a : a + 4], w2[a : a + 4], weights, ids, a, level=cpu_isa)
        for a in (0, 4)
    ]
    for a, part in zip((0, 4), ep, strict=True):
        check(part, spec(x, w13[a : a + 4], w2[a : a + 4], weights, ids, a), dtype)
    half = 12
    tp = []
    for r in range(2):
        cols = slice(r * half, (r + 1) * half)
        r13 = torch.cat([w13[:, cols], w13[:, 24 + r * half : 24 + (r + 1) * half]], dim=1)
        r2 = w2[:, :, cols]
        tp.append(cpu_moe.fused_experts(x, r13, r2.contiguous(), weights, ids, level=cpu_isa))
        check(tp[-1], spec(x, r13, r2, weights, ids), dtype)
    for parts in (ep, tp):
        summed = parts[0].double() + parts[1].double()
        check(summed.to(dtype), whole, dtype)


def test_no_tokens_and_bad_arguments(cpu_isa: str) -> None:
    x, w13, w2, weights, ids = _moe(3, 4, 2, 32, 16, torch.float32)
    empty = cpu_moe.fused_experts(x[:0], w13, w2, weights[:0], ids[:0], level=cpu_isa)
    assert empty.shape == (0, 32)
    # a rank whose experts no token picked (expert parallelism): zeros, no assignment read
    elsewhere = cpu_moe.fused_experts(x, w13, w2, weights, ids, 4, level=cpu_isa)
    assert torch.equal(elsewhere, torch.zeros_like(x))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_moe.fused_experts(x.bfloat16(), w13, w2, weights, ids, level=cpu_isa)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_moe.fused_experts(x[:, :16], w13, w2, weights, ids, level=cpu_isa)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_moe.fused_experts(x.half(), w13.half(), w2.half(), weights, ids, level=cpu_isa)


def test_bfloat16_dot_product_where_the_cpu_has_it(cpu_isa: str) -> None:
    assert cpu_moe.built_isa(cpu_isa) == cpu_isa
    assert cpu_moe.bf16_dot(cpu_isa) == (cpu_isa == "avx512" and "avx512_bf16" in isa.cpu_features())


def test_applies_up_to_the_crossover(cpu_isa: str) -> None:
    x, w13, _, _, _ = _moe(3, 4, 2, 32, 16, torch.float32)
    limit = cpu_moe.MAX_ROWS_PER_EXPERT * 4
    assert cpu_moe.max_rows_per_expert(torch.float32) == cpu_moe.MAX_ROWS_PER_EXPERT
    assert cpu_moe.applies(x, w13, limit)
    assert not cpu_moe.applies(x, w13, limit + 1)  # float32 prefill: the per-expert torch matmuls
    # bfloat16: every row count where the build has the native dot product (this level's flag),
    # else the same limit (widened to float32, torch's GEMMs win above it)
    native = cpu_moe.bf16_dot(cpu_isa)
    assert native == (cpu_isa == "avx512" and "avx512_bf16" in isa.cpu_features())
    xb, wb = x.bfloat16(), w13.bfloat16()
    assert cpu_moe.max_rows_per_expert(torch.bfloat16) == (float("inf") if native else limit / 4)
    assert cpu_moe.applies(xb, wb, limit)
    assert cpu_moe.applies(xb, wb, 1024 * limit) == native
    assert not cpu_moe.applies(x.bfloat16(), w13, 8)  # experts in another dtype
    assert not cpu_moe.applies(x.half(), w13.half(), 8)
