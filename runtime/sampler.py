"""Turn a batch of next-token logits into token ids, one row per sequence.

Order of processing (vLLM's): penalties -> min_tokens masking -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> sample. Logprobs are those of the *raw* model distribution (log-softmax of
the logits before penalties, temperature and truncation), which is what OpenAI and vLLM report.

Random rows are sampled with the exponential race (argmax of p / q, q ~ Exp(1)), which is exactly
a draw from p. A seeded row draws its noise from its own generator, V values per step, so its output
depends on its seed alone and not on which other rows share the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvpilot.runtime.sampling_params import SamplingParams
from kvpilot.runtime.sequence import TokenLogprob

# Temperatures below this are treated as greedy (dividing by them would overflow).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # set when params.seed is set
    eos_token_ids: Collection[int] = field(default_factory=frozenset)

    @classmethod
    def from_sequence(cls, seq: Any) -> SamplingRow:
        """Build a row from an engine `Sequence` (duck-typed: params, prompt/output ids, generator)."""
        return cls(
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            eos_token_ids=seq.eos_token_ids,
        )

    @property
    def greedy(self) -> bool:
        return self.params.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0

    @property
    def min_tokens_active(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask for logprobs


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    """Stateless; one instance per model runner."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        logprobs_out = self._logprobs(logits, rows) if any(want_logprobs) else None

        if all(r.greedy and not r.has_penalties and not r.min_tokens_active for r in rows):
            # Hot path: plain greedy decoding, one kernel.
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_general(logits, rows)

        token_ids: list[int] = sampled.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if logprobs_out is not None:
            logprobs = self._gather_logprobs(logprobs_out, sampled, token_ids, rows)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs)

    # ------------------------------------------------------------------------------------------
    def _sample_general(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        logits = logits.clone()
        pen_rows = [i for i, r in enumerate(rows) if r.has_penalties]
        if pen_rows:
            sub = apply_penalties(logits[pen_rows], [rows[i] for i in pen_rows])
            logits[pen_rows] = sub
        for i, r in enumerate(rows):
            if r.min_tokens_active:
                banned = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    banned |= set(r.eos_token_ids)
                banned_ids = [t for t in banned if 0 <= t < logits.shape[1]]
                if banned_ids:
                    logits[i, banned_ids] = float("-inf")

        sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy_idx = [i for i, r in enumerate(rows) if r.greedy]
        random_idx = [i for i, r in enumerate(rows) if not r.greedy]
        if greedy_idx:
            sampled[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
        if random_idx:
            random_rows = [rows[i] for i in random_idx]
            probs = processed_probs(logits[random_idx], random_rows)
            noise = _exponential_noise(probs, random_rows)
            sampled[random_idx] = (probs / noise).argmax(dim=-1)
        return sampled

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # Raw model distribution, computed before penalties/temperature touch the logits.
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]
    ) -> list[TokenLogprob | None]:
        chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
        max_k = max((r.params.logprobs or 0) for r in rows)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_k > 0:
            vals, ids = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[TokenLogprob | None] = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is None:
                out.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_vals[i][:k], strict=True)) if k > 0 else []
            out.append(TokenLogprob(token_id=token_ids[i], logprob=chosen[i], top=top))
        return out


# ----------------------------------------------------------------------------------------------
# The processing steps, exposed for tests and for anyone who needs the processed distribution.


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM semantics on [P, V] logits (returns a new tensor).

    repetition: tokens seen in the prompt or the output have positive logits divided by the penalty
    and negative ones multiplied by it; frequency: minus penalty * count in the output; presence:
    minus penalty if the token occurs in the output at all.
    """
    vocab = logits.shape[1]
    device = logits.device
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    in_output = output_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)

    out = logits
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = in_output | (_token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0)
        penalized = torch.where(out > 0, out / rep, out * rep)
        out = torch.where(seen, penalized, out)
    out = out - freq * output_counts - pres * in_output.to(out.dtype)
    return out


def processed_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on [R, V] logits of random (non-greedy) rows -> probs."""
    vocab = logits.shape[1]
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=device, dtype=logits.dtype)
    x = logits / temps.unsqueeze(1)

    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        x = _apply_top_k_top_p(x, top_k, top_p)

    probs = torch.softmax(x, dim=-1)
    min_p = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in min_p):
        mp = torch.tensor(min_p, device=device, dtype=probs.dtype).unsqueeze(1)
        threshold = mp * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = x.shape[1]
    device = x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    drop = positions >= k
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=device, dtype=x.dtype).unsqueeze(1)
    if (p < 1.0).any():
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches p: drop a token when the mass before it does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_p = mass_before >= p
        drop_p[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop_p, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each token id (ids outside the vocab are ignored)."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            padded[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long).clamp(0, vocab)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, r in enumerate(rows):
        g = r.generator
        if g is None:
            continue
        # Draw on the generator's own device so a CPU generator works for CUDA logits too.
        row_noise = torch.empty(probs.shape[1], device=g.device).exponential_(generator=g)
        noise[i] = row_noise.to(probs.device)
    # exponential_ can return exactly 0 on some backends; p / 0 would pick a masked token.
    return noise.clamp_min_(1e-20)
