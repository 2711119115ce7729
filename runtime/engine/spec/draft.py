"""Draft-model proposals (`--speculative-method draft --speculative-model PATH`).

The draft is any smaller model with the target's tokenizer. Its K/V live in a paged pool of its own
that shares the target's block tables: position p of a sequence sits in the same block and slot in
both pools, so the target's allocation (proposal slots included) and its rollback (`trim`) cover
the draft too. Per sequence the draft tracks how many tokens it holds K/V for
(`seq.draft_num_computed`); after verification that count is cut back to what is still valid
(the target's `num_computed_tokens`), and the next proposal round first catches up on what it lacks
(the whole prompt on a sequence's first round, one or two tokens afterwards).

A round of K proposals is K batched draft forwards: the first computes the missing tokens of every
sequence and proposes d_1, each later one feeds d_j and proposes d_{j+1}. Greedy requests take the
draft's argmax; sampled ones draw from the draft's processed distribution q (the request's own
temperature, top-k/top-p, penalties), which verification needs for min(1, p/q).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from kvpilot.runtime.engine.runner import KVGeometry, ModelRunner, kv_geometry
from kvpilot.runtime.engine.sampler import SamplingRow, adjusted_logits, processed_probs, sample_from_probs
from kvpilot.runtime.engine.scheduler import ScheduledSeq
from kvpilot.runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.runtime.load.loader import LoadedModel


def check_draft_compatible(target: LoadedModel, draft: LoadedModel, max_model_len: int) -> None:
    """Refuse (ValueError naming --speculative-model) a draft that cannot propose target tokens."""
    where = f"--speculative-model {draft.path}"
    t_vocab, d_vocab = target.tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
    if t_vocab != d_vocab:
        missing = len(set(t_vocab.items()) - set(d_vocab.items()))
        raise ValueError(
            f"{where}: its tokenizer is not the target model's ({len(d_vocab)} vs {len(t_vocab)} tokens, "
            f"{missing} of the target's token ids differ); a draft must share the target's tokenizer"
        )
    if int(target.arch.vocab_size) != int(draft.arch.vocab_size):
        raise ValueError(
            f"{where}: its vocabulary has {draft.arch.vocab_size} logits, the target's "
            f"{target.arch.vocab_size}; a draft must share the target's vocabulary"
        )
    if draft.max_model_len < max_model_len:
        raise ValueError(
            f"{where}: the draft handles {draft.max_model_len} tokens of context, less than the "
            f"target's {max_model_len}; lower --max-model-len to {draft.max_model_len}"
        )


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class _DraftView:
    """What `prepare_batch` reads of a sequence, as the draft model sees it."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    spec_token_ids: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(self, draft: LoadedModel, target: LoadedModel, num_blocks: int, block_size: int) -> None:
        self.loaded = draft
        geo: KVGeometry = kv_geometry(draft.arch, block_size, draft.dtype)
        self.runner = ModelRunner(draft.model, geo, num_blocks, draft.device)
        # a draft step's cost relative to a target step (bandwidth-bound: the weights read)
        self.cost_ratio = parameter_count(draft.model) / max(1, parameter_count(target.model))

    @torch.inference_mode()
    def propose(self, scheduled: Seq[ScheduledSeq]) -> None:
        """Fill `seq.spec_token_ids` (num_spec_tokens placeholders each) with the draft's proposals."""
        if not scheduled:
            return
        seqs = [s.seq for s in scheduled]
        want = [s.num_spec_tokens for s in scheduled]
        proposals: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        views = [_DraftView(list(q.token_ids), q.draft_num_computed, q.block_table) for q in seqs]
        for j in range(max(want)):
            active = [i for i, k in enumerate(want) if k > j]
            batch = [
                ScheduledSeq(
                    cast(Sequence, views[i]), len(views[i].token_ids) - views[i].num_computed_tokens, True
                )
                for i in active
            ]
            logits = self.runner.execute(batch).logits
            rows = [
                SamplingRow(
                    seqs[i].params,
                    seqs[i].prompt_token_ids,
                    [*seqs[i].output_token_ids, *proposals[i]],
                    seqs[i].generator,
                    seqs[i].eos_token_ids,
                )
                for i in active
            ]
            adj = adjusted_logits(logits, rows)
            greedy = [r.greedy for r in rows]
            tokens = adj.argmax(dim=-1).tolist()
            if not all(greedy):
                sampled_idx = [n for n, g in enumerate(greedy) if not g]
                sampled_rows = [rows[n] for n in sampled_idx]
                probs = processed_probs(adj[sampled_idx], sampled_rows)
                draws = sample_from_probs(probs, sampled_rows).tolist()
                for m, n in enumerate(sampled_idx):
                    tokens[n] = draws[m]
                    qs[active[n]].append(probs[m])
            for n, i in enumerate(active):
                view = views[i]
                view.num_computed_tokens = len(view.token_ids)
                view.token_ids.append(tokens[n])
                proposals[i].append(tokens[n])
        for i, seq in enumerate(seqs):
            seq.spec_token_ids = proposals[i]
            seq.spec_draft_probs = torch.stack(qs[i]) if qs[i] else None
            seq.draft_num_computed = views[i].num_computed_tokens
