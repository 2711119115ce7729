"""Decode CUDA graphs: the bucketing and padding logic, checked on the CPU.

`DecodeGraphRunner(capture=False)` runs exactly what a captured graph replays (the static buffers, the
batch padded to its bucket) as an eager forward, so these tests prove on the CPU that a padded decode
step gives the real rows the eager step's hidden states and leaves the KV pool byte-for-byte as the
eager step does (padding rows carry slot -1 and write nothing). The capture itself needs a GPU:
tests/runtime/test_cuda.py::test_cuda_graphs_match_eager_decode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpilot.kernels import triton_attention
from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer, TorchReferenceBackend
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.cuda_graphs import PAD_SLOT, DecodeGraphRunner, bucket_for, graph_batch_sizes
from kvpilot.runtime.engine.plan import cuda_graph_sizes
from kvpilot.runtime.engine.runner import ModelRunner, allocate_kv_cache, kv_geometry

BS = 16
MAX_BLOCKS = 4


def test_buckets_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(100)[-1] == 112  # the first bucket that holds 100
    assert graph_batch_sizes(4096)[-1] == 512  # beyond the limit decode runs eagerly
    sizes = graph_batch_sizes(256)
    for n in range(1, 257):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n and b - n < max(1, b // 2)  # padding stays under half
    assert bucket_for(513, graph_batch_sizes(4096)) is None


def test_enforce_eager_and_cpu_get_no_graphs() -> None:
    cuda = torch.device("cuda")
    assert cuda_graph_sizes(EngineConfig(enforce_eager=True), cuda) is None
    assert cuda_graph_sizes(EngineConfig(), torch.device("cpu")) is None
    sizes = cuda_graph_sizes(EngineConfig(max_num_seqs=40), cuda)
    assert sizes is not None and sizes[-1] >= 40


def test_runner_refuses_graphs_off_cuda(smollm2_fp32: Any) -> None:
    geo = kv_geometry(smollm2_fp32.arch, BS, torch.float32)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelRunner(
            smollm2_fp32.model, geo, 8, torch.device("cpu"), cuda_graph_sizes=[1, 2], max_model_len=64
        )


def decode_meta(ctx: list[int], tables: list[list[int]]) -> AttentionMetadata:
    n = len(ctx)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor([t[c // BS] * BS + c % BS for t, c in zip(tables, ctx, strict=True)]),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor([c + 1 for c in ctx], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=[1] * n,
        seq_lens_cpu=[c + 1 for c in ctx],
        max_query_len=1,
        max_seq_len=max(ctx) + 1,
    )


def prefill(
    model: Any, caches: list[KVCacheLayer], backend: AttentionBackend, ctx: list[int], tables: list[list[int]]
) -> None:
    slots, qsl, pos = [], [0], []
    for c, t in zip(ctx, tables, strict=True):
        slots += [t[p // BS] * BS + p % BS for p in range(c)]
        pos += list(range(c))
        qsl.append(qsl[-1] + c)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=ctx,
        seq_lens_cpu=list(ctx),
        max_query_len=max(ctx),
        max_seq_len=max(ctx),
    )
    gen = torch.Generator().manual_seed(sum(ctx))
    ids = torch.randint(0, 1000, (sum(ctx),), generator=gen)
    model(ids, torch.tensor(pos), caches, meta, backend)


def pool_rows(caches: list[KVCacheLayer]) -> list[torch.Tensor]:
    """Every layer's K and V as [slots, Hkv, D] views."""
    return [x.reshape(-1, x.shape[2], x.shape[3]) for c in caches for x in (c.k, c.v)]


# The Triton backend's own padding (slot -1 skipped inside its store kernel) is tested at the kernel
# level (tests/kernels/test_triton_attention.py): a 30-layer model under the interpreter takes minutes.
BACKENDS = ["torch"]


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_padded_decode_equals_eager_and_padding_writes_nothing(smollm2_fp32: Any, backend_name: str) -> None:
    model = smollm2_fp32.model
    backend: AttentionBackend = (
        TorchReferenceBackend() if backend_name == "torch" else triton_attention.TritonPagedAttentionBackend()
    )
    geo = kv_geometry(smollm2_fp32.arch, BS, torch.float32)
    caches = allocate_kv_cache(geo, 24, torch.device("cpu"))
    # five sequences of different lengths in scattered blocks
    ctx = [5, 17, 2, 33, 9]
    tables = [[3], [7, 1], [12], [0, 20, 9], [15]]
    prefill(model, caches, backend, ctx, tables)
    graphs = DecodeGraphRunner(
        model, caches, backend, [1, 2, 4, 8], MAX_BLOCKS, torch.device("cpu"), capture=False
    )

    # batches of 3 (bucket 4), 5 (bucket 8), then 1 (bucket 1: stale rows of the bigger batch reset)
    cur = list(ctx)
    for step, rows in enumerate([[0, 1, 2], [0, 1, 2, 3, 4], [3]]):
        c = [cur[i] for i in rows]
        t = [tables[i] for i in rows]
        for i in rows:
            cur[i] += 1
        meta = decode_meta(c, t)
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 1000, (len(rows),), generator=gen)
        pos = torch.tensor(c)
        eager_caches = [KVCacheLayer(x.k.clone(), x.v.clone()) for x in caches]
        before = [r.clone() for r in pool_rows(caches)]
        want = model(ids, pos, eager_caches, meta, backend)
        got = graphs.run(ids, pos, meta)
        bucket = bucket_for(len(rows), graphs.sizes)
        assert bucket is not None
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the padding rows point nowhere, and the pool equals the eager step's byte for byte
        assert graphs.slot_mapping[len(rows) : bucket].eq(PAD_SLOT).all()
        assert graphs.block_tables[len(rows) : bucket].eq(0).all()
        written = meta.slot_mapping
        untouched = torch.ones(24 * BS, dtype=torch.bool)
        untouched[written] = False
        for a, e, old in zip(pool_rows(caches), pool_rows(eager_caches), before, strict=True):
            # the real rows' new K/V as the eager step wrote them (a batch of another size may round
            # the last bit differently), every other slot byte-for-byte as before the step
            torch.testing.assert_close(a[written], e[written], atol=1e-4, rtol=1e-4)
            assert torch.equal(a[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
