"""Weight-only int8/int4 matmuls (kernels/qlinear.py): the formats, and the C kernel at every ISA level
against the torch reference (dequantize, then matmul)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import isa, qlinear
from tests.needs import missing


def weight(n: int = 96, k: int = 256) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    w[3] = 0.0  # an all-zero row: scale 0 must not turn into NaN
    w[5, :32] = 0.7  # a constant group
    return w


def test_int8_per_channel_round_trip_is_within_half_a_step() -> None:
    w = weight()
    qw = qlinear.quantize_int8(w)
    assert qw.packed.dtype == torch.int8 and qw.scales.shape == (96, 1) and qw.group == 256
    err = (qw.dequantize() - w).abs()
    assert bool((err <= qw.scales.float() * 0.5 + 1e-6).all())
    assert torch.equal(qw.dequantize()[3], torch.zeros(256))
    assert qw.nbytes == 96 * 256 + 96 * 2  # 1 byte a weight plus a float16 scale a row


@pytest.mark.parametrize("group", qlinear.INT4_GROUPS)
def test_int4_group_round_trip_is_within_half_a_step(group: int) -> None:
    w = weight()
    qw = qlinear.quantize_int4(w, group)
    assert qw.packed.shape == (96, 128) and qw.scales.shape == (96, 256 // group)
    assert qw.mins is not None
    deq = qw.dequantize()
    step = qw.scales.float().repeat_interleave(group, dim=1)
    # half a step, plus the float16 rounding of the min
    assert bool(((deq - w).abs() <= step * 0.5 + w.abs() * 2e-3 + 1e-6).all())
    assert torch.equal(deq[3], torch.zeros(256))
    assert torch.allclose(deq[5, :32], torch.full((32,), 0.7), atol=1e-3)
    # the nibble order is GGUF's: weight i of a group in the low nibble of byte i, i + group/2 high
    q = (w[0, :group] - qw.mins[0, 0].float()) / qw.scales[0, 0].float()
    assert int(qw.packed[0, 0]) == int(q[0].round()) | (int(q[group // 2].round()) << 4)


def test_shapes_a_method_cannot_take_are_explained() -> None:
    assert qlinear.check_shape("int4", 256, 32) is None
    assert "not a multiple of the int4 group size 128" in str(qlinear.check_shape("int4", 192, 128))
    assert "group size must be one of 32, 64, 128" in str(qlinear.check_shape("int4", 256, 16))
    assert qlinear.check_shape("int8", 250, 32) is None  # per channel: any width
    with pytest.raises(ValueError, match="not a multiple"):
        qlinear.quantize_int4(torch.zeros(4, 48), 32)


CASES = [
    pytest.param(method, group, level, id=f"{method}{'-g' + str(group) if method == 'int4' else ''}-{level}")
    for level in isa.runnable()
    for method, group in (("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128))
]


@pytest.mark.parametrize(("method", "group", "level"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6, 16])  # the kernel takes x rows 4 at a time
def test_kernel_matches_the_dequantized_matmul(
    method: str, group: int, level: str, dtype: torch.dtype, rows: int
) -> None:
    if not qlinear.available(level):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert qlinear.built_isa(level) == level
    w = weight(96, 384)
    qw = qlinear.quantize(w, method, group or 32)
    torch.manual_seed(rows)
    x = torch.randn(rows, 384).to(dtype)
    bias = torch.randn(96).to(dtype)
    got = qlinear.kernel_matmul(x, qw, bias, level=level)
    assert got.dtype == dtype and got.shape == (rows, 96)
    want = F.linear(x.float(), qw.dequantize(torch.float32), bias.float())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the result
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
    # and the layer's entry point agrees with the reference path it replaces
    torch.testing.assert_close(
        qlinear.matmul(x.float(), qw), qlinear.reference_matmul(x.float(), qw), rtol=1e-5, atol=1e-5
    )


def test_kernel_takes_batched_leading_dims_and_large_m_falls_back_to_the_reference() -> None:
    qw = qlinear.quantize_int4(weight(), 32)
    x = torch.randn(2, 3, 256)
    assert qlinear.kernel_applies(x, qw) == qlinear.available()
    assert qlinear.matmul(x, qw).shape == (2, 3, 96)
    big = torch.randn(qlinear.SMALL_M + 1, 256)
    assert not qlinear.kernel_applies(big, qw)
    assert torch.equal(qlinear.matmul(big, qw), qlinear.reference_matmul(big, qw))
    with pytest.raises(ValueError, match="input has 255 features"):
        qlinear.kernel_matmul(torch.randn(1, 255), qw)
