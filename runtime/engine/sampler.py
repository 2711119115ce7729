"""Turn a batch of next-token logits into token ids, one row per sequence.

Order of processing (vLLM's): penalties -> min_tokens masking -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> sample. Logprobs are those of the *raw* model distribution (log-softmax of
the logits before penalties, temperature and truncation), which is what OpenAI and vLLM report.

Random rows are sampled by inverting the CDF with one uniform number per row. A seeded row draws
that number from its own generator, so its output depends on its seed alone and not on which other
rows share the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpilot.runtime.engine.protocol import TokenLogprob
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.structured_output import GrammarState, apply_bitmask, new_bitmask

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
    grammar: GrammarState | None = None  # structured output: the row's allowed tokens come from it

    @classmethod
    def from_sequence(cls, seq: Any) -> SamplingRow:
        """Build a row from an engine `Sequence` (duck-typed: params, prompt/output ids, generator)."""
        return cls(
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            eos_token_ids=seq.eos_token_ids,
            grammar=seq.grammar,
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
        logits = masked_by_grammar(logits, rows)

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
        logits = adjusted_logits(logits, rows)
        sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy_idx = [i for i, r in enumerate(rows) if r.greedy]
        random_idx = [i for i, r in enumerate(rows) if not r.greedy]
        if greedy_idx:
            sampled[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
        if len(random_idx) == len(rows):  # all random: no gather/scatter of rows
            return sample_from_probs(processed_probs(logits, rows), rows)
        if random_idx:
            random_rows = [rows[i] for i in random_idx]
            probs = processed_probs(logits[random_idx], random_rows)
            sampled[random_idx] = sample_from_probs(probs, random_rows)
        return sampled

    @staticmethod
    def logprobs_of(
        logits: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]
    ) -> list[TokenLogprob | None]:
        """Raw-distribution logprobs of given tokens, one per row (speculative verification)."""
        if not any(r.params.logprobs is not None for r in rows):
            return [None] * len(rows)
        chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return Sampler._gather_logprobs(Sampler._logprobs(logits.float(), rows), chosen, token_ids, rows)

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


def adjusted_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalties, then min_tokens masking, on [R, V] logits (a new tensor when anything changes)."""
    pen_rows = [i for i, r in enumerate(rows) if r.has_penalties]
    if pen_rows or any(r.min_tokens_active for r in rows):
        logits = logits.clone()  # the caller's tensor stays untouched
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
    return logits


def masked_by_grammar(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Structured output: disallowed tokens of guided rows set to -inf, all rows in one bitmask
    (a new tensor when any row is guided; logprobs stay those of the raw distribution)."""
    guided = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not guided:
        return logits
    bitmask = new_bitmask(len(rows), logits.shape[1])
    for i in guided:
        grammar = rows[i].grammar
        assert grammar is not None
        grammar.fill(bitmask, i)
    out = logits.clone()
    apply_bitmask(out, bitmask, guided)
    return out


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
    x = logits
    if any(r.params.temperature != 1.0 for r in rows):
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


# Top-k/top-p look only at the best candidates when they provably suffice (a top-k limit, or a
# nucleus whose mass the candidates already cover); a full sort of the vocabulary is the fallback.
_CANDIDATE_WIDTHS = (128, 1024)


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask [R, V] scaled logits to each row's top-k, then to the nucleus of the (renormalized)
    top-k distribution, as vLLM does. Rows with neither limit pass through unchanged."""
    vocab = x.shape[1]
    k_limits = [k for k in top_k if k < vocab]
    p_only = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k >= vocab and p < 1.0]
    full_probs = torch.softmax(x[p_only], dim=-1) if p_only else None
    for cand in _CANDIDATE_WIDTHS:
        width = max([*k_limits, cand if p_only else 0])
        if width >= vocab:
            break
        vals, idx = x.topk(width, dim=-1)  # sorted, best first
        true_mass = None
        if full_probs is not None:
            true_mass = full_probs.gather(1, idx[p_only])
            p_needed = torch.tensor([top_p[i] for i in p_only], device=x.device, dtype=x.dtype)
            if bool((true_mass.sum(dim=-1) < p_needed).any()):
                continue  # the nucleus may reach beyond the candidates: widen
        masked = _mask_sorted(vals, top_k, top_p, p_only, true_mass)
        out = torch.full_like(x, float("-inf")).scatter(1, idx, masked)
        plain = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k >= vocab and p >= 1.0]
        if plain:
            out[plain] = x[plain]
        return out
    sorted_x, order = x.sort(dim=-1, descending=True)
    true_mass = torch.softmax(sorted_x[p_only], dim=-1) if p_only else None
    masked = _mask_sorted(sorted_x, top_k, top_p, p_only, true_mass)
    return torch.full_like(x, float("-inf")).scatter(1, order, masked)


def _mask_sorted(
    sorted_x: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    p_only: list[int],
    true_mass: torch.Tensor | None,
) -> torch.Tensor:
    """Top-k then top-p on logits sorted best-first. For rows without top-k (`p_only`) the nucleus
    uses `true_mass`, the full-vocabulary probabilities of the sorted entries."""
    device = sorted_x.device
    positions = torch.arange(sorted_x.shape[1], device=device).unsqueeze(0)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    out = sorted_x.masked_fill(positions >= k, float("-inf"))
    if all(p >= 1.0 for p in top_p):
        return out
    sorted_probs = torch.softmax(out, dim=-1)
    if true_mass is not None:
        sorted_probs[p_only] = true_mass
    p = torch.tensor(top_p, device=device, dtype=sorted_x.dtype).unsqueeze(1)
    # Keep the smallest prefix whose mass reaches p: drop a token when the mass before it does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # (rows with p = 1 keep everything: float32 cumsums can reach 1.0 before the last token)
    drop = (mass_before >= p) & (p < 1.0)
    drop[:, 0] = False
    return out.masked_fill(drop, float("-inf"))


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


def sample_from_probs(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One draw per row by inverting the CDF with a single uniform number.

    A seeded row takes its number from its own generator (on the generator's device, so a CPU
    generator works for CUDA logits), so its draw depends on its seed alone. One uniform per row is
    also far cheaper than a vocabulary-sized noise tensor.
    """
    num_rows = probs.shape[0]
    device = probs.device
    u = torch.empty(num_rows, 1, device=device, dtype=probs.dtype)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, device=device, dtype=probs.dtype)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator, device=r.generator.device).to(device, probs.dtype)
    cdf = probs.cumsum(dim=-1)
    # Scale by the row's total so float32 rounding in the cumsum can never push u past the end.
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(probs.shape[1] - 1)
    # At the very end of the CDF rounding could still land on a masked token: take the mode then.
    ok = probs.gather(1, idx) > 0
    if not bool(ok.all()):
        idx = torch.where(ok, idx, probs.argmax(dim=-1, keepdim=True))
    return idx.squeeze(1)
