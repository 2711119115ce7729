"""The engine's half of the KV transfer (`LLMEngine.kv`), which is also the front end's
`KVTransferPort` (runtime/engine/protocol.py):

- prefill side: when a `KVExport` request finishes, its full prompt blocks before the last token are
  pinned (pins.py) under a new transfer id, and `open_transfer` streams them;
- decode side: a `KVImport` request's pulled blocks are copied into fresh blocks behind the prefix-cache
  hits it was pulled for, counted as computed and published to the prefix cache; the scheduler then
  computes the remaining prompt tokens (at least the last), so this pod samples the first token.

Engine thread: `pin_finished`, `import_into`, `release_due`. Any thread: `cached_prefix_blocks`,
`open_transfer`, `release_transfer` (the pin table has its own lock; the prefix-cache read is a hint).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvpilot.kernels.attention import KVCacheLayer
from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.kv_transfer.blocks import export_run, import_run
from kvpilot.runtime.engine.kv_transfer.pins import Pin, PinTable
from kvpilot.runtime.engine.kv_transfer.wire import KVLayout, transfer_blocks
from kvpilot.runtime.engine.protocol import KVImport
from kvpilot.runtime.engine.sequence import Sequence

log = logging.getLogger(__name__)


class Shards(Protocol):
    """The other tensor-parallel ranks' KV pools (TPModelRunner): each rank holds its own heads."""

    def export_kv_shard(self, rank: int, layer: int, block_ids: list[int]) -> bytes: ...

    def import_kv_shard(self, rank: int, layer: int, block_ids: list[int], data: memoryview) -> None: ...


class _Reader:
    def __init__(self, pin: Pin, caches: list[KVCacheLayer], shards: Shards | None) -> None:
        self._pin = pin
        self._caches = caches
        self._shards = shards
        self.num_tokens = pin.num_tokens
        self.num_blocks = len(pin.block_ids)

    def export_run(self, layer: int, first_block: int, num_blocks: int, rank: int = 0) -> memoryview:
        block_ids = self._pin.block_ids[first_block : first_block + num_blocks]
        if rank == 0:
            return export_run(self._caches[layer], block_ids)
        assert self._shards is not None
        return memoryview(self._shards.export_kv_shard(rank, layer, block_ids))


class KVTransfers:
    def __init__(
        self,
        role: str,
        bm: BlockManager,
        caches: list[KVCacheLayer],
        layout: KVLayout,
        pin_fraction: float,
        ttl: float,
        timeout: float,
        adapter_key: Callable[[str | None], str | None],
        shards: Shards | None = None,
    ) -> None:
        """`layout`: rank 0's (its tp_size says how many ranks' shards a transfer has); `shards`:
        the other ranks' pools (tensor parallelism)."""
        self.role = role
        self.layout = layout
        self.timeout = timeout
        self._bm = bm
        self._caches = caches
        self._adapter_key = adapter_key
        self._shards = shards
        self.pins = PinTable(int(pin_fraction * bm.num_blocks), ttl)
        self.wake: Callable[[], None] = lambda: None  # AsyncEngine: run release_due soon

    # -- prefill side --------------------------------------------------------------------------
    def pin_finished(self, seq: Sequence) -> dict[str, Any] | None:
        """Engine thread, before the finished sequence's blocks are freed: pin its transfer blocks
        and return the response's kv_transfer_params; None when over the cap (or not computed)."""
        n = transfer_blocks(seq.num_prompt_tokens, self._bm.block_size)
        if seq.num_computed_tokens < n * self._bm.block_size:
            return None
        block_ids = seq.block_table[:n]
        transfer_id = uuid.uuid4().hex
        if not self.pins.add(transfer_id, block_ids, seq.num_prompt_tokens):
            log.info("KV transfer not pinned: pinned transfers hold their share of the pool")
            return None
        self._bm.pin(block_ids)
        return {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "num_tokens": seq.num_prompt_tokens,
            "block_size": self.layout.block_size,
            "kv_cache_dtype": self.layout.dtype,
            "model_fingerprint": self.layout.model_fingerprint,
        }

    @contextlib.contextmanager
    def open_transfer(self, transfer_id: str) -> Iterator[_Reader | None]:
        pin = self.pins.open(transfer_id)
        try:
            yield None if pin is None else _Reader(pin, self._caches, self._shards)
        finally:
            if pin is not None:
                self.pins.close(pin)
                self.wake()

    def release_transfer(self, transfer_id: str) -> bool:
        released = self.pins.release(transfer_id)
        if released:
            self.wake()
        return released

    def release_due(self) -> None:
        """Engine thread: give back the blocks of released and expired transfers."""
        for block_ids in self.pins.take_freeable():
            self._bm.unpin(block_ids)

    def close(self) -> None:
        for block_ids in self.pins.take_all():
            self._bm.unpin(block_ids)

    # -- decode side ---------------------------------------------------------------------------
    def cached_prefix_blocks(
        self, prompt_token_ids: list[int], cache_salt: str | None, lora: str | None
    ) -> int:
        try:
            adapter = self._adapter_key(lora)
        except ValueError:  # not loaded: the request will fail on its own
            return 0
        limit = transfer_blocks(len(prompt_token_ids), self._bm.block_size)
        return self._bm.count_cached_prefix(prompt_token_ids, limit, cache_salt, adapter)

    def import_into(self, seq: Sequence, kv: KVImport) -> str | None:
        """Engine thread, for a new sequence: put the pulled blocks in place; the reason when they
        cannot be used (`evicted`: the local prefix they follow is gone; `no_blocks`: no room now)."""
        bs = self._bm.block_size
        first, n = kv.first_block, kv.num_blocks
        if (
            first + n != transfer_blocks(seq.num_prompt_tokens, bs)
            or seq.needs_prompt_logprobs
            or len(kv.shards) != self.layout.tp_size
        ):
            return "mismatch"
        hits = self._bm.match_prefix(seq)
        if len(hits) < first:
            return "evicted"
        if not self._bm.adopt(seq, hits[:first], n):
            return "no_blocks"
        try:
            for rank, runs in enumerate(kv.shards):
                for r in runs:
                    start = r.run.first_block
                    ids = seq.block_table[start : start + r.run.num_blocks]
                    if rank == 0:
                        import_run(self._caches[r.run.layer], ids, r.data)
                    else:
                        assert self._shards is not None
                        self._shards.import_kv_shard(rank, r.run.layer, ids, r.data)
        except (ValueError, RuntimeError):
            log.exception("pulled KV blocks could not be copied in; computing the prompt")
            self._bm.free_seq(seq)
            return "import_error"
        self._bm.cache_full_blocks(seq)
        return None
