"""The Triton grouped expert GEMM against a per-expert torch matmul (interpreter on CPU, CUDA on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import triton_moe

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference(x: torch.Tensor, w: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for e in range(w.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        out[a:b] = (x[a:b].double() @ w[e].double().T).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "counts",
    [
        pytest.param([3, 0, 40, 1], id="uneven-with-an-empty-expert"),
        pytest.param([0, 0, 77, 0], id="one-expert-takes-all"),
        pytest.param([1] * 8, id="one-token-each"),
    ],
)
def test_grouped_gemm_matches_per_expert_matmul(dtype: torch.dtype, counts: list[int]) -> None:
    torch.manual_seed(len(counts))
    e, n, k = len(counts), 72, 48  # N and K not multiples of the tiles: edge masking
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], k, device=DEVICE).to(dtype)
    w = (torch.randn(e, n, k, device=DEVICE) / k**0.5).to(dtype)
    got = triton_moe.grouped_expert_gemm(x, w, torch.tensor(offsets, device=DEVICE))
    torch.testing.assert_close(
        got.float(), reference(x, w, offsets).float(), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_routing_sort_then_gemm_equals_a_per_token_loop() -> None:
    """Top-2 routing of 20 tokens over 5 experts: sort, one grouped GEMM, unsort, weighted combine."""
    torch.manual_seed(3)
    t, e, n, k, top = 20, 5, 24, 16, 2
    x = torch.randn(t, k, device=DEVICE)
    w = torch.randn(e, n, k, device=DEVICE)
    logits = torch.randn(t, e, device=DEVICE)
    weights, experts = logits.softmax(-1).topk(top, dim=-1)
    order, offsets = triton_moe.sort_by_expert(experts.reshape(-1), e)
    rows = torch.arange(t, device=DEVICE).repeat_interleave(top)
    y_sorted = triton_moe.grouped_expert_gemm(x[rows[order]], w, offsets)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    combined = (y.view(t, top, n) * weights.unsqueeze(-1)).sum(1)
    want = torch.stack(
        [sum(weights[i, j] * (w[experts[i, j]] @ x[i]) for j in range(top)) for i in range(t)]  # type: ignore[misc]
    )
    torch.testing.assert_close(combined, want, atol=1e-4, rtol=1e-4)
    assert offsets.tolist()[-1] == t * top and offsets.diff().ge(0).all()


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="x has 8 features, the experts take 6"):
        triton_moe.grouped_expert_gemm(x, torch.zeros(2, 3, 6), torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="3 entries for 3 experts"):
        triton_moe.grouped_expert_gemm(x, torch.zeros(3, 3, 8), torch.tensor([0, 2, 4]))
