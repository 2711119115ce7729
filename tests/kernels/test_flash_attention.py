"""The flash-attn backend: its packing path on CPU (packed_kv + a varlen reference), the real kernels on CUDA.

flash-attn 2 pages K/V only in blocks of a multiple of 256 tokens, so with the default 16-token blocks
the backend packs each sequence's context and calls the varlen kernel without a block table. The CPU
tests check the packing and the varlen semantics the backend relies on (bottom-right causal
alignment) against the reference backend; the CUDA tests run flash-attn itself and skip without a GPU
or without flash-attn installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.kernels.attention import (
    FLASH_PAGE_MULTIPLE,
    AttentionMetadata,
    KVCacheLayer,
    TorchReferenceBackend,
    packed_kv,
    write_kv,
)

HQ, HKV, D = 8, 2, 64


def varlen_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], scale: float
) -> torch.Tensor:
    """flash_attn_varlen_func(..., causal=True) written out: query i of a sequence with n queries and
    L keys sees keys 0 .. L - n + i (the causal mask aligned to the bottom-right corner)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    rep = HQ // HKV
    for b in range(len(cu_q) - 1):
        qs, kk, vv = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        n, length = qs.shape[0], kk.shape[0]
        kk = kk.repeat_interleave(rep, 1).double()
        vv = vv.repeat_interleave(rep, 1).double()
        scores = torch.einsum("qhd,khd->hqk", qs.double(), kk) * scale
        visible = torch.arange(length, device=q.device)[None, :] <= (
            torch.arange(n, device=q.device)[:, None] + length - n
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).float()
    return out


def mixed_step(
    block_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVCacheLayer, AttentionMetadata]:
    """Cached contexts of several lengths, scattered blocks, and a step of decodes and prefill chunks."""
    gen = torch.Generator().manual_seed(0)
    ctx = [0, 37, 5, 300, 16]  # tokens already cached
    new = [9, 1, 4, 1, 3]  # a fresh prompt, a decode, a chunk, a long decode, a chunk at a block edge
    nblocks = [(c + n + block_size - 1) // block_size for c, n in zip(ctx, new, strict=True)]
    perm = torch.randperm(sum(nblocks) + 3, generator=gen).tolist()
    tables, at = [], 0
    for n in nblocks:
        tables.append(perm[at : at + n])
        at += n
    shape = (len(perm), block_size, HKV, D)
    cache = KVCacheLayer(
        torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    )

    def slots(table: list[int], start: int, n: int) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]

    for table, c in zip(tables, ctx, strict=True):
        if c:
            kv = torch.randn(2, c, HKV, D, generator=gen).to(device, dtype)
            write_kv(kv[0], kv[1], cache, torch.tensor(slots(table, 0, c), device=device))
    t = sum(new)
    q = torch.randn(t, HQ, D, generator=gen).to(device, dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    lens = [c + n for c, n in zip(ctx, new, strict=True)]
    new_slots = [s for tb, c, n in zip(tables, ctx, new, strict=True) for s in slots(tb, c, n)]
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    width = max(nblocks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [x + [0] * (width - len(x)) for x in tables], dtype=torch.int32, device=device
        ),
        query_lens_cpu=new,
        seq_lens_cpu=lens,
        max_query_len=max(new),
        max_seq_len=max(lens),
    )
    return q, k, v, cache, meta


@pytest.mark.parametrize("block_size", [4, 16])
def test_packed_kv_holds_each_context_in_order(block_size: int) -> None:
    _, k, v, cache, meta = mixed_step(block_size, torch.device("cpu"), torch.float32)
    write_kv(k, v, cache, meta.slot_mapping)
    kk, vv, cu = packed_kv(cache, meta)
    assert cu.tolist() == [0, *torch.tensor(meta.seq_lens_cpu).cumsum(0).tolist()]
    assert kk.shape == (sum(meta.seq_lens_cpu), HKV, D) and vv.shape == kk.shape
    tables = meta.block_tables.tolist()
    for b, n in enumerate(meta.seq_lens_cpu):
        want = torch.stack([cache.k[tables[b][p // block_size], p % block_size] for p in range(n)])
        torch.testing.assert_close(kk[cu[b] : cu[b + 1]], want, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_varlen_over_packed_kv_equals_the_reference_backend(block_size: int) -> None:
    """What FlashAttentionBackend computes for small blocks, with flash-attn's varlen semantics written out."""
    q, k, v, cache, meta = mixed_step(block_size, torch.device("cpu"), torch.float32)
    scale = 1 / math.sqrt(D)
    want = TorchReferenceBackend().forward(q, k, v, cache, meta, scale)  # writes the new K/V too
    kk, vv, cu = packed_kv(cache, meta)
    got = varlen_reference(q, kk, vv, meta.query_start_loc.tolist(), cu.tolist(), scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- CUDA: flash-attn itself ------------------------------------------------------------------


def flash_backend() -> object:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CPU siblings: the packed-KV tests above)")
    pytest.importorskip("flash_attn")
    from kvpilot.kernels.attention import FlashAttentionBackend

    return FlashAttentionBackend()


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, FLASH_PAGE_MULTIPLE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_backend_matches_the_reference_on_cuda(block_size: int, dtype: torch.dtype) -> None:
    backend = flash_backend()
    cuda = torch.device("cuda")
    q, k, v, cache, meta = mixed_step(block_size, cuda, dtype)
    ref_cache = KVCacheLayer(cache.k.clone(), cache.v.clone())
    scale = 1 / math.sqrt(D)
    got = backend.forward(q, k, v, cache, meta, scale)  # type: ignore[attr-defined]
    want = TorchReferenceBackend().forward(q, k, v, ref_cache, meta, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
