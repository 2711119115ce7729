"""The KV block pool: fixed-size blocks, ref counts, prefix caching by chained block hashes.

Full blocks are identified by a hash chained from the parent block's hash, the block's token ids,
an optional salt and the sequence's LoRA adapter (if any). A request reuses the longest cached
chain. Blocks nobody references stay
cached (and reusable) in an LRU free list until the pool needs them; the free list is an
OrderedDict, so taking a block out of the middle on a cache hit is O(1).

Only full blocks are ever shared, so a shared block is never written again: the partial last block
of every sequence is private. That is what makes copy-on-write unnecessary here.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from kvpilot.runtime.engine.sequence import Sequence

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: list[int], salt: str | None = None, adapter: str | None = None
) -> BlockHash:
    """A collision-resistant hash of (parent hash, tokens, salt, LoRA adapter key): K/V computed with
    one adapter is never served to a sequence running another (or the base model)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if salt:
        h.update(b"salt:" + salt.encode())
    if adapter:
        h.update(b"lora:" + adapter.encode())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order (least recently used first); values unused
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()
        # per sequence: hashes of its full blocks, computed lazily as blocks fill
        self._seq_hashes: dict[str, list[BlockHash]] = {}

    # -- accounting ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # -- block life cycle ----------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the cached content is about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free.move_to_end(block_id, last=False)

    # -- prefix cache --------------------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence, upto_tokens: int) -> list[BlockHash]:
        """Hashes of the sequence's full blocks within its first `upto_tokens` tokens (memoized)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        n_full = upto_tokens // bs
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            adapter = seq.lora.key if seq.lora is not None else None
            hashes.append(hash_block(parent, tokens, seq.cache_salt, adapter))
        return hashes[:n_full]

    def first_block_hash(self, seq: Sequence) -> BlockHash | None:
        """Hash of the sequence's first full block (None when the prompt is shorter than a block)."""
        if not self.enable_prefix_caching or seq.num_tokens <= self.block_size:
            return None
        return self._full_block_hashes(seq, self.block_size)[0]

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self.cached

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of a new sequence; at least its last token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        for h in self._full_block_hashes(seq, seq.num_tokens - 1):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # -- per-sequence API used by the scheduler -------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`. False (and no change) when blocks are short.

        `cached_blocks` (first admission only) are prefix-cache hits that become the start of the table.
        """
        cached_blocks = cached_blocks or []
        if cached_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        # cached blocks that sit in the free list are not available for new allocations
        cached_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if need > len(self.free) - cached_free:
            return False
        if cached_blocks or (seq.num_computed_tokens == 0 and not seq.block_table):
            self.stats.queries += seq.num_tokens
            self.stats.hits += len(cached_blocks) * self.block_size
        for b in cached_blocks:
            self._ref(b)
        seq.block_table.extend(cached_blocks)
        if cached_blocks:
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
            seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        for _ in range(max(0, need)):
            seq.block_table.append(self._take_free())
        return True

    def count_cached_prefix(
        self, token_ids: list[int], limit: int, salt: str | None, adapter: str | None
    ) -> int:
        """Leading full blocks of `token_ids` (at most `limit`) the prefix cache holds. Reads only the
        cache map (a dict lookup per block), so another thread may call it: the answer is a hint."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent: BlockHash | None = None
        for i in range(limit):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt, adapter)
            if parent not in self.cached:
                return i
        return limit

    def adopt(self, seq: Sequence, cached_blocks: list[int], num_filled: int) -> bool:
        """First admission of a sequence whose leading blocks are filled from elsewhere (a KV transfer):
        `cached_blocks` (prefix-cache hits), then `num_filled` fresh blocks the caller writes; all of
        them count as computed. False (and no change) when blocks are short."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        cached_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_filled > len(self.free) - cached_free:
            return False
        self.stats.queries += seq.num_tokens
        self.stats.hits += len(cached_blocks) * self.block_size
        for b in cached_blocks:
            self._ref(b)
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self._take_free() for _ in range(num_filled))
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = len(cached_blocks) * self.block_size
        return True

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks beyond their sequence's life (a KV transfer's), until `unpin`."""
        for b in block_ids:
            self._ref(b)

    def unpin(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):
            self._unref(b)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        for i, h in enumerate(hashes):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            if h in self.cached:  # same content computed twice (e.g. simultaneous identical prompts)
                continue
            block.block_hash = h
            self.cached[h] = block.block_id

    def trim(self, seq: Sequence) -> int:
        """Release the tail blocks beyond what the sequence's tokens need (the slots of rejected
        speculative tokens). Such blocks were never full of committed tokens, so never cached.
        Returns how many blocks were released."""
        keep = self.blocks_needed(seq.num_tokens)
        extra = seq.block_table[keep:]
        for block_id in reversed(extra):
            assert self.blocks[block_id].block_hash is None, "a speculative block was cached"
            self._unref(block_id)
        del seq.block_table[keep:]
        return len(extra)

    def free_seq(self, seq: Sequence) -> None:
        """Release a finished or preempted sequence's blocks; tail blocks become the first to evict."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def forget(self, seq: Sequence) -> None:
        self._seq_hashes.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self.cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].block_hash = None
                del self.cached[h]

    def check_invariants(self) -> None:
        """For tests: every block is either referenced or free, never both; the cache map is exact."""
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in self.free), block
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h
