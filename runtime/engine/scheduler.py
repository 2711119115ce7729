"""Continuous batching with chunked prefill and preemption.

Every step hands out a token budget: running sequences first (decodes and unfinished prefill
chunks), then waiting ones, within `max_num_batched_tokens` and `max_num_seqs`. When blocks run out,
the most recently admitted running sequence is preempted (its blocks freed, recomputed later) instead
of failing anyone, and no new sequence is admitted in a step that preempted. With LoRA serving,
the running sequences use at most `max_loras` distinct adapters (the device slots): a waiting
request for another adapter waits while others behind it may go ahead.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.protocol import TokenLogprob
from kvpilot.runtime.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

# What sampling chose for one scheduled sequence: the tokens to append, their logprobs, and how many
# of them are accepted speculative proposals (whose K/V this step already computed).
SampledTokens = tuple[list[int], list[TokenLogprob | None], int]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    samples: bool = False  # the chunk reaches the end of the sequence, so the step samples a token
    # speculative tokens (seq.spec_token_ids) computed after the sequence's own tokens; the step then
    # returns logits for the last 1 + num_spec_tokens rows so that the proposals can be verified
    num_spec_tokens: int = 0
    # prompt logprobs: the positions of this chunk whose logits score the prompt token after them
    prompt_logprob_positions: range = range(0)

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        samples = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        return cls(seq, num_new_tokens, samples, 0, prompt_logprob_positions(seq, num_new_tokens))


def prompt_logprob_positions(seq: Sequence, num_new_tokens: int) -> range:
    """Pure: the positions of a chunk of `num_new_tokens` tokens from `seq.num_computed_tokens` whose
    logits give prompt logprobs still missing (position p scores prompt token p + 1; a recomputed
    chunk after preemption skips those already recorded)."""
    if not seq.needs_prompt_logprobs:
        return range(0)
    first = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
    end = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)
    return range(first, max(first, end))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int | None = None,
    ) -> None:
        self.bm = block_manager
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        # called with a finishing (or aborted) sequence before its blocks are freed (KV transfer pins)
        self.before_free: Callable[[Sequence], None] | None = None

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Remove a sequence wherever it is and free its blocks (finished or aborted)."""
        if reason is not None:
            seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if self.before_free is not None:
            self.before_free(seq)
        self.bm.free_seq(seq)
        self.bm.forget(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.spec_token_ids = []
        seq.draft_num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_largest(self, count: int = 1) -> list[Sequence]:
        """Used by OOM recovery: push the sequences holding the most blocks back to the queue."""
        victims = sorted(self.running, key=lambda s: len(s.block_table), reverse=True)[:count]
        for seq in victims:
            self._preempt(seq)
        return victims

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        budget = self.max_num_batched_tokens if token_budget is None else token_budget
        out = SchedulerOutput()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_tokens - seq.num_computed_tokens
            assert pending > 0, "a running sequence always has a token to compute"
            if seq.spec_token_ids and pending + len(seq.spec_token_ids) > budget:
                seq.spec_token_ids = []  # proposals only ever run whole, never cut by the budget
            num_new = min(pending + len(seq.spec_token_ids), budget)
            while not self.bm.allocate(seq, num_new):
                if seq.spec_token_ids:  # drop the proposals before preempting anyone for them
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                num_spec = len(seq.spec_token_ids)
                samples = num_spec > 0 or num_new == pending
                positions = prompt_logprob_positions(seq, num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new, samples, num_spec, positions))
                budget -= num_new
                i += 1
                continue
            # `seq` preempted itself: everything after it is gone too, stop here
            break
        # victims were taken from the tail, so anything scheduled earlier is still running
        out.scheduled = [s for s in out.scheduled if s.seq.status == SequenceStatus.RUNNING]

        if out.preempted:
            return out

        now = time.monotonic()
        # Prefix-aware admission: a waiting request whose first block another request is computing
        # right now waits one step and then reuses it, instead of computing the same prefix again.
        inflight = {h for h in map(self.bm.first_block_hash, self._prefilling()) if h is not None}
        deferred: list[Sequence] = []
        adapters = {s.lora.name for s in self.running if s.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (
                seq.lora is not None
                and self.max_loras is not None
                and seq.lora.name not in adapters
                and len(adapters) >= self.max_loras
            ):
                deferred.append(self.waiting.popleft())  # every slot is taken by running adapters
                continue
            # prompt logprobs need the logits of every prompt position: no prefix-cache reads
            reads_cache = not seq.block_table and not seq.needs_prompt_logprobs
            first = self.bm.first_block_hash(seq) if reads_cache else None
            if first is not None and first in inflight and not self.bm.is_cached(first):
                deferred.append(self.waiting.popleft())
                continue
            cached = self.bm.match_prefix(seq) if reads_cache else []
            remaining = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.bm.block_size
            num_new = min(remaining, budget)
            if not self.bm.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, num_new))
            budget -= num_new
            if first is not None:
                inflight.add(first)
            if seq.lora is not None:
                adapters.add(seq.lora.name)
        self.waiting.extendleft(reversed(deferred))
        return out

    def _prefilling(self) -> list[Sequence]:
        return [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]

    def add_prompt_logprobs(self, computed: list[tuple[Sequence, list[TokenLogprob]]]) -> None:
        """Record the prompt logprobs a step computed (before `on_step_done` advances the counts)."""
        for seq, lps in computed:
            assert seq.num_computed_tokens <= len(seq.prompt_logprobs), "prompt logprobs out of order"
            seq.prompt_logprobs.extend(lps)

    def on_step_done(self, out: SchedulerOutput) -> int:
        """Advance computed-token counts and publish completed blocks to the prefix cache; returns
        the prompt tokens this step computed."""
        prompt_tokens = 0
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            # speculative tokens are not committed here: `update` adds the accepted ones after
            # verification (and releases the slots of the rejected ones)
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens
            self.bm.cache_full_blocks(seq)
        return prompt_tokens

    def update(self, sampled: list[ScheduledSeq], tokens: list[SampledTokens], now: float) -> StepUpdate:
        """Commit what sampling chose: append the tokens, advance each grammar, check stops, finish
        the sequences that are done and settle speculation (accepted proposals kept, the rest of
        their slots released). Returns the sequences that changed, in order."""
        update = StepUpdate()
        for s, (token_ids, lps, accepted) in zip(sampled, tokens, strict=True):
            seq = s.seq
            # K/V of the accepted proposals was computed this step
            seq.num_computed_tokens += accepted
            finished = False
            for token_id, lp in zip(token_ids, lps, strict=True):
                seq.append_token(token_id, lp)
                update.num_generated += 1
                if seq.grammar is not None and not seq.grammar.accept(token_id):
                    # the mask allowed only tokens the grammar accepts: a bug, not the client's
                    log.error("request %s: token %d violates its grammar", seq.seq_id, token_id)
                    seq.finish_reason, seq.stop_reason = "abort", None
                    finished = True
                    break
                if seq.check_stop():
                    finished = True
                    break
            if seq.first_token_time is None:
                seq.first_token_time = now
            if finished:
                self.finish(seq)
            elif s.num_spec_tokens:
                self.commit_speculation(seq)
            update.touched.append(seq)
        for s in sampled:
            s.seq.spec_token_ids = []
            s.seq.spec_draft_probs = None
        return update

    def commit_speculation(self, seq: Sequence) -> None:
        """After verification: release the slots past the sequence's tokens and publish blocks the
        accepted tokens completed; the draft model's cache keeps only what is still valid."""
        self.bm.trim(seq)
        self.bm.cache_full_blocks(seq)
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)

    def drop_speculation(self, out: SchedulerOutput) -> None:
        """A failed step: forget its proposals and their slots (nothing was committed)."""
        for s in out.scheduled:
            if s.num_spec_tokens:
                s.seq.spec_token_ids = []
                s.seq.spec_draft_probs = None
                self.bm.trim(s.seq)
                s.seq.draft_num_computed = min(s.seq.draft_num_computed, s.seq.num_computed_tokens)


@dataclass
class StepUpdate:
    touched: list[Sequence] = field(default_factory=list)  # sequences with new tokens or finished
    num_generated: int = 0  # tokens appended
