"""Block pool and prefix-cache bookkeeping (pure, no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.engine.block_manager import BlockManager, hash_block
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.sequence import Sequence


def make_seq(sid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(sid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    cached = bm.match_prefix(seq)
    n = seq.num_tokens - len(cached) * bm.block_size
    ok = bm.allocate(seq, n, cached)
    if ok:
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
    return ok


def test_hash_chains_on_parent_and_salt() -> None:
    a = hash_block(None, [1, 2, 3])
    assert hash_block(None, [1, 2, 3]) == a
    assert hash_block(a, [1, 2, 3]) != a
    assert hash_block(None, [1, 2, 3], "tenant-a") != a


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq("a", list(range(10)))
    assert admit(bm, seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free_seq(seq)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token() -> None:
    bm = BlockManager(16, 4)
    a = make_seq("a", list(range(12)))
    assert admit(bm, a)
    b = make_seq("b", list(range(12)))
    cached = bm.match_prefix(b)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit
    assert cached == a.block_table[:2]
    assert admit(bm, b)
    assert b.num_cached_tokens == 8
    assert bm.stats.hits == 8 and bm.stats.queries == 24
    # shared blocks are referenced twice
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants()


def test_salt_isolates_caches() -> None:
    bm = BlockManager(16, 4)
    assert admit(bm, make_seq("a", list(range(12)), salt="x"))
    assert bm.match_prefix(make_seq("b", list(range(12)), salt="y")) == []
    assert len(bm.match_prefix(make_seq("c", list(range(12)), salt="x"))) == 2


def test_freed_cached_blocks_stay_reusable_until_evicted_lru() -> None:
    bm = BlockManager(4, 4)
    a = make_seq("a", list(range(9)))  # 3 blocks, 2 full
    assert admit(bm, a)
    bm.free_seq(a)
    assert bm.usage == 0.0
    b = make_seq("b", list(range(9)))
    assert len(bm.match_prefix(b)) == 2  # still cached after free
    # a different request needing all 4 blocks evicts them
    c = make_seq("c", list(range(100, 116)))
    assert admit(bm, c)
    assert bm.match_prefix(b) == []
    bm.check_invariants()


def test_allocation_fails_without_side_effects_when_short() -> None:
    bm = BlockManager(2, 4)
    seq = make_seq("a", list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    assert admit(bm, make_seq("a", list(range(12))))
    assert bm.match_prefix(make_seq("b", list(range(12)))) == []


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "free", "grow"]),
            st.integers(0, 5),  # which prompt family (shared prefixes)
            st.integers(1, 40),  # length
        ),
        max_size=60,
    )
)
def test_pool_invariants_hold_under_random_operations(ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(24, 4)
    live: list[Sequence] = []
    for i, (op, fam, n) in enumerate(ops):
        if op == "add":
            seq = make_seq(f"s{i}", [fam * 1000 + t for t in range(n)])
            if admit(bm, seq):
                live.append(seq)
        elif op == "free" and live:
            seq = live.pop(fam % len(live))
            bm.free_seq(seq)
            bm.forget(seq)
        elif op == "grow" and live:
            seq = live[fam % len(live)]
            seq.append_token(7)
            if bm.allocate(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
            else:
                seq.token_ids.pop()
        bm.check_invariants()
        held = {b for s in live for b in s.block_table}
        assert bm.num_free_blocks == bm.num_blocks - len(held)
        for s in live:
            assert len(s.block_table) == bm.blocks_needed(s.num_computed_tokens)
    for s in live:
        bm.free_seq(s)
    assert bm.num_free_blocks == bm.num_blocks  # no leaked block
    bm.check_invariants()
