"""A KV pool's blocks to and from the wire's BLOCK payloads (wire.py): the logical content of each
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


def _as_bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, ...] of any dtype -> [n, bytes] uint8 on the CPU (contiguous)."""
    return t.contiguous().cpu().view(torch.uint8).reshape(n, -1)


def export_layer(cache: KVCacheLayer, block_ids: list[int]) -> list[memoryview]:
    """The BLOCK payloads (after the ids) of `block_ids` in one layer, in order."""
    n = len(block_ids)
    if n == 0:
        return []
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)
    parts = [_as_bytes(cache.k.index_select(0, idx), n), _as_bytes(cache.v.index_select(0, idx), n)]
    if cache.k_scale is not None and cache.v_scale is not None:
        parts += [
            _as_bytes(cache.k_scale.index_select(0, idx), n),
            _as_bytes(cache.v_scale.index_select(0, idx), n),
        ]
    rows = torch.cat(parts, dim=1).numpy()
    return [memoryview(rows[i]) for i in range(n)]


def import_layer(
    cache: KVCacheLayer, block_ids: list[int], payloads: list[memoryview], layout: KVLayout
) -> None:
    """Write the BLOCK payloads of one layer into `block_ids` of this pool (layout already checked)."""
    n = len(block_ids)
    if n == 0:
        return
    assert len(payloads) == n
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).reshape(n, -1)
    kv, sc = layout.kv_bytes, layout.scale_bytes
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.k.device)

    def put(dst: torch.Tensor, start: int, size: int, dims: tuple[int, ...]) -> None:
        src = raw[:, start : start + size].contiguous().view(dst.dtype).reshape(dims)
        dst.index_copy_(0, idx, src.to(dst.device))

    put(cache.k, 0, kv, shape)
    put(cache.v, kv, kv, shape)
    if cache.k_scale is not None and cache.v_scale is not None:
        put(cache.k_scale, 2 * kv, sc, shape[:-1])
        put(cache.v_scale, 2 * kv + sc, sc, shape[:-1])
