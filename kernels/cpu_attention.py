"""The CPU paged-attention kernel (kernels/csrc/paged_attention_cpu.c), built on first use.

It reads K/V in place through the block tables instead of gathering them into a copy, which is what
dominates the torch reference path on CPUs. The shared library is compiled once per source, compiler,
ISA level (kernels/isa.py: avx512, avx2 or generic, chosen from the CPU's features or forced with
KVPILOT_CPU_ISA) and CPU into ~/.cache/kvpilot/kernels (or $KVPILOT_KERNEL_CACHE) and loaded with
ctypes; when no C compiler is available the runtime falls back to the torch reference path. The
vectorized path (head_dim a multiple of 16 up to 256, block 16, K transposed, up to 24 query heads a KV
head) exists at the avx512 and avx2 levels.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvpilot.kernels import cbuild, cpu_ops
from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer, write_kv

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
CFLAGS = ["-O3", *cbuild.FAST_MATH, "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
KernelBuildError = cbuild.KernelBuildError
_DTYPES = cpu_ops.DTYPE_CODES


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvpilot_paged_attention
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, i, p, p, p, i, i, i, p, p, p, i, p, p, i, i, i, i, i, f, i, i]
    fn.restype = ctypes.c_int
    probe = lib.kvpilot_fast_path
    probe.argtypes = [i, i, i, i, i, i]
    probe.restype = ctypes.c_int


EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "using the torch reference path")
_library = EXTENSION.library
built_isa = EXTENSION.built_isa
available = EXTENSION.available


def build(compiler: str | None = None, level: str | None = None) -> Path:
    """Compile the kernel for an ISA level (default: isa.selected()) and return the library's path."""
    return EXTENSION.build(level, compiler)


def k_transposed(k: torch.Tensor) -> bool:
    """True for a [NB, BS, H, D] view of [NB, H, D, BS] storage (see transposed_k_cache)."""
    if k.is_contiguous():
        return False
    _, bs, h, d = k.shape
    if k.stride() != (h * d * bs, 1, d * bs, bs):
        raise ValueError(f"unsupported K cache strides {k.stride()} for shape {tuple(k.shape)}")
    return True


def v_head_major(v: torch.Tensor) -> bool:
    """True for a [NB, BS, H, D] view of [NB, H, BS, D] storage (see head_major_v_cache)."""
    if v.is_contiguous():
        return False
    _, bs, h, d = v.shape
    if v.stride() != (h * bs * d, d, bs * d, 1):
        raise ValueError(f"unsupported V cache strides {v.stride()} for shape {tuple(v.shape)}")
    return True


def head_major_v_cache(
    num_blocks: int, block_size: int, num_heads: int, head_dim: int, **kw: object
) -> torch.Tensor:
    """V storage as [NB, H, BS, D] (each block's rows grouped by head), as a [NB, BS, H, D] view.

    With transposed_k_cache, one (block, head) pair's keys and values are two contiguous tiles, which
    the kernel streams; in the [NB, BS, H, D] layout a head's rows are strided by H * D elements.
    """
    storage = torch.zeros(num_blocks, num_heads, block_size, head_dim, **kw)  # type: ignore[call-overload]
    return storage.permute(0, 2, 1, 3)


def transposed_k_cache(
    num_blocks: int, block_size: int, num_heads: int, head_dim: int, **kw: object
) -> torch.Tensor:
    """K storage as [NB, H, D, BS] (K^T per block and head), returned as a [NB, BS, H, D] view."""
    storage = torch.zeros(num_blocks, num_heads, head_dim, block_size, **kw)  # type: ignore[call-overload]
    return storage.permute(0, 3, 1, 2)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fast_path(num_q_heads: int, cache: KVCacheLayer, level: str | None = None) -> bool:
    """Whether the build for `level` takes the vectorized (AVX-512 or AVX2) path for these heads and cache."""
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    return bool(
        _library(level).kvpilot_fast_path(
            num_q_heads,
            int(num_kv_heads),
            int(head_dim),
            int(block_size),
            _DTYPES[cache.k.dtype],
            int(k_transposed(cache.k)),
        )
    )


def describe_path(num_q_heads: int, cache: KVCacheLayer) -> tuple[bool, str]:
    """(whether the vectorized path runs these heads and this cache, a line that says which path and,
    for the portable loop, what the vectorized one needs): the engine logs it once."""
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    level = built_isa()
    shape = (
        f"{num_q_heads} query / {num_kv_heads} KV heads, head_dim {head_dim}, block size {block_size}, "
        f"{str(cache.k.dtype).removeprefix('torch.')} cache"
    )
    if fast_path(num_q_heads, cache):
        return True, f"CPU attention: the vectorized path at {level} ({shape})"
    needs = (
        "an avx2 or avx512 build"
        if level == "generic"
        else "block size 16, a head_dim that is a multiple of 16 up to 256 and at most 24 query heads a KV head"
    )
    return (
        False,
        f"CPU attention takes the portable loop, several times slower ({shape}): the vectorized path needs {needs}",
    )


def paged_attention(
    q: torch.Tensor,
    cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    *,
    generic: bool = False,
    level: str | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the cached context (the new tokens' K/V already written).

    `generic` forces the portable loop even where the vectorized path applies (tests compare both);
    `level` picks the ISA build (default: isa.selected()).
    """
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"unsupported query dtype {q.dtype}")
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = meta.block_tables.contiguous()
    qsl = meta.query_start_loc.contiguous()
    lens = meta.seq_lens.contiguous()
    _, block_size, num_kv_heads, head_dim = cache.k.shape
    rc = _library(level).kvpilot_paged_attention(
        q.data_ptr(),
        _DTYPES[q.dtype],
        out.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        _DTYPES[cache.k.dtype],
        int(k_transposed(cache.k)),
        int(v_head_major(cache.v)),
        _ptr(cache.k_scale),
        _ptr(cache.v_scale),
        tables.data_ptr(),
        int(tables.shape[1]),
        qsl.data_ptr(),
        lens.data_ptr(),
        meta.num_seqs,
        int(q.shape[1]),
        int(num_kv_heads),
        int(head_dim),
        int(block_size),
        float(scale),
        torch.get_num_threads(),
        int(not generic),
    )
    if rc != 0:
        raise ValueError(f"paged attention kernel rejected its arguments (code {rc})")
    return out


class CPUPagedAttentionBackend:
    name = "cpu-paged"
    tiled_kv = True  # the model runner allocates transposed_k_cache() K and head_major_v_cache() V

    def __init__(self) -> None:
        self._path_logged = False  # describe_path's line, once, at the first call (q's heads known there)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if cpu_ops.write_kv_supports(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale):
            cpu_ops.write_kv_(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        else:
            write_kv(k, v, cache, meta.slot_mapping)
        if not self._path_logged:
            self._path_logged = True
            fast, line = describe_path(q.shape[1], cache)
            (log.info if fast else log.warning)(line)
        return paged_attention(q, cache, meta, scale)
