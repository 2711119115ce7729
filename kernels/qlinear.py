"""Weight-only quantized linear layers: int8 and int4 weights, dequantized inside the matmul.

Formats (one `QuantizedWeight` for both; GGUF's Q8_0, Q4_0 and Q4_1 blocks are special cases, so a
GGUF file's quantized tensors load into them without a 16-bit copy; see runtime/load/quantization.py):

* int8: symmetric, one float16 scale per output channel (group = K) or per group of `group`
  weights along K (Q8_0: group 32): weight = q * scale, q in -127..127.
* int4: asymmetric, group-wise (32, 64 or 128 weights along K): weight = q * scale + min, q in 0..15,
  float16 scale and min per group; two weights per byte, weight i of a group in the low nibble of
  byte i and weight i + group / 2 in the high one (Q4_1's layout; Q4_0 is min = -8 * scale).

`matmul` is the layer's forward: on CPU, for a few rows of float32/bfloat16 activations (the decode
case, bound by reading the weights), the C kernel kernels/csrc/qmatmul_cpu.c reads the quantized
weights directly, built per ISA level like every kernel here (kernels/isa.py); from GEMM_MIN_ROWS
rows (batched decode, prefill: bound by arithmetic) the GEMM of kernels/csrc/qgemm_cpu.c multiplies
int8 activation codes with the weight codes (`gemm_matmul`, same arithmetic as the small-M
kernel's int8-activation path below); where neither applies (no C compiler, the generic level,
float activations, widths not a multiple of 32, more than SMALL_M rows without the GEMM) the
weights are dequantized to the activation dtype (by the C library on CPU) and multiplied by torch
(`dequantize_matmul`; `reference_matmul` is the same in torch alone).

At the avx512 and avx2 levels the kernel also quantizes the activations, as llama.cpp does: each row
of x in blocks of ACT_BLOCK = 32 to int8 with one float scale per block (round to nearest), then
integer dot products of weight codes and activation codes (AVX512-VNNI `vpdpbusd`, or AVX2's
`vpmaddubsw` + `vpmaddwd` on every AVX2 CPU), scaled by the weight's and the block's scale. For
int4 the rounded activations only multiply the centred codes q - 8 (the rest, (min + 8 * scale) times
the group's activation sum, is exact; see quantize_rows in the C source), so the rounding error is
as small as int8's. `reference_q8_matmul` is that
arithmetic in torch (the kernel's specification, tested to float rounding); against the float
product `reference_matmul` it differs by the activation rounding (half a step of amax / 127 per
element). The generic level, widths that are not a multiple of 32, and `--qmatmul-activations float`
(KVPILOT_QMATMUL_ACTIVATIONS=float, kernels/switches.py) dequantize in float32 instead (the exact
product, slower).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvpilot.kernels import cbuild, cpu_ops, isa, switches, triton_qlinear

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "qmatmul_cpu.c"
GEMM_SOURCE = Path(__file__).parent / "csrc" / "qgemm_cpu.c"
CFLAGS = ["-O3", *cbuild.FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
METHODS = ("int8", "int4")
INT4_GROUPS = (32, 64, 128)
SMALL_M = (
    32  # rows up to which the C kernel beats dequantize + torch matmul (benchmarks/kernels_bench.py qmatmul)
)
# rows up to which a tiled weight takes the kernel where it beats every other path at any row count
# (one thread, benchmarks/kernels_bench.py qmatmul, docs/benchmarks.md): avx512 with VNNI (~2x the GEMM and
# torch's bf16 matmul at 8-512 rows), and int8 at avx2 (1.2-1.5x the GEMM, 1.2x torch's float32);
# elsewhere (int4 at avx2: the GEMM is faster from 64 rows) SMALL_M, then the GEMM on a row-layout copy
TILED_MAX_M = 8192
# rows up to which a tiled weight takes the float-activation tiled kernel (more: dequantize + torch's
# matmul, whose float32 GEMM blocks for the caches: even at 256 rows; benchmarks/kernels_bench.py qmatmul, tiled_float_act)
TILED_FLOAT_MAX_M = 128
# the same for bf16 activations on an int4 or int8 weight with AVX512-BF16 (kvpilot_qmatmul_tiled_bf16's vdpbf16ps):
# any row count (1.5-2.2x the float kernel, 1.6-3.2x dequantize + torch's float32 matmul at 64-2048 rows, one
# thread, SmolLM2's shapes: benchmarks/kernels_bench.py qmatmul --dtype float32, tiled_bf16_act)
TILED_BF16_MAX_M = TILED_MAX_M
# the same for int16 activations at the avx512 level (kvpilot_qmatmul_tiled_i16's 512-bit kernel: 1.3-2.3x
# dequantize + torch's float32 matmul at 128-2048 rows, one thread, SmolLM2's shapes on an AMD EPYC Zen 4;
# at avx2 its 256-bit kernel and MKL's sgemm are at parity from 512 rows: TILED_FLOAT_MAX_M there)
TILED_I16_MAX_M = TILED_MAX_M
ACT_BLOCK = 32  # activations quantized to int8 per block of this many (llama.cpp's Q8_0 block)


def int8_activations() -> bool:
    """The `qmatmul_activations` switch (kernels/switches.py): True for `int8` (the default: integer
    dot products), False for `int16`, `bf16` and `float` (the kernel multiplies the weights' exact values
    by the activations, rounded first to 16 bits per block of 32 for `int16`, to bfloat16 for `bf16`)."""
    return switches.current().int8_activations


def bf16_activations() -> bool:
    """The `qmatmul_activations` switch is `bf16`: every quantized matmul's activations are rounded to
    bfloat16 (to nearest even) and multiplied by the weights' exact values, summed in float32."""
    return switches.current().qmatmul_activations == "bf16"


