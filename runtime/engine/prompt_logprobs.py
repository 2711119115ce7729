"""Prompt log-probabilities: each prompt token's logprob given the tokens before it, with the top
alternatives (SamplingParams.prompt_logprobs; the completions API's echo + logprobs).

The runner asks the model's last layer for the rows of a prefill chunk that score a prompt token
(`PromptRows`, built in prepare_batch) beside the rows it samples from, and turns them into logprobs
here, a slice of rows at a time: logits, float32 log_softmax, the prompt token's entry, its rank and
the top k, so no [rows, vocab] tensor larger than one slice is ever held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpilot.runtime.engine.protocol import TokenLogprob

if TYPE_CHECKING:
    from kvpilot.runtime.engine.sequence import Sequence

# rows per slice: float32 logits of 128 rows are 25 MiB at a 49k vocabulary, 128 MiB at 256k
ROWS_PER_SLICE = 128


@dataclass
class PromptRows:
    """The flat rows of a step whose logits score a prompt token, in order, and whose they are."""

    rows: list[int] = field(default_factory=list)  # rows of the flat batch
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    top_k: list[int] = field(default_factory=list)  # alternatives wanted for each row
    spans: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, its rows), in row order

    def add(self, seq: Sequence, first_row: int, positions: range) -> None:
        """Positions `positions` of `seq`, the first of them at flat row `first_row`."""
        if not positions:
            return
        k = seq.params.prompt_logprobs or 0
        self.rows.extend(range(first_row, first_row + len(positions)))
        self.targets.extend(seq.token_ids[p + 1] for p in positions)
        self.top_k.extend([k] * len(positions))
        self.spans.append((seq, len(positions)))

    def __len__(self) -> int:
        return len(self.rows)


def token_logprobs(
    hidden: torch.Tensor,
    targets: list[int],
    top_k: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows_per_slice: int = ROWS_PER_SLICE,
) -> list[TokenLogprob]:
    """For each row of `hidden` (final hidden states [n, hidden]), the logprob and rank of
    `targets[i]` and its `top_k[i]` best alternatives, under the model's raw distribution."""
    out: list[TokenLogprob] = []
    for start in range(0, hidden.shape[0], rows_per_slice):
        logits = compute_logits(hidden[start : start + rows_per_slice]).float()
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        n = logp.shape[0]
        tgt = torch.tensor(targets[start : start + n], dtype=torch.long, device=logp.device)
        chosen = logp.gather(1, tgt[:, None])
        ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
        ks = top_k[start : start + n]
        k = min(max(ks), logp.shape[1])
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k > 0:
            vals, ids = logp.topk(k, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for i, (t, lp) in enumerate(zip(tgt.tolist(), chosen.squeeze(1).tolist(), strict=True)):
            top = list(zip(top_ids[i][: ks[i]], top_vals[i][: ks[i]], strict=True)) if ks[i] else []
            out.append(TokenLogprob(token_id=t, logprob=lp, top=top, rank=ranks[i]))
    return out


def split(prompt: PromptRows, lps: list[TokenLogprob]) -> list[tuple[Sequence, list[TokenLogprob]]]:
    """Pure: the logprobs of `prompt`'s rows, per sequence."""
    out: list[tuple[Sequence, list[TokenLogprob]]] = []
    i = 0
    for seq, n in prompt.spans:
        out.append((seq, lps[i : i + n]))
        i += n
    return out
