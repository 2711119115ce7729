"""GGUF blocks -> QuantizedWeight (runtime/gguf_blocks.py) against gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvpilot.kernels import qlinear
from kvpilot.runtime import gguf_blocks

ROWS, COLS = 6, 512  # two Q4_K super-blocks, sixteen 32-weight blocks a row


def random_blocks(name: str, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """Random bytes in every block, with its float16 fields set to finite weight-sized values."""
    gtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[gtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    n_f16 = 2 if name in ("Q4_1", "Q4_K") else 1  # d (and m / dmin) lead the block
    f16 = (rng.standard_normal((rows, cols // block, n_f16)) * 0.02).astype(np.float16)
    if name == "Q4_K":  # include tiny super-block scales: d * sc then falls below float16's normals
        f16[0] *= np.float16(1e-3)
    b[..., : 2 * n_f16] = f16.view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_q8_0_q4_0_q4_1_convert_exactly(name: str) -> None:
    rng = np.random.default_rng(1)
    raw = random_blocks(name, rng)
    gtype = GGMLQuantizationType[name]
    qw = gguf_blocks.to_qweight(raw, gtype, COLS)
    assert (qw.bits, qw.group, qw.out_features, qw.in_features) == (
        gguf_blocks.DIRECT_BITS[name],
        32,
        ROWS,
        COLS,
    )
    assert qw.scales.dtype == torch.float16 and qw.packed.shape == (ROWS, COLS * qw.bits // 8)
    want = dequantize(raw, gtype).reshape(ROWS, COLS)
    np.testing.assert_array_equal(qw.dequantize(torch.float32).numpy(), want)


def q4_k_bound(raw: np.ndarray) -> np.ndarray:
    """Per weight: 15 * err(d * sc) + err(dmin * m), err(x) = max(|x| 2^-11, 2^-25) (float16 rounding)."""
    b = raw.reshape(ROWS, -1, 144)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf_blocks.q4_k_scales_mins(b[..., 4:16])
    scale, mn = np.abs(d * sc), np.abs(dmin * m)

    def err(x: np.ndarray) -> np.ndarray:
        return np.maximum(x * 2.0**-11, 2.0**-25)

    per_group = 15 * err(scale) + err(mn)  # [rows, super-blocks, 8]
    return np.repeat(per_group.reshape(ROWS, -1), 32, axis=-1)


def test_q4_k_converts_within_the_float16_rounding_bound() -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks("Q4_K", rng)
    qw = gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q4_K, COLS)
    assert (qw.bits, qw.group) == (4, 32) and qw.mins is not None
    want = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(ROWS, COLS)
    got = qw.dequantize(torch.float32).numpy()
    diff = np.abs(got - want)
    bound = q4_k_bound(raw) + np.abs(want) * 2.0**-22  # float32 rounding of the two products
    assert (diff <= bound).all(), float((diff - bound).max())
    assert diff.max() > 0  # float16 really rounds some products (the bound is not vacuous)
    # nibbles regrouped, not merely scaled: q recovered from the packed bytes matches gguf's q
    q = torch.cat([qw.packed.reshape(ROWS, -1, 16) & 15, qw.packed.reshape(ROWS, -1, 16) >> 4], -1)
    nib = (
        raw.reshape(ROWS, -1, 144)[..., 16:].reshape(ROWS, -1, 4, 1, 32)
        >> np.array([0, 4], np.uint8)[:, None]
    )
    np.testing.assert_array_equal(q.reshape(ROWS, COLS).numpy(), (nib & 15).reshape(ROWS, COLS))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_converted_weights_multiply_like_their_dequantized_form(name: str) -> None:
    """The C kernel (decode rows) and the reference matmul read the converted blocks alike."""
    rng = np.random.default_rng(3)
    raw = random_blocks(name, rng)
    if name == "Q8_0":  # llama.cpp's quantizer never writes -128; the kernel's range is -127..127
        raw.reshape(ROWS, -1, 34)[..., 2:][raw.reshape(ROWS, -1, 34)[..., 2:] == 128] = 129
    qw = gguf_blocks.to_qweight(raw, GGMLQuantizationType[name], COLS)
    x = torch.randn(3, COLS)
    want = x @ qw.dequantize(torch.float32).T
    torch.testing.assert_close(qlinear.matmul(x, qw), want, rtol=1e-4, atol=1e-4)


def test_bad_blocks_are_refused() -> None:
    rng = np.random.default_rng(4)
    raw = random_blocks("Q4_0", rng)
    raw.reshape(ROWS, -1, 18)[0, 0, :2] = np.array([np.float16(9000.0)]).view(np.uint8)  # -8 d overflows
    with pytest.raises(ValueError, match="float16"):
        gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q4_0, COLS)
    with pytest.raises(ValueError, match="bytes a row"):
        gguf_blocks.to_qweight(raw[:, :-1], GGMLQuantizationType.Q4_0, COLS)
    with pytest.raises(ValueError, match="Q6_K"):
        gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q6_K, COLS)
