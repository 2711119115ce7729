"""A KV pool's blocks to and from the wire's BLOCKS frames (wire.py): the logical content of each
block ([block_size, kv_heads, head_dim] K and V, and their scales for int8/fp8), whatever layout the
pool stores it in (runtime/engine/runner.allocate_kv_cache: plain, transposed K, head-major V), so
pods whose attention kernels store blocks differently interoperate."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvpilot.kernels.attention import KVCacheLayer
from kvpilot.runtime.engine.kv_transfer.wire import KVLayout
from kvpilot.runtime.engine.runner import KVGeometry


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(geo: KVGeometry, fingerprint: str, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    return KVLayout(
        fingerprint,
        dtype_name(geo.dtype),
        geo.block_size,
        geo.num_layers,
        geo.num_kv_heads,
        geo.head_dim,
        tp_rank,
        tp_size,
    )


def model_fingerprint(arch: Any, model: Any, weights_dtype: torch.dtype, quantization: str | None) -> str:
    """What must be equal for two pods' KV to be interchangeable: the architecture, the weights' dtype
    and quantization, and a sample of the weights themselves (the first and the last tensor's first
    4 KiB), hashed. Two pods that load the same checkpoint with the same settings agree."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr(arch).encode())
    h.update(f"{weights_dtype}|{quantization}".encode())
    state = model.state_dict()
    names = list(state)
    for name in (names[0], names[-1]) if names else ():
        t = state[name].detach().reshape(-1)
        sample = t[: max(1, 4096 // max(1, t.element_size()))].cpu().contiguous()
        h.update(name.encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _parts(cache: KVCacheLayer) -> list[torch.Tensor]:
    """The pool tensors a BLOCKS frame carries, in wire order (KVLayout.run_parts), as same-size
    integer views: a bit copy needs no kernel of the storage dtype (float8 has few on the CPU)."""
    parts = [cache.k, cache.v]
    if cache.k_scale is not None and cache.v_scale is not None:
        parts += [cache.k_scale, cache.v_scale]
    return [t.view(_BITS[t.element_size()]) for t in parts]


def export_run(cache: KVCacheLayer, block_ids: list[int]) -> memoryview:
    """A BLOCKS frame's data (after its ids) for `block_ids` of one layer: each part gathered from the
    pool straight into its slice of one fresh host buffer, whatever the pool's layout."""
    n = len(block_ids)
    parts = _parts(cache)
    sizes = [n * t[0].numel() * t.element_size() for t in parts]
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    if n == 0:
        return out.numpy().data
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)
    pos = 0
    for src, size in zip(parts, sizes, strict=True):
        dst = out[pos : pos + size].view(src.dtype).view(n, *src.shape[1:])
        if src.device.type == "cpu":
            torch.index_select(src, 0, idx, out=dst)
        else:  # gather on the device, one copy to the host
            dst.copy_(src.index_select(0, idx))
        pos += size
    return out.numpy().data


def import_run(cache: KVCacheLayer, block_ids: list[int], data: memoryview | bytes) -> None:
    """Write a BLOCKS frame's data into `block_ids` of this pool (its size already checked): one
    batched index copy per part, from views of `data` (no copy on the CPU when `data` is writable)."""
    n = len(block_ids)
    if n == 0:
        return
    view = memoryview(data)
    if view.readonly:  # torch.frombuffer wants a writable buffer (the pulls read into bytearrays)
        view = memoryview(bytearray(view))
    raw = torch.frombuffer(view, dtype=torch.uint8)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)
    pos = 0
    for dst in _parts(cache):
        size = n * dst[0].numel() * dst.element_size()
        src = raw[pos : pos + size].view(dst.dtype).view(n, *dst.shape[1:])
        dst.index_copy_(0, idx, src.to(dst.device))
        pos += size
