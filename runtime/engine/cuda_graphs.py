"""CUDA graphs for decode steps: one graph per batch-size bucket, the batch padded up to its bucket.

A decode step (one new token per sequence) has the same shapes for every batch of the same size, so
it is captured once per bucket and replayed: one launch instead of hundreds of small kernel launches.
The real batch is copied into static buffers; rows beyond it are padding: token 0 at position 0, slot
-1 (never written to the KV pool), context length 1 over block 0 (their output is discarded).

`--enforce-eager` turns graphs off; they are also off on the CPU, under tensor parallelism, for
backends that are not capture-safe (`graph_safe`), and for batches larger than the largest bucket.
`DecodeGraphRunner(capture=False)` runs the same padded, static-buffer path eagerly: that is how the
CPU tests check the bucketing and padding.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from kvpilot.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheLayer

log = logging.getLogger(__name__)

# padding rows: slot -1 means "do not write" (kernels/attention.py); a one-token context over block 0
PAD_SLOT = -1
PAD_SEQ_LEN = 1
MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """Pure: the buckets to capture: 1, 2, 4, 8, then every multiple of 16, up to the first bucket that
    holds max_num_seqs (at most `limit`; bigger decode batches run eagerly)."""
    candidates = [1, 2, 4, 8, *range(16, limit + 1, 16)]
    sizes: list[int] = []
    for c in candidates:
        sizes.append(c)
        if c >= max_num_seqs:
            break
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """Pure: the smallest bucket that holds n rows, None when n exceeds the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphRunner:
    """Static buffers for the largest bucket, one captured graph (or, with capture=False, one eager
    forward over the same buffers) per bucket."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[KVCacheLayer],
        backend: AttentionBackend,
        sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        if not sizes:
            raise ValueError("no CUDA graph batch sizes")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = sorted(sizes)
        self.device = device
        self.capture = capture
        b = self.sizes[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((b,), PAD_SEQ_LEN, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, meta: AttentionMetadata) -> bool:
        return (
            meta.decode_only
            and meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def _meta(self, b: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            query_lens_cpu=[1] * b,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
        )

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # a capture reads only tensors (the Triton kernel and flash-attn's paged decode take lengths
        # from seq_lens); the CPU-side lengths are an upper bound for code that wants one
        upper = [self.block_tables.shape[1] * self.kv_caches[0].block_size]
        pool = None
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            meta = self._meta(b, upper * b)
            self._forward(b, meta)  # compiles kernels, settles the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b, meta)
            pool = graph.pool()
            self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode batch of n rows into the static buffers, padded to its bucket; returns it."""
        n = meta.num_seqs
        b = bucket_for(n, self.sizes)
        if b is None or not self.fits(meta):
            raise ValueError(f"a decode batch of {n} rows does not fit the CUDA graph buckets {self.sizes}")
        w = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self.block_tables[:n, w:].zero_()
        # padding rows
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slot_mapping[n:b].fill_(PAD_SLOT)
        self.seq_lens[n:b].fill_(PAD_SEQ_LEN)
        self.block_tables[n:b].zero_()
        return b

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch, through its bucket's graph."""
        n = meta.num_seqs
        b = self.load(input_ids, positions, meta)
        if self.capture:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        # eager, same buffers and padding (CPU tests)
        lens = meta.seq_lens_cpu + [PAD_SEQ_LEN] * (b - n)
        return self._forward(b, self._meta(b, lens))[:n]
