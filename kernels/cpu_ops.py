"""Fused RMSNorm (+ residual), rotary embedding, silu(gate) * up and the KV write for CPUs
(kernels/csrc/cpu_ops.c), built on first use.

At decode batch sizes each of these is a handful of small torch ops per layer whose dispatch costs more
than their arithmetic (together ~19% of a decode step on SmolLM2; docs/benchmarks.md). The C versions
round every intermediate as the torch code in runtime/models/layers.py does, so results match it bit
for bit in float32 and bfloat16 except for the summation order of RMSNorm's mean. The torch code stays
the path for CUDA, other dtypes, and machines without a C compiler (`available()` is False there).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvpilot.kernels import cbuild, quant

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
# no -ffast-math, no FMA contraction: the rounding must follow torch's op by op
CFLAGS = [
    "-O3",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=gnu11",
]
# element type codes (kernels/csrc/dtypes.h): the activations' dtypes, then the KV caches' others
DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
    torch.float8_e4m3fn: 4,
}
# the activations' codes, which every CPU extension takes (cpu_decoder, cpu_moe, qlinear use this one)
ACTIVATION_CODES = {dt: DTYPE_CODES[dt] for dt in (torch.float32, torch.bfloat16)}
_DTYPES = ACTIVATION_CODES
QUANTIZED = (torch.int8, torch.float8_e4m3fn)  # caches with float16 scales (kernels/quant.py)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.kvpilot_rms_norm.argtypes = [p, p, p, p, p, i, long, i, f, i]
    lib.kvpilot_rms_norm.restype = i
    lib.kvpilot_rotary.argtypes = [p, p, long, long, p, p, i, long, i, i, i, i, long, i]
    lib.kvpilot_rotary.restype = i
    lib.kvpilot_write_kv.argtypes = [p, p, long, long, p, p, p, p, p, p, p, i, i, long, i, i, i, long]
    lib.kvpilot_write_kv.restype = i
    lib.kvpilot_silu_mul.argtypes = [p, p, i, long, long, i]
    lib.kvpilot_silu_mul.restype = i


# one build per ISA level (kernels/isa.py); the C code is auto-vectorized for it
EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "using torch ops")
_library = EXTENSION.library
built_isa = EXTENSION.built_isa
available = EXTENSION.available


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these tensors: CPU, float32 or bfloat16, one dtype, contiguous."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in _DTYPES
        and all(t.dtype == first.dtype and t.is_contiguous() and t.device.type == "cpu" for t in tensors)
        and available()
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    level: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(s), s) with s = x + residual (or x): RMSNorm.forward's contract, in one call."""
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    rc = _library(level).kvpilot_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if residual is None else total.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        _DTYPES[x.dtype],
        x.numel() // hidden,
        hidden,
        float(eps),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rms_norm kernel rejected its arguments (code {rc})")
    return out, total


def rotary_supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q [T, Hq, D] / k [T, Hk, D] on CPU in float32 or bfloat16, each head's D values contiguous and
    heads adjacent within a token (a fused QKV projection's split views qualify)."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == q.dtype
        and q.dim() == 3
        and k.dim() == 3
        and q.stride()[1:] == (q.shape[2], 1)
        and k.stride()[1:] == (k.shape[2], 1)
        and available()
    )


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    *,
    level: str | None = None,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rotate-half on the first rotary_dim dims)."""
    pos = positions.to(torch.int64).contiguous()
    table = cos_sin_cache.to(torch.float32).contiguous()
    rc = _library(level).kvpilot_rotary(
        q.data_ptr(),
        k.data_ptr(),
        q.stride(0),
        k.stride(0),
        pos.data_ptr(),
        table.data_ptr(),
        _DTYPES[q.dtype],
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        rotary_dim,
        table.shape[0],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"rotary kernel rejected its arguments (code {rc}: bad shape or a position out of range)"
        )


def write_kv_supports(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Whether `write_kv_` takes these: CPU, float32/bfloat16 activations, k/v [T, Hk, D] with heads
    adjacent within a token; caches of the activations' dtype or bfloat16 ones, or int8 / float8 e4m3fn
    ones with contiguous [blocks, block_size, Hk] float16 scales (kernels/quant.py)."""
    quantized = k_cache.dtype in QUANTIZED
    scales_ok = (
        k_scale is not None
        and v_scale is not None
        and all(
            s.dtype == quant.SCALE_DTYPE and s.is_contiguous() and s.shape == k_cache.shape[:3]
            for s in (k_scale, v_scale)
        )
        if quantized
        else k_scale is None and v_scale is None and k_cache.dtype in (k.dtype, torch.bfloat16)
    )
    return (
        k.device.type == "cpu"
        and k.dtype in _DTYPES
        and v.dtype == k.dtype
        and v_cache.dtype == k_cache.dtype
        and scales_ok
        and k.dim() == v.dim() == 3
        and k.stride()[1:] == (k.shape[2], 1)
        and v.stride()[1:] == (v.shape[2], 1)
        and available()
    )


def write_kv_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    level: str | None = None,
) -> None:
    """Write k, v [T, Hk, D] into slots of the [blocks, block_size, Hk, D] caches (any strides: the
    tiled CPU layouts are views); negative slots are padding. `attention.write_kv`'s contract in one
    call instead of a dozen indexing ops per layer: a copy, or for an int8 / float8 cache each head
    quantized exactly as quant.quantize does, its scale written to k_scale / v_scale."""
    slots = slot_mapping.to(torch.int64).contiguous()
    strides = torch.tensor([*k_cache.stride(), *v_cache.stride()], dtype=torch.int64)
    nb, bs, hk, d = k_cache.shape
    rc = _library(level).kvpilot_write_kv(
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        strides.data_ptr(),
        strides.data_ptr() + 4 * 8,
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
        slots.data_ptr(),
        _DTYPES[k.dtype],
        DTYPE_CODES[k_cache.dtype],
        k.shape[0],
        hk,
        d,
        bs,
        nb * bs,
    )
    if rc == -2:
        raise ValueError("write_kv kernel rejected its arguments (code -2: a slot out of range)")
    if rc != 0:
        raise ValueError(f"write_kv kernel rejected its arguments (code {rc})")


def silu_mul(gate_up: torch.Tensor, *, level: str | None = None) -> torch.Tensor:
    """[..., 2 * I] (gate, up) -> silu(gate) * up in one call (`supports(gate_up)` first)."""
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    rc = _library(level).kvpilot_silu_mul(
        gate_up.data_ptr(), out.data_ptr(), _DTYPES[gate_up.dtype], gate_up.numel() // (2 * inter), inter,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"silu_mul kernel rejected its arguments (code {rc})")
    return out
