"""Verification of proposals: greedy keeps the target's tokens; rejection sampling leaves the output
distribution exactly the target's (chi-square tests on a small vocabulary, seeded, deterministic)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.runtime.engine.spec.rejection import greedy_verify, rejection_sample

# chi-square critical value for 4 degrees of freedom at p = 0.001 (a correct sampler fails 1 in 1000)
CHI2_4_999 = 18.467
TRIALS = 20_000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


P = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
Q = torch.tensor([0.10, 0.15, 0.50, 0.05, 0.20])


def first_token_counts(sampler: object, draft_probs: torch.Tensor | None, seed: int) -> torch.Tensor:
    """Draw TRIALS first tokens: the proposal is drawn from Q (or fixed at token 2 for a point mass)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(5)
    target = torch.stack([P, P])  # K = 1: a proposal row and the bonus row
    for _ in range(TRIALS):
        d = 2 if draft_probs is None else int(torch.multinomial(Q, 1, generator=g))
        tokens = sampler(target, [d], None if draft_probs is None else draft_probs[None], g)  # type: ignore[operator]
        counts[tokens[0]] += 1
    return counts


@pytest.mark.parametrize("draft", ["model", "point_mass"])
def test_rejection_sampling_keeps_the_target_distribution(draft: str) -> None:
    counts = first_token_counts(rejection_sample, Q if draft == "model" else None, seed=0)
    assert chi_square(counts, P) < CHI2_4_999, counts


def biased_accept_always(
    target: torch.Tensor, proposal: list[int], q: torch.Tensor | None, g: torch.Generator
) -> list[int]:
    return [proposal[0]]


def biased_resample_from_p(
    target: torch.Tensor, proposal: list[int], q: torch.Tensor | None, g: torch.Generator
) -> list[int]:
    """The classic bug: on rejection draw from p instead of the residual max(0, p - q)."""
    d = proposal[0]
    q_d = 1.0 if q is None else float(q[0, d])
    if float(torch.rand(1, generator=g)) * q_d < float(target[0, d]):
        return [d]
    return [int(torch.multinomial(target[0], 1, generator=g))]


@pytest.mark.parametrize("biased", [biased_accept_always, biased_resample_from_p])
@pytest.mark.parametrize("draft", ["model", "point_mass"])
def test_the_chi_square_check_catches_biased_verifiers(biased: object, draft: str) -> None:
    counts = first_token_counts(biased, Q if draft == "model" else None, seed=0)
    assert chi_square(counts, P) > 10 * CHI2_4_999


def test_every_position_keeps_the_target_distribution() -> None:
    """K = 2 with different target rows: the second token, given the first, is distributed as p_1
    (conditioning on first token 0, which the proposal 0 and the residual draw both produce)."""
    p0 = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    p1 = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3])
    q0 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    q1 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    for _ in range(TRIALS):
        d0 = int(torch.multinomial(q0, 1, generator=g))
        d1 = int(torch.multinomial(q1, 1, generator=g))
        out = rejection_sample(torch.stack([p0, p1, p1]), [d0, d1], torch.stack([q0, q1]), g)
        if out[0] == 0:
            counts[out[1]] += 1
    assert chi_square(counts, p1) < CHI2_4_999, counts


def test_seeded_verification_is_deterministic_and_shapes_are_checked() -> None:
    target = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [rejection_sample(target, [1, 2, 3], None, torch.Generator().manual_seed(9)) for _ in range(2)]
    assert runs[0] == runs[1] and 1 <= len(runs[0]) <= 4
    with pytest.raises(ValueError, match="K \\+ 1"):
        rejection_sample(target, [1, 2], None)
    with pytest.raises(ValueError, match="draft rows"):
        rejection_sample(target, [1, 2, 3], target[:2])


def test_zero_probability_proposals_are_always_rejected_and_sure_ones_accepted() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(p, [0, 2], None, g) == [1]  # p(0) = 0: rejected, residual is token 1
    assert rejection_sample(p, [1, 2], None, g) == [1, 2, 0]  # certain: both accepted + bonus


def test_greedy_verify() -> None:
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token at the mismatch
    assert greedy_verify([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert greedy_verify([3], []) == [3]
