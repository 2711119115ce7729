"""GGUF quantized blocks -> kernels/qlinear.QuantizedWeight, without a 16-bit copy.

Pure, vectorized conversions of a tensor's raw bytes (uint8 [rows, row bytes], as
`GGUFFile.raw` gives them) into the quantized formats the matmul reads:

* Q8_0 (34-byte blocks: float16 d, 32 int8 q; w = q * d) is int8 with group 32: the same bytes.
* Q4_0 (18-byte blocks: float16 d, 16 bytes of nibbles; w = (q - 8) * d) is int4 with group 32,
  scale d and min -8 * d (exact in float16 unless |d| > 8188, which is refused).
* Q4_1 (20-byte blocks: float16 d, float16 m, 16 bytes; w = q * d + m) is int4 with group 32.
  Both Q4 types already use qlinear's nibble order (weight i low nibble of byte i, weight i + 16
  high nibble), so their nibble bytes are copied as they are.
* Q4_K (144-byte super-blocks of 256 weights: float16 d and dmin, eight 6-bit scales sc and mins m
  packed into 12 bytes, 128 bytes of nibbles; sub-block j of 32 weights is w = q * (d * sc_j) -
  dmin * m_j) is int4 with group 32: scale = fp16(d * sc_j), min = fp16(-dmin * m_j), nibbles
  regrouped (Q4_K keeps sub-blocks 2i and 2i + 1 in the low and high nibbles of the same 32 bytes).

Every other quantized type (Q6_K, Q5_K, Q5_0, Q5_1, Q3_K, Q2_K, the i-quants: what a Q4_K_M or
Q5_K_M file mixes in) has no exact form here (Q6_K scales every 16 weights, the kernels every 32 or
more): `requantize_int8` dequantizes it as gguf does and rounds it to int8 per 32 weights (one float16
scale, max |w| / 127). That adds at most half an int8 step, max |w| / 254 of its 32 weights, to each
weight: an eighth of the Q6_K step of the larger of its two 16-weight sub-blocks (Q6_K's codes span 64
steps; more in steps of a much smaller neighbour), a thirtieth of a Q4_K step. Measured on SmolLM2's
down projections (`runtime_quality.py requant`): RMS 0.28x Q6_K's own error, 0.07 Q6_K steps on average. A matrix whose pieces mix widths (a fused q/k/v with
Q4_K q and k and a Q6_K v) loads as int8 whole, its 4-bit pieces requantized the same way.

Q8_0, Q4_0 and Q4_1 dequantize to exactly what `gguf.quants.dequantize` gives. Q4_K's products
d * sc and dmin * m carry up to 11 + 6 significant bits and are rounded to float16's 11: each
differs from the float32 product by at most 2^-11 of itself (2^-25 absolute below float16's
normal range, 2^-14), so a weight differs from gguf's by at most 15 * err(scale) + err(min) (plus
float32 rounding) — about 1% of a quantization step (the quantization itself errs by up to half a
step); docs/runtime.md has the measured figures.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvpilot.kernels.qlinear import QuantizedWeight, quantize_int8

GROUP = 32
# GGUF types whose blocks a QuantizedWeight holds as they are -> the bits of that QuantizedWeight
DIRECT_BITS: dict[str, int] = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
REQUANT_BITS = 8  # the width of every other quantized type (requantize_int8)
REQUANT_ROWS = 4096  # rows requantized at a time
FP16_MAX = float(np.finfo(np.float16).max)


def is_quantized(type_name: str) -> bool:
    """A GGUF block type (more than one weight a block), as opposed to F32/F16/BF16 or an integer type."""
    kind = GGMLQuantizationType.__members__.get(type_name)
    return kind is not None and GGML_QUANT_SIZES[kind][0] > 1


def load_bits(type_names: set[str] | frozenset[str]) -> int | None:
    """The width a matrix built from tensors of these types loads at from blocks: 4 when each is a
    4-bit type held exactly (Q4_0, Q4_1, Q4_K), 8 when each is quantized (Q8_0 exactly, the others
    requantized), None when any is a float type (or there is none)."""
    if not type_names or not all(is_quantized(t) for t in type_names):
        return None
    widths = {DIRECT_BITS.get(t) for t in type_names}
    return 4 if widths == {4} else REQUANT_BITS


def _blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType, in_features: int) -> np.ndarray:
    """raw [rows, row bytes] -> uint8 [rows, blocks per row, block bytes]."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    if in_features % block:
        raise ValueError(f"{ggml_type.name}: {in_features} columns are not a multiple of the block {block}")
    rows = raw.shape[0] if raw.ndim > 1 else 1
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1)
    if data.shape[1] != in_features // block * size:
        raise ValueError(
            f"{ggml_type.name}: {data.shape[1]} bytes a row, expected {in_features // block * size}"
        )
    return data.reshape(rows, in_features // block, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) -> float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _checked_f16(x: np.ndarray, what: str) -> np.ndarray:
    """float32 -> float16, refusing values float16 cannot hold (the loader then dequantizes)."""
    if not np.isfinite(x).all() or (np.abs(x) > FP16_MAX).any():
        raise ValueError(f"{what} outside float16's range")
    return x.astype(np.float16)


def _qweight(
    bits: int, packed: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, n: int, k: int
) -> QuantizedWeight:
    return QuantizedWeight(
        bits,
        GROUP,
        torch.from_numpy(np.ascontiguousarray(packed).reshape(n, -1)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(n, k // GROUP)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins).reshape(n, k // GROUP)),
        n,
        k,
    )


def q8_0(raw: np.ndarray, in_features: int) -> QuantizedWeight:
    b = _blocks(raw, GGMLQuantizationType.Q8_0, in_features)
    n = b.shape[0]
    return _qweight(8, b[..., 2:].view(np.int8), _f16(b[..., :2]), None, n, in_features)


def q4_0(raw: np.ndarray, in_features: int) -> QuantizedWeight:
    b = _blocks(raw, GGMLQuantizationType.Q4_0, in_features)
    d = _f16(b[..., :2])
    mins = _checked_f16(d.astype(np.float32) * -8.0, "Q4_0: -8 * d")
    return _qweight(4, b[..., 2:], d, mins, b.shape[0], in_features)


def q4_1(raw: np.ndarray, in_features: int) -> QuantizedWeight:
    b = _blocks(raw, GGMLQuantizationType.Q4_1, in_features)
    return _qweight(4, b[..., 4:], _f16(b[..., :2]), _f16(b[..., 2:4]), b.shape[0], in_features)


def q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of each super-block [..., 12] -> (sc, m), uint8 [..., 8] each, 6 bits.

    Bytes 0-3 hold sc 0-3 in their low 6 bits (and the top 2 bits of sc 4-7), bytes 4-7 the same
    for m, bytes 8-11 the low 4 bits of sc 4-7 (low nibble) and of m 4-7 (high nibble).
    """
    s = packed.reshape(*packed.shape[:-1], 3, 4)
    a, b, c = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, m


def q4_k(raw: np.ndarray, in_features: int) -> QuantizedWeight:
    b = _blocks(raw, GGMLQuantizationType.Q4_K, in_features)
    n, nb = b.shape[:2]
    d = _f16(b[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    sc, m = q4_k_scales_mins(b[..., 4:16])
    scales = _checked_f16(d * sc.astype(np.float32), "Q4_K: d * scale")  # [n, nb, 8]
    mins = _checked_f16(-(dmin * m.astype(np.float32)), "Q4_K: dmin * min")
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32)  # 4 x 32 bytes: sub-blocks 2i (low), 2i + 1 (high)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(n, nb, 8, 32)
    packed = q[..., :16] | (q[..., 16:] << 4)  # qlinear's order: weights i and i + 16 in byte i
    return _qweight(4, packed, scales, mins, n, in_features)


_CONVERTERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k}


def to_qweight(raw: np.ndarray, ggml_type: GGMLQuantizationType, in_features: int) -> QuantizedWeight:
    """A 2-D GGUF tensor's raw bytes [out, row bytes] -> QuantizedWeight [out, in_features]."""
    convert = _CONVERTERS.get(ggml_type.name)
    if convert is None:
        raise ValueError(
            f"{ggml_type.name} blocks have no QuantizedWeight form (supported: {list(_CONVERTERS)})"
        )
    return convert(raw, in_features)


def requantize_int8(raw: np.ndarray, ggml_type: GGMLQuantizationType, in_features: int) -> QuantizedWeight:
    """Any quantized GGUF tensor's raw bytes [out, row bytes] -> int8 with group 32 (module docstring)."""
    from gguf.quants import dequantize

    if in_features % GROUP:
        raise ValueError(f"{ggml_type.name}: {in_features} columns are not a multiple of {GROUP}")
    data = np.ascontiguousarray(raw, dtype=np.uint8)
    data = data.reshape(data.shape[0] if data.ndim > 1 else 1, -1)
    parts = []  # a few thousand rows at a time: an 8B model's LM head is 2 GB in float32
    for start in range(0, data.shape[0], REQUANT_ROWS):
        w = dequantize(data[start : start + REQUANT_ROWS], ggml_type).reshape(-1, in_features)
        if not np.isfinite(w).all():
            raise ValueError(f"{ggml_type.name}: blocks that dequantize to inf or NaN")
        parts.append(quantize_int8(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), GROUP))
    n = data.shape[0]
    return QuantizedWeight(
        8,
        GROUP,
        torch.cat([q.packed for q in parts]),
        torch.cat([q.scales for q in parts]),
        None,
        n,
        in_features,
    )


def to_qweight_as(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, in_features: int, bits: int
) -> QuantizedWeight:
    """A 2-D GGUF tensor as a QuantizedWeight of `bits` (load_bits of its matrix): its own blocks
    when its type has that width exactly, else requantized to int8."""
    if DIRECT_BITS.get(ggml_type.name) == bits:
        return to_qweight(raw, ggml_type, in_features)
    if bits != REQUANT_BITS or not is_quantized(ggml_type.name):
        raise ValueError(f"{ggml_type.name} blocks do not load as {bits}-bit weights")
    return requantize_int8(raw, ggml_type, in_features)


def map_rows(qw: QuantizedWeight, rows: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
    """The same weight with `rows` (a reordering of dim 0, e.g. loader.unpermute_rotary) applied to
    each of its parts."""
    return QuantizedWeight(
        qw.bits,
        qw.group,
        rows(qw.packed),
        rows(qw.scales),
        None if qw.mins is None else rows(qw.mins),
        qw.out_features,
        qw.in_features,
    )
