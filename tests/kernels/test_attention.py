"""Paged attention against a dense, unpaged softmax(QK^T)V written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from kvpilot.kernels import quant
from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer, TorchReferenceBackend

HQ, HKV, D, BS = 6, 2, 16, 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """q [n, HQ, D] at positions q_offset.., k/v [L, HKV, D]; causal."""
    rep = HQ // HKV
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    qpos = torch.arange(q_offset, q_offset + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def make_cache(num_blocks: int, dtype: torch.dtype = torch.float32) -> KVCacheLayer:
    shape = (num_blocks, BS, HKV, D)
    if quant.is_quantized(dtype):
        return KVCacheLayer(
            torch.zeros(shape, dtype=dtype),
            torch.zeros(shape, dtype=dtype),
            torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
            torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
        )
    return KVCacheLayer(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


def run_step(
    cache: KVCacheLayer,
    tables: list[list[int]],
    starts: list[int],
    qlens: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    slots: list[int] = []
    for table, start, n in zip(tables, starts, qlens, strict=True):
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    seq_lens = [s + n for s, n in zip(starts, qlens, strict=True)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )
    return TorchReferenceBackend().forward(q, k, v, cache, meta, 1 / math.sqrt(D))


@pytest.mark.parametrize(
    "kv_dtype,tol", [(torch.float32, 1e-5), (torch.int8, 3e-2), (torch.float8_e4m3fn, 8e-2)]
)
def test_chunked_prefill_then_batched_decode_matches_dense(kv_dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    lens = [11, 5, 17]
    # scattered, non-contiguous block tables
    tables = [[7, 2, 9, 0, 12], [3, 1], [4, 8, 10, 5, 11, 6]]
    qs = [torch.randn(n + 3, HQ, D) for n in lens]
    ks = [torch.randn(n + 3, HKV, D) for n in lens]
    vs = [torch.randn(n + 3, HKV, D) for n in lens]
    cache = make_cache(16, kv_dtype)

    # step 1: first chunk of every prompt (at most 6 tokens each)
    chunk = [min(6, n) for n in lens]
    out1 = run_step(
        cache,
        tables,
        [0, 0, 0],
        chunk,
        torch.cat([q[:c] for q, c in zip(qs, chunk, strict=True)]),
        torch.cat([k[:c] for k, c in zip(ks, chunk, strict=True)]),
        torch.cat([v[:c] for v, c in zip(vs, chunk, strict=True)]),
    )
    # step 2: the rest of the prompts, attending to the cached first chunk
    rest = [n - c for n, c in zip(lens, chunk, strict=True)]
    live = [i for i, r in enumerate(rest) if r > 0]
    out2 = run_step(
        cache,
        [tables[i] for i in live],
        [chunk[i] for i in live],
        [rest[i] for i in live],
        torch.cat([qs[i][chunk[i] : lens[i]] for i in live]),
        torch.cat([ks[i][chunk[i] : lens[i]] for i in live]),
        torch.cat([vs[i][chunk[i] : lens[i]] for i in live]),
    )
    # steps 3..5: batched decode of one token per sequence
    decodes = []
    for j in range(3):
        decodes.append(
            run_step(
                cache,
                tables,
                [n + j for n in lens],
                [1, 1, 1],
                torch.stack([q[n + j] for q, n in zip(qs, lens, strict=True)]),
                torch.stack([k[n + j] for k, n in zip(ks, lens, strict=True)]),
                torch.stack([v[n + j] for v, n in zip(vs, lens, strict=True)]),
            )
        )

    for i, n in enumerate(lens):
        want = dense_attention(qs[i], ks[i], vs[i], 0)
        got_prefix = out1[sum(chunk[:i]) : sum(chunk[: i + 1])]
        torch.testing.assert_close(got_prefix, want[: chunk[i]], atol=tol, rtol=tol)
        if i in live:
            off = sum(rest[j] for j in live if j < i)
            torch.testing.assert_close(out2[off : off + rest[i]], want[chunk[i] : n], atol=tol, rtol=tol)
        for j in range(3):
            torch.testing.assert_close(decodes[j][i], want[n + j], atol=tol, rtol=tol)


def test_padding_slots_are_not_written() -> None:
    cache = make_cache(2)
    k = torch.ones(2, HKV, D)
    from kvpilot.kernels.attention import write_kv

    write_kv(k, k, cache, torch.tensor([3, -1]))
    assert cache.k.view(-1, HKV, D)[3].eq(1).all()
    assert cache.k.view(-1, HKV, D).sum() == HKV * D
