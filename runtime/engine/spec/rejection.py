"""Verification of speculative proposals: keep what the target model would have produced.

Greedy rows keep the proposals up to the first one that differs from the target's argmax and then
take the target's token, so the output is exactly the non-speculative one.

Sampled rows use the standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023):
proposal d_i, drawn from the draft distribution q_i, is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from the normalized residual
max(0, p_i - q_i) and the rest is discarded; when every proposal is accepted a bonus token is drawn
from p_K. Each emitted token is then distributed exactly as p. For n-gram proposals q_i is a point
mass on d_i: accept with probability p_i(d_i), otherwise draw from p_i without d_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_verify(target_token_ids: Sequence[int], proposal: Sequence[int]) -> list[int]:
    """`target_token_ids`: the target's choice at each of the K + 1 rows. Returns the accepted
    prefix of the proposal followed by the target's own token (1..K+1 tokens)."""
    out: list[int] = []
    for i, d in enumerate(proposal):
        out.append(target_token_ids[i])
        if target_token_ids[i] != d:
            return out
    out.append(target_token_ids[len(proposal)])
    return out


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator, device=generator.device if generator else None))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from an (unnormalized, non-negative) probability row by inverting its CDF."""
    cdf = probs.double().cumsum(0)
    u = _uniform(generator) * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, probs.shape[0] - 1)
    if float(probs[idx]) <= 0.0:  # rounding at the very end of the CDF: take the mode
        idx = int(probs.argmax())
    return idx


def rejection_sample(
    target_probs: torch.Tensor,
    proposal: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify K proposals against the target's distributions.

    target_probs: [K + 1, V] rows p_0..p_K (row i is the distribution of the token proposal[i]
    stands for; row K is the bonus row). draft_probs: [K, V] rows q_i the proposals were drawn
    from, or None for point masses (n-gram proposals). Returns 1..K+1 tokens. Deterministic for
    a seeded generator."""
    k = len(proposal)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{target_probs.shape[0]} target rows for {k} proposals (need K + 1)")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"{draft_probs.shape[0]} draft rows for {k} proposals")
    out: list[int] = []
    for i, d in enumerate(proposal):
        p = target_probs[i].double()
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        # accept with probability min(1, p/q): u < p/q  <=>  u * q < p
        if q_d > 0.0 and _uniform(generator) * q_d < p_d:
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i].double()).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q (only reachable by rounding): p itself
            residual = p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[k].double(), generator))
    return out
