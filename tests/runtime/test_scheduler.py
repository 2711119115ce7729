"""Scheduler decisions (pure, no model): budgets, chunking, preemption order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.scheduler import Scheduler
from kvpilot.runtime.engine.sequence import Sequence, SequenceStatus


def seq(sid: str, n: int, max_tokens: int = 4, base: int = 0) -> Sequence:
    return Sequence(sid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    s.on_step_done(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(1)
            if item.seq.check_stop():
                s.finish(item.seq)
    return [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled]


def test_long_prompt_is_chunked_and_decodes_share_the_step() -> None:
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=10)
    s.add(seq("a", 3, max_tokens=10))
    assert run_step(s) == [("a", 3)]
    s.add(seq("b", 25))
    # a decodes (1 token), b gets the remaining 9 of the budget
    assert run_step(s) == [("a", 1), ("b", 9)]
    assert run_step(s) == [("a", 1), ("b", 9)]
    assert run_step(s) == [("a", 1), ("b", 7)]  # b's last chunk samples
    assert s.running[1].num_output_tokens == 1


def test_max_num_seqs_caps_running() -> None:
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(seq(f"r{i}", 3))
    assert [sid for sid, _ in run_step(s)] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_preempts_most_recent_and_admits_nobody_that_step() -> None:
    # 6 blocks of 4 tokens; three sequences of 7 tokens take 2 blocks each, then all need a 3rd
    s = Scheduler(BlockManager(6, 4, False), max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = seq("a", 7, 8), seq("b", 7, 8), seq("c", 7, 8)
    for x in (a, b, c):
        s.add(x)
    run_step(s)  # prefill: 7 tokens each + first sampled token -> 8 tokens, 2 blocks each
    run_step(s)  # decode: 8 computed tokens fill the 2 blocks; the next token needs a 3rd block
    s.add(seq("d", 2))
    out = s.schedule()
    assert [p.seq_id for p in out.preempted] == ["c"]
    assert [x.seq.seq_id for x in out.scheduled] == ["a", "b"]
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert s.waiting[0] is c  # the victim goes back to the front of the queue
    assert s.num_preemptions == 1


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
    num_blocks=st.integers(11, 30),
    budget=st.integers(4, 64),
)
def test_every_request_finishes_with_exact_length_under_pressure(
    lens: list[tuple[int, int]], num_blocks: int, budget: int
) -> None:
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget)
    seqs = [seq(f"r{i}", p, o, base=(i % 3) * 100) for i, (p, o) in enumerate(lens)]
    for x in seqs:
        assert bm.can_ever_fit(x.num_prompt_tokens + x.params.max_tokens)  # 42 tokens <= 11 blocks * 4
        s.add(x)
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        run_step(s)
        bm.check_invariants()
    assert not s.has_unfinished()
    for x, (_, o) in zip(seqs, lens, strict=True):
        assert x.num_output_tokens == o
    assert bm.num_free_blocks == num_blocks


def test_requests_sharing_a_prefix_wait_for_it_instead_of_recomputing() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    shared = list(range(12))
    a = Sequence("a", [*shared, 100], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Sequence("b", [*shared, 200], SamplingParams(max_tokens=4, ignore_eos=True))
    other = Sequence("c", [7, 7, 7, 7, 7, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    for x in (a, b, other):
        s.add(x)
    # step 1: a computes the shared prefix; b waits for it; c (different prefix) is admitted
    assert run_step(s) == [("a", 13), ("c", 6)]
    # step 2: b reuses a's three full blocks and computes only its last token
    assert ("b", 1) in run_step(s)
    assert b.num_cached_tokens == 12


def test_speculative_tokens_get_slots_and_are_dropped_before_anyone_is_preempted() -> None:
    # 5 blocks of 4 tokens; a decoding sequence with 7 tokens (6 computed) holds 2 blocks
    bm = BlockManager(5, 4, False)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = seq("a", 6, 20)
    s.add(a)
    run_step(s)  # prefill 6, sample 1 -> 7 tokens, 6 computed
    a.spec_token_ids = [1, 1, 1]
    out = s.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.num_spec_tokens, item.samples) == (4, 3, True)
    assert len(a.block_table) == 3  # positions 6..9 need a third block
    s.on_step_done(out)
    assert a.num_computed_tokens == 7  # only the sequence's own token is committed
    # the engine appends what verification accepted, then trims the proposals' slots
    a.append_token(1)
    a.spec_token_ids = []
    assert bm.trim(a) == 1 and len(a.block_table) == 2
    # a second sequence takes all but one block; proposals that no longer fit are dropped
    s.add(seq("b", 7, 20))
    run_step(s)
    assert bm.num_free_blocks == 1 and a.num_tokens == 9
    a.spec_token_ids = [1, 1, 1, 1, 1]  # positions 8..13 would need two more blocks
    out = s.schedule()
    assert not out.preempted and a.spec_token_ids == []
    assert next((x.seq.seq_id, x.num_spec_tokens) for x in out.scheduled) == ("a", 0)
    bm.check_invariants()


def test_proposals_that_exceed_the_budget_are_dropped_whole() -> None:
    s = Scheduler(BlockManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=4)
    a = seq("a", 3, 20)
    s.add(a)
    run_step(s)
    a.spec_token_ids = [1, 2, 3, 4]  # 1 + 4 tokens > the budget of 4
    out = s.schedule()
    assert [(x.num_new_tokens, x.num_spec_tokens) for x in out.scheduled] == [(1, 0)]
    a.spec_token_ids = [1, 2, 3]
    out2 = Scheduler(BlockManager(64, 4, False), 8, 4)
    out2.running.append(a)
    assert [(x.num_new_tokens, x.num_spec_tokens) for x in out2.schedule().scheduled] == [(4, 3)]
