"""Weight-only quantized linear layers: int8 and int4 weights, dequantized inside the matmul.

Formats (one `QuantizedWeight` for both; GGUF's Q8_0, Q4_0 and Q4_1 blocks are special cases, so a
GGUF file's quantized tensors load into them without a 16-bit copy; see runtime/quantization.py):

* int8: symmetric, one float16 scale per output channel (group = K) or per group of `group`
  weights along K (Q8_0: group 32): weight = q * scale, q in -127..127.
* int4: asymmetric, group-wise (32, 64 or 128 weights along K): weight = q * scale + min, q in 0..15,
  float16 scale and min per group; two weights per byte, weight i of a group in the low nibble of
  byte i and weight i + group / 2 in the high one (Q4_1's layout; Q4_0 is min = -8 * scale).

`matmul` is the layer's forward: on CPU, for up to SMALL_M rows of float32/bfloat16 activations (the
decode case, bound by reading the weights), the C kernel kernels/csrc/qmatmul_cpu.c reads the
quantized weights directly, built per ISA level like every kernel here (kernels/isa.py); otherwise,
and as the reference the kernel is tested against, the weights are dequantized to the activation
dtype and multiplied by torch (`reference_matmul`).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "qmatmul_cpu.c"
CFLAGS = ["-O3", *cbuild.FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
METHODS = ("int8", "int4")
INT4_GROUPS = (32, 64, 128)
SMALL_M = 16  # rows up to which the C kernel beats dequantize + torch matmul (see docs/runtime.md)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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

    @property
    def nbytes(self) -> int:
        parts = [self.packed, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(
            self.bits,
            self.group,
            self.packed.to(device),
            self.scales.to(device),
            None if self.mins is None else self.mins.to(device),
            self.out_features,
            self.in_features,
        )


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
    lib.kvpilot_qmatmul.argtypes = [p, i, p, p, long, long, long, p, i, i, p, p, i]
    lib.kvpilot_qmatmul.restype = i


EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "dequantizing for torch matmuls")
_library = EXTENSION.library
built_isa = EXTENSION.built_isa
available = EXTENSION.available


def kernel_applies(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether `matmul` takes the C kernel for this input (CPU, f32/bf16, at most SMALL_M rows)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and qw.packed.device.type == "cpu"
        and x.dtype in _DTYPES
        and 0 < rows <= SMALL_M
        and available()
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
    rc = _library(level).kvpilot_qmatmul(
        x2.data_ptr(),
        _DTYPES[x.dtype],
        out.data_ptr(),
        None if b is None else b.data_ptr(),
        x2.shape[0],
        qw.in_features,
        qw.out_features,
        qw.packed.data_ptr(),
        qw.bits,
        qw.group,
        qw.scales.data_ptr(),
        None if qw.mins is None else qw.mins.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"quantized matmul kernel rejected its arguments (code {rc})")
    return out.reshape(*x.shape[:-1], qw.out_features)


def reference_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: dequantize to x's dtype, then torch's matmul."""
    return F.linear(x, qw.dequantize(x.dtype), bias)


def matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if kernel_applies(x, qw):
        return kernel_matmul(x, qw, bias)
    return reference_matmul(x, qw, bias)
