"""Speculative decoding in the engine: plan the proposals of a step, verify them after it.

A step with speculation looks like this for a decoding sequence with tokens t_1..t_L (K/V computed
for L - 1 of them) and proposals d_1..d_K:

1. `plan()` (before scheduling) sets `seq.spec_token_ids` to up to K proposals: the n-gram
   continuation (runtime/engine/spec/ngram.py), or placeholders that the draft model fills in after
   scheduling; how many follows the adaptive rule (runtime/engine/spec/policy.py).
2. The scheduler allocates KV slots for t_L, d_1..d_K (dropping the proposals rather than preempting
   anyone for them) and the model computes them in one forward pass, returning K + 1 logit rows.
3. `verify()` keeps the accepted prefix d_1..d_a plus one token of the target's own
   (runtime/engine/spec/rejection.py); the engine commits K/V for t_L, d_1..d_a and releases the slots
   beyond the sequence's tokens (`BlockManager.trim`). The rejected positions' K/V are stale but
   unreachable: they lie past the sequence's length and are overwritten before they are read.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.runtime.engine.protocol import TokenLogprob
from kvpilot.runtime.engine.sampler import Sampler, SamplingRow, adjusted_logits, processed_probs
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.engine.spec.ngram import propose_ngram
from kvpilot.runtime.engine.spec.policy import (
    DEFAULT_SATURATION_TOKENS,
    acceptance_estimate,
    choose_num_spec_tokens,
)
from kvpilot.runtime.engine.spec.rejection import greedy_verify, rejection_sample
from kvpilot.runtime.grammar.structured_output import apply_bitmask, new_bitmask

if TYPE_CHECKING:
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.spec.draft import DraftProposer


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications (one per sequence and step with proposals)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposals accepted
    num_emitted_tokens: int = 0  # tokens verification produced (accepted + the target's own)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class SpecSettings:
    method: str  # "ngram" | "draft"
    num_tokens: int  # K, the most proposed per step
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    saturation_tokens: float = 20.0
    draft_cost: float = 0.0  # a draft step's cost relative to a target step (adaptive rule)


@dataclass
class Verified:
    token_ids: list[int]  # 1..K+1 tokens to append
    logprobs: list[TokenLogprob | None]
    num_accepted: int


def is_decoding(seq: Sequence) -> bool:
    """All tokens but the last are in the cache and the sequence has output: a decode step."""
    return seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1


class Speculator:
    def __init__(
        self, settings: SpecSettings, max_model_len: int, draft: DraftProposer | None = None
    ) -> None:
        if settings.method == "draft" and draft is None:
            raise ValueError("--speculative-method draft needs its draft model")
        self.settings = settings
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecDecodeStats()

    def max_proposals(self, seq: Sequence) -> int:
        """K, capped so that the proposals plus the target's token stay within max_tokens and the
        model's context."""
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(self.settings.num_tokens, left, self.max_model_len - seq.num_tokens))

    def num_to_propose(self, seq: Sequence, batch_size: int) -> int:
        s = self.settings
        k_max = self.max_proposals(seq)
        if k_max == 0 or (s.disable_by_batch_size is not None and batch_size >= s.disable_by_batch_size):
            return 0
        if not s.adaptive:
            return k_max
        alpha = acceptance_estimate(seq.spec_num_accepted, seq.spec_num_rejected)
        return choose_num_spec_tokens(k_max, alpha, batch_size, s.saturation_tokens, s.draft_cost)

    def plan(self, running: Seq[Sequence]) -> None:
        """Set this step's proposals (n-gram) or their number (draft placeholders)."""
        batch_size = len(running)
        for seq in running:
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
            if not is_decoding(seq):
                continue
            k = self.num_to_propose(seq, batch_size)
            if k == 0:
                continue
            if self.settings.method == "ngram":
                s = self.settings
                seq.spec_token_ids = propose_ngram(seq.token_ids, k, s.prompt_lookup_min, s.prompt_lookup_max)
            else:
                seq.spec_token_ids = [0] * k  # the draft model fills these in after scheduling

    def verify(self, logits: torch.Tensor, seq: Sequence) -> Verified:
        """logits: the K + 1 raw rows of one sequence whose K proposals were computed this step."""
        proposal = seq.spec_token_ids
        k = len(proposal)
        params = seq.params
        base = SamplingRow.from_sequence(seq)
        needs_history = base.has_penalties or params.min_tokens > 0
        out = list(seq.output_token_ids)
        rows = [
            SamplingRow(params, base.prompt_token_ids, out + proposal[:i], seq.generator, seq.eos_token_ids)
            if needs_history
            else base
            for i in range(k + 1)
        ]
        if seq.grammar is not None:
            # structured output: each position's mask along the proposals (the matcher is rolled
            # back after the walk); a proposal the grammar refuses gets probability 0 and is rejected
            bitmask = new_bitmask(k + 1, logits.shape[1])
            seq.grammar.probe(proposal, bitmask, 0)
            guided = logits.float().clone()
            apply_bitmask(guided, bitmask)
            adj = adjusted_logits(guided, rows)
        else:
            adj = adjusted_logits(logits, rows)
        if base.greedy:
            tokens = greedy_verify(adj.argmax(dim=-1).tolist(), proposal)
        else:
            probs = processed_probs(adj, rows)
            tokens = rejection_sample(probs, proposal, seq.spec_draft_probs, seq.generator)
        accepted = len(tokens) - 1
        logprobs = Sampler.logprobs_of(logits[: len(tokens)], tokens, rows[: len(tokens)])
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += accepted
        st.num_emitted_tokens += len(tokens)
        seq.spec_num_proposed += k
        seq.spec_num_accepted += accepted
        if accepted < k:
            seq.spec_num_rejected += 1
        return Verified(tokens, logprobs, accepted)


def make_speculator(
    cfg: EngineConfig, max_model_len: int, device_type: str, draft: DraftProposer | None = None
) -> Speculator | None:
    """The engine's speculator for `cfg` (None when --speculative-method is not set)."""
    if cfg.speculative_method is None:
        return None
    assert cfg.num_speculative_tokens is not None  # EngineConfig checks it
    settings = SpecSettings(
        method=cfg.speculative_method,
        num_tokens=cfg.num_speculative_tokens,
        prompt_lookup_min=cfg.prompt_lookup_min,
        prompt_lookup_max=cfg.prompt_lookup_max,
        adaptive=cfg.speculative_adaptive,
        disable_by_batch_size=cfg.speculative_disable_by_batch_size,
        saturation_tokens=DEFAULT_SATURATION_TOKENS.get(device_type, DEFAULT_SATURATION_TOKENS["cpu"]),
        draft_cost=draft.cost_ratio if draft is not None else 0.0,
    )
    return Speculator(settings, max_model_len, draft)