def bf16_tiles(qw: QuantizedWeight) -> bool:
    """Whether kvpilot_qmatmul_tiled_bf16 multiplies `qw` with vdpbf16ps (int4 or int8, tiled, the
    avx512 level on a CPU with AVX512-BF16); elsewhere it runs the float kernel on the rounded
    activations."""
    return qw.tiled and qw.bits in (4, 8) and isa.bf16_dot(built_isa())


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x with every element rounded to bfloat16 (to nearest even), in x's dtype."""
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16).to(x.dtype)


I16_MAX = 32767  # int16 activations: a block's largest magnitude maps to this code


def round_i16(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """`reference_round_i16`'s rounding by the C library in one pass over x (kvpilot_round_i16: the torch
    form's gather, reductions and scatter cost as much as the matmul they precede on a long prefill),
    where it applies (CPU f32/bf16, K a multiple of 32); else the torch form."""
    k = x.shape[-1]
    if not (x.device.type == "cpu" and x.dtype in _DTYPES and k % ACT_BLOCK == 0 and available()):
        return reference_round_i16(x, qw)
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty_like(x2)
    lib = _library()
    rc = lib.kvpilot_round_i16(
        x2.data_ptr(),
        _DTYPES[x2.dtype],
        out.data_ptr(),
        x2.shape[0],
        k,
        qw.bits,
        qw.group,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"int16 activation rounding rejected its arguments (code {rc})")
    return out.reshape(x.shape)


def reference_round_i16(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [..., K] with each block of ACT_BLOCK features in `qw`'s storage order rounded to int16, one
    scale a block (d = max|x| / 32767, to nearest), in x's dtype: the activations
    kvpilot_qmatmul_tiled_i16 multiplies (`--qmatmul-activations int16`). The specification."""
    order, k = storage_order(qw), x.shape[-1]
    pad = -k % ACT_BLOCK  # a last, shorter block (K not a multiple of 32: the row kernel's formats)
    xf = F.pad(x.float()[..., order], (0, pad)).reshape(*x.shape[:-1], -1, ACT_BLOCK)
    amax = xf.abs().amax(-1, keepdim=True)
    top = torch.full_like(amax, I16_MAX)  # tensor / tensor: IEEE float32 divisions, as the kernel's (torch
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))  # takes a scalar's reciprocal first)
    rounded = (torch.round(xf * inv) * (amax / top)).reshape(*x.shape[:-1], k + pad)[..., :k]
    out = torch.empty_like(rounded)
    out[..., order] = rounded
    return out.to(x.dtype)


def round_activations(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x as the `qmatmul_activations` switch rounds it before a float product with `qw`'s exact values
    (bf16, int16), for the paths that multiply x as given; x itself for int8 and float."""
    mode = switches.current().qmatmul_activations
    if mode == "bf16":
        return round_bf16(x)
    return round_i16(x, qw) if mode == "int16" else x


_DTYPES = cpu_ops.ACTIVATION_CODES


@dataclass
class QuantizedWeight:
    """A [N, K] weight kept quantized: `packed` int8 [N, K] (bits 8) or uint8 [N, K / 2] (bits 4),
    `scales` (and for int4 `mins`) float16 [N, K / group]."""

    bits: int
    group: int
    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    out_features: int
    in_features: int
    tiled: bool = False  # bytes in the CPU kernel's tiled layout (`tile`); `untile` restores rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.tiled:
            return untile(self).dequantize(dtype)
        n, k, g = self.out_features, self.in_features, self.group
        s = self.scales.float().reshape(n, k // g, 1)
        if self.bits == 8:
            w = self.packed.float().reshape(n, k // g, g) * s
        else:
            assert self.mins is not None
            p = self.packed.reshape(n, k // g, g // 2)
            q = torch.cat([p & 15, p >> 4], dim=-1).float()
            w = q * s + self.mins.float().reshape(n, k // g, 1)
        return w.reshape(n, k).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales] + ([self.mins] if self.mins is not None else [])

    def move_(self, device: torch.device) -> None:
        """In place: every module holding this weight (a tied LM head and embedding) sees it moved."""
        self.packed = self.packed.to(device)
        self.scales = self.scales.to(device)
        self.mins = None if self.mins is None else self.mins.to(device)

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(
            self.bits,
            self.group,
            self.packed.to(device),
            self.scales.to(device),
            None if self.mins is None else self.mins.to(device),
            self.out_features,
            self.in_features,
            self.tiled,
        )


# ---------------------------------------------------------------------------------------------
# The tiled layout: TILE_ROWS rows' codes interleaved, so that one vector spans TILE_ROWS rows
# (the C source's "tiled layout" comment). A permutation of the row layout's bytes, scales and
# mins: same tensors, same shapes, same bytes in memory.

TILE_ROWS = 16
_TILE_WORD = 4  # bytes of a row next to each other in a code vector (one integer dot product)


def _tile_view(qw: QuantizedWeight) -> tuple[int, int, int]:
    """(tiles, blocks a row, bytes a row's block) of a weight's codes."""
    block_bytes = ACT_BLOCK if qw.bits == 8 else ACT_BLOCK // 2
    return qw.out_features // TILE_ROWS, qw.in_features // ACT_BLOCK, block_bytes


def tile_applies(qw: QuantizedWeight) -> bool:
    """Whether the kernel loaded here takes `qw` in the tiled layout: on CPU, rows a multiple of
    TILE_ROWS, a format the tiled kernels take (int8 per channel, int4/int8 groups a power-of-two
    multiple of 32), at the avx512 or avx2 level. Both activation modes have a tiled kernel
    (kvpilot_qmatmul_tiled: int8 activations; kvpilot_qmatmul_tiled_float: float, the exact product)."""
    return (
        not qw.tiled
        and qw.packed.device.type == "cpu"
        and qw.out_features % TILE_ROWS == 0
        and qw.in_features % ACT_BLOCK == 0
        and tiled_format(qw)
        and available()
    )


def _permute_rows(t: torch.Tensor, tiles: int, inner: tuple[int, ...], perm: tuple[int, ...]) -> torch.Tensor:
    return t.reshape(tiles, *inner).permute(*perm).contiguous()


def tile(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` in the tiled layout: codes [tiles, blocks, block bytes / 4, TILE_ROWS, 4], scales and
    mins [tiles, groups, TILE_ROWS] (flattened to the row layout's shapes)."""
    tiles, nb, bb = _tile_view(qw)
    r, w = TILE_ROWS, _TILE_WORD
    packed = _permute_rows(qw.packed, tiles, (r, nb, bb // w, w), (0, 2, 3, 1, 4)).reshape(qw.packed.shape)

    def rows_last(t: torch.Tensor) -> torch.Tensor:
        return _permute_rows(t, tiles, (r, t.shape[1]), (0, 2, 1)).reshape(t.shape)

    mins = None if qw.mins is None else rows_last(qw.mins)
    return QuantizedWeight(
        qw.bits, qw.group, packed, rows_last(qw.scales), mins, qw.out_features, qw.in_features, True
    )


def untile(qw: QuantizedWeight) -> QuantizedWeight:
    """The row layout of a tiled weight (a copy; `qw` itself when it is not tiled)."""
    if not qw.tiled:
        return qw
    tiles, nb, bb = _tile_view(qw)
    r, w = TILE_ROWS, _TILE_WORD
    packed = _permute_rows(qw.packed, tiles, (nb, bb // w, r, w), (0, 3, 1, 2, 4)).reshape(qw.packed.shape)

    def rows_first(t: torch.Tensor) -> torch.Tensor:
        return _permute_rows(t, tiles, (t.shape[1], r), (0, 2, 1)).reshape(t.shape)

    mins = None if qw.mins is None else rows_first(qw.mins)
    return QuantizedWeight(
        qw.bits, qw.group, packed, rows_first(qw.scales), mins, qw.out_features, qw.in_features
    )


def tiled_rows(qw: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """Rows `rows` of a tiled weight in the row layout (an embedding lookup in a tied LM head),
    gathered without untiling the rest."""
    tiles, nb, bb = _tile_view(qw)
    r, w = TILE_ROWS, _TILE_WORD
    tile_of, lane = rows // r, rows % r
    packed = qw.packed.reshape(tiles, nb, bb // w, r, w)[tile_of, :, :, lane].reshape(len(rows), -1)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(tiles, t.shape[1], r)[tile_of, :, lane]

    mins = None if qw.mins is None else pick(qw.mins)
    return QuantizedWeight(qw.bits, qw.group, packed, pick(qw.scales), mins, len(rows), qw.in_features)


def check_shape(method: str, in_features: int, group: int) -> str | None:
    """Why a [*, in_features] weight cannot take `method` with this group size (None when it can)."""
    if method not in METHODS:
        return f"unknown quantization {method!r} (expected {', '.join(METHODS)})"
    if method == "int4":
        if group not in INT4_GROUPS:
            return f"int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, got {group}"
        if in_features % group:
            return f"in_features {in_features} is not a multiple of the int4 group size {group}"
    return None


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with one scale per output channel (group None) or per `group` weights."""
    n, k = w.shape
    g = group or k
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the int8 group size {g}")
    wg = w.detach().float().reshape(n, k // g, g)
    scale = (wg.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, wg / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127)
    return QuantizedWeight(8, g, q.to(torch.int8).reshape(n, k), scale.reshape(n, k // g), None, n, k)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Asymmetric group-wise int4 (Q4_1-style): per group, min and scale = (max - min) / 15."""
    n, k = w.shape
    reason = check_shape("int4", k, group)
    if reason:
        raise ValueError(reason)
    wg = w.detach().float().reshape(n, k // group, group)
    lo = wg.amin(dim=-1, keepdim=True)
    hi = wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).to(torch.float16)
    mins = lo.to(torch.float16)
    s, m = scale.float(), mins.float()
    q = torch.where(s > 0, (wg - m) / torch.where(s > 0, s, 1.0), 0.0).round().clamp(0, 15).to(torch.uint8)
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return QuantizedWeight(
        4, group, packed.reshape(n, k // 2), scale.reshape(n, -1), mins.reshape(n, -1), n, k
    )


def quantize(w: torch.Tensor, method: str, group: int) -> QuantizedWeight:
    """int8 per output channel, or int4 with `group` weights per scale and min."""
    return quantize_int8(w) if method == "int8" else quantize_int4(w, group)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.kvpilot_qmatmul.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i, i]
    lib.kvpilot_qmatmul.restype = i
    lib.kvpilot_qmatmul_tiled.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qmatmul_tiled.restype = i
    lib.kvpilot_qmatmul_tiled_float.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qmatmul_tiled_float.restype = i
    lib.kvpilot_qmatmul_tiled_bf16.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qmatmul_tiled_bf16.restype = i
    lib.kvpilot_qmatmul_tiled_i16.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qmatmul_tiled_i16.restype = i
    lib.kvpilot_round_i16.argtypes = [p, i, p, long, long, i, i, i]
    lib.kvpilot_round_i16.restype = i
    lib.kvpilot_dequantize.argtypes = [p, i, i, p, p, long, long, p, i, i]
    lib.kvpilot_dequantize.restype = i
    lib.kvpilot_qmoe.argtypes = [p, i, p, long, long, long, i, p, p, long, long, p, p, p, p, p, p, i, i, i, i]
    lib.kvpilot_qmoe.restype = i


EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "dequantizing for torch matmuls")
_library = EXTENSION.library
built_isa = EXTENSION.built_isa
available = EXTENSION.available


def _declare_gemm(lib: ctypes.CDLL) -> None:
    p, i, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.kvpilot_qgemm.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qgemm.restype = i


GEMM_EXTENSION = cbuild.Extension(
    GEMM_SOURCE, CFLAGS, _declare_gemm, "dequantize + torch matmul for many rows"
)
# Per ISA level and weight bits, the row count from which the int8-activation GEMM beats both the
# small-M kernel and dequantize + torch's matmul (benchmarks/kernels_bench.py qmatmul --gemm, SmolLM2's
# shapes, one thread; docs/benchmarks.md, kernels). Levels or formats not listed never take it.
GEMM_MIN_ROWS: dict[str, dict[int, int]] = {"avx2": {4: 8, 8: 8}, "avx512": {4: 8, 8: 32}}
GEMM_MAX_K = 8 * ACT_BLOCK * (1024 - 3)  # the widest input the GEMM's chunk table holds (MAXC in the C)


def _kernel_args(
    x2: torch.Tensor, out: torch.Tensor, b: torch.Tensor | None, qw: QuantizedWeight
) -> tuple[int | None, ...]:
    """The arguments every CPU quantized-matmul entry point takes first, in order: x, its dtype, out,
    bias, M, K, N, codes, bits, group, scales, mins, threads."""
    return (
        x2.data_ptr(), _DTYPES[x2.dtype], out.data_ptr(), None if b is None else b.data_ptr(),
        x2.shape[0], qw.in_features, qw.out_features, qw.packed.data_ptr(), qw.bits, qw.group,
        qw.scales.data_ptr(), None if qw.mins is None else qw.mins.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip


def gemm_applies(x: torch.Tensor, qw: QuantizedWeight, level: str | None = None) -> bool:
    """Whether `matmul` takes the int8-activation GEMM (kernels/csrc/qgemm_cpu.c) for this input:
    CPU f32/bf16, int8 activations on, K and the group multiples of 32, and at least as many rows as
    the level's GEMM needs to be the fastest path for this format (GEMM_MIN_ROWS)."""
    k = x.shape[-1]
    lv = level or isa.selected()
    min_rows = GEMM_MIN_ROWS.get(lv, {}).get(qw.bits)
    return (
        int8_activations()
        and min_rows is not None
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and qw.packed.device.type == "cpu"
        and k % ACT_BLOCK == 0
        and k <= GEMM_MAX_K
        and qw.group % ACT_BLOCK == 0
        and (x.numel() // k if k else 0) >= min_rows
        and GEMM_EXTENSION.available(lv)
        and GEMM_EXTENSION.built_isa(lv) == lv
    )


def gemm_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *, level: str | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) by the int8-activation GEMM, any number of rows; the arithmetic is
    `reference_q8_matmul`'s (to float rounding). ValueError where the level has no such path."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {qw.in_features}")
    qw = untile(qw)  # the GEMM reads the row layout (a tiled weight: a copy of its codes)
    x2 = x.reshape(-1, qw.in_features).contiguous()
    out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype)
    b = None if bias is None else bias.to(x.dtype).contiguous()
    rc = GEMM_EXTENSION.library(level).kvpilot_qgemm(*_kernel_args(x2, out, b, qw))
    if rc == -2:
        raise ValueError(
            "the int8-activation GEMM does not apply here (generic ISA level, K or the group not a "
            f"multiple of 32, or K above {GEMM_MAX_K})"
        )
    if rc != 0:
        raise ValueError(f"quantized GEMM kernel rejected its arguments (code {rc})")
    return out.reshape(*x.shape[:-1], qw.out_features)


def max_kernel_rows(qw: QuantizedWeight) -> int:
    """The most rows `matmul` gives the small-M / tiled C kernel for this weight (more: the GEMM or
    dequantize + torch)."""
    if not qw.tiled:
        return SMALL_M
    level = built_isa()  # read from the library once per level (cbuild.Extension), not a ctypes call
    if not int8_activations():  # the float, bf16 and int16 tiled kernels: each has its own crossover
        if bf16_activations() and bf16_tiles(qw):
            return TILED_BF16_MAX_M
        i16_wide = switches.current().qmatmul_activations == "int16" and level == "avx512"
        return TILED_I16_MAX_M if i16_wide else TILED_FLOAT_MAX_M
    vnni = level == "avx512" and "avx512_vnni" in isa.cpu_features()
    return TILED_MAX_M if vnni or (level == "avx2" and qw.bits == 8) else SMALL_M


def kernel_applies(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether `matmul` takes the C kernel for this input (CPU, f32/bf16, at most max_kernel_rows)."""
    k = x.shape[-1]
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and qw.packed.device.type == "cpu"
        and available()
        and 0 < (x.numel() // k if k else 0) <= max_kernel_rows(qw)
    )


def kernel_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *, level: str | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) by the C kernel, in x's dtype (float32 or bfloat16, on CPU)."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {qw.in_features}")
    x2 = x.reshape(-1, qw.in_features).contiguous()
    out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype)
    b = None if bias is None else bias.to(x.dtype).contiguous()
    int8 = int8_activations()
    lib = _library(level)
    # a tiled weight: the tiled kernel of the activation mode; the row kernel takes the mode as its
    # last argument (float, on activations rounded here for bf16)
    extra: tuple[int, ...] = ()
    if qw.tiled:
        fn = tiled_kernel(lib)
    else:
        fn, extra = lib.kvpilot_qmatmul, (int(int8),)
        x2 = round_activations(x2, qw)
    rc = fn(*_kernel_args(x2, out, b, qw), *extra)
    if rc != 0:
        raise ValueError(f"quantized matmul kernel rejected its arguments (code {rc})")
    return out.reshape(*x.shape[:-1], qw.out_features)


def tiled_kernel(lib: ctypes.CDLL) -> Any:
    """The library's tiled kernel of the `qmatmul_activations` switch (one signature for all four)."""
    if int8_activations():
        return lib.kvpilot_qmatmul_tiled
    if switches.current().qmatmul_activations == "int16":
        return lib.kvpilot_qmatmul_tiled_i16
    return lib.kvpilot_qmatmul_tiled_bf16 if bf16_activations() else lib.kvpilot_qmatmul_tiled_float


def reference_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: dequantize to x's dtype, then torch's matmul."""
    return F.linear(x, qw.dequantize(x.dtype), bias)


def dequantize_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`reference_matmul` with the dequantization done by the C library on CPU (one pass over the
    bytes, rows in parallel; the same values as QuantizedWeight.dequantize): the many-row path."""
    if not (x.device.type == "cpu" and qw.packed.device.type == "cpu" and x.dtype in _DTYPES and available()):
        return reference_matmul(x, qw, bias)
    qw = untile(qw)
    w = torch.empty(qw.out_features, qw.in_features, dtype=x.dtype)
    rc = _library().kvpilot_dequantize(
        qw.packed.data_ptr(),
        qw.bits,
        qw.group,
        qw.scales.data_ptr(),
        None if qw.mins is None else qw.mins.data_ptr(),
        qw.out_features,
        qw.in_features,
        w.data_ptr(),
        _DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"dequantize kernel rejected its arguments (code {rc})")
    return F.linear(x, w, bias)


def storage_order(qw: QuantizedWeight) -> torch.Tensor:
    """Input-feature index of each position in the weight's storage order, the order in which the
    kernel reads codes and lays out activation blocks: int8 in place; int4 per group of g weights as
    16-byte chunks, chunk c = weights 16c..16c+15 (low nibbles), then g/2 + 16c.. (high nibbles)."""
    k = qw.in_features
    pos = torch.arange(k)
    if qw.bits == 8 or qw.group == ACT_BLOCK:
        return pos
    g, j = pos // qw.group, pos % qw.group
    high = (j % ACT_BLOCK >= 16).long()
    return g * qw.group + high * (qw.group // 2) + (j // ACT_BLOCK) * 16 + j % 16


def codes(qw: QuantizedWeight) -> torch.Tensor:
    """The weight's integer codes [N, K] in storage order (int8: -127..127; int4: 0..15)."""
    qw = untile(qw)
    if qw.bits == 8:
        return qw.packed.to(torch.int32)
    p = qw.packed.reshape(qw.out_features, qw.in_features // 32, 16).to(torch.int32)
    return torch.cat([p & 15, p >> 4], dim=-1).reshape(qw.out_features, qw.in_features)


def tiled_format(qw: QuantizedWeight, level: str | None = None) -> bool:
    """Whether the kernels at `level` (default: the one loaded) take `qw`'s format in the tiled
    layout and on the int8-activation path: groups a power-of-two multiple of 32 (or one a row), at
    the avx512 or avx2 level (group_shift in the C source)."""
    groups = qw.in_features // qw.group
    shape_ok = qw.group % ACT_BLOCK == 0 and (groups == 1 or (qw.group // ACT_BLOCK).bit_count() == 1)
    return shape_ok and (level or built_isa()) in ("avx512", "avx2")


def q8_path_applies(qw: QuantizedWeight, level: str | None = None) -> bool:
    """Whether the kernel at `level` (default: the one loaded) takes the int8-activation path."""
    return int8_activations() and tiled_format(qw, level)


def reference_q8_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's int8-activation arithmetic in torch (float64 sums): its specification."""
    qw = untile(qw)
    n, k, blk = qw.out_features, qw.in_features, ACT_BLOCK
    xf = x.reshape(-1, k).float()
    xb = xf[:, storage_order(qw)].reshape(-1, k // blk, blk)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    xq = torch.round(xb * inv)  # round half to even, as lrintf
    wq = codes(qw).reshape(n, k // blk, blk).double()
    dots = torch.einsum("mbi,nbi->mnb", xq.double(), wq)  # exact integers
    ws = qw.scales.double().repeat_interleave(qw.group // blk, dim=1)  # [N, K / 32]
    out = (dots * ws.unsqueeze(0) * scale.squeeze(-1).double().unsqueeze(1)).sum(-1)
    if qw.mins is not None:  # min * xs + 8 * scale * rs, rs = xs - the quantized group sum
        xs = xf.double().reshape(-1, k // qw.group, qw.group).sum(-1)
        quantized = (
            (xq.sum(-1) * scale.squeeze(-1)).double().reshape(-1, k // qw.group, qw.group // blk).sum(-1)
        )
        out = out + xs @ qw.mins.double().t() + 8.0 * (xs - quantized) @ qw.scales.double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if qw.tiled and kernel_applies(x, qw):  # up to max_kernel_rows: faster than the GEMM there
        return kernel_matmul(x, qw, bias)
    if gemm_applies(x, qw):
        return gemm_matmul(x, qw, bias)
    if kernel_applies(x, qw):
        return kernel_matmul(x, qw, bias)
    x = round_activations(x, qw)  # the paths below multiply x as given
    if triton_qlinear.applies(x, qw):  # CUDA: kernels/triton_qlinear.py dequantizes tiles in registers
        return triton_qlinear.qmatmul(x, qw, bias)
    return dequantize_matmul(x, qw, bias)


# ---------------------------------------------------------------------------------------------
# A Mixture-of-Experts layer's quantized experts in one call (kvpilot_qmoe in the C source)


@dataclass
class ExpertTable:
    """One layer's quantized experts as the pointer arrays the fused C call takes (built once per
    layer; `experts` keeps the tensors alive)."""

    bits: int
    group: int
    hidden: int
    inter: int
    pointers: tuple[ctypes.Array[ctypes.c_void_p], ...]
    experts: tuple[list[QuantizedWeight], list[QuantizedWeight]]
    tiled: bool = False  # every expert in the tiled layout (else every one in the row layout)


def expert_table(w13: list[QuantizedWeight], w2: list[QuantizedWeight]) -> ExpertTable | None:
    """The table for experts of one format (all int8 per channel, or all int4 with one group), on CPU;
    None when they differ or are not on the CPU (then `moe_grouped`'s per-expert loop runs them)."""
    first, every = w13[0], w13 + w2
    if any(q.bits != first.bits or q.packed.device.type != "cpu" or q.tiled != first.tiled for q in every):
        return None
    if first.bits == 8 and any(q.group != q.in_features for q in every):
        return None  # int8: per channel only
    if first.bits == 4 and any(q.group != first.group for q in every):
        return None

    def array(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p]:
        return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])

    pointers = tuple(
        array([part(q) for q in experts])
        for experts in (w13, w2)
        for part in (lambda q: q.packed, lambda q: q.scales, lambda q: q.mins)
    )
    return ExpertTable(
        first.bits, first.group, first.in_features, w2[0].in_features, pointers, (w13, w2), first.tiled
    )


def fused_experts(
    x: torch.Tensor, table: ExpertTable, weights: torch.Tensor, ids: torch.Tensor, expert_offset: int = 0
) -> torch.Tensor | None:
    """`moe_grouped`'s result on quantized experts in one C call, or None where it does not apply
    (not CPU f32/bf16, float activations, a format without the int8-activation path, or more rows
    per expert on average than the kernel takes (max_kernel_rows: SMALL_M, or any prefill for
    tiled experts with AVX512-VNNI): there dequantize + matmul per expert is faster)."""
    t, k = ids.shape
    experts = len(table.experts[0])
    if not (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and int8_activations()
        and t * k <= max_kernel_rows(table.experts[0][0]) * experts
        and available()
        and built_isa() in ("avx512", "avx2")
    ):
        return None
    x2 = x.contiguous()
    out = torch.empty_like(x2)
    ids64 = ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    p = table.pointers
    rc = _library().kvpilot_qmoe(
        x2.data_ptr(),
        _DTYPES[x.dtype],
        out.data_ptr(),
        t,
        table.hidden,
        table.inter,
        k,
        ids64.data_ptr(),
        w.data_ptr(),
        experts,
        expert_offset,
        *p,
        table.bits,
        table.group,
        int(table.tiled),
        torch.get_num_threads(),
    )
    if rc == -2:
        return None
    if rc != 0:
        raise ValueError(f"fused experts kernel rejected its arguments (code {rc})")
    return out
