"""The adaptive speculation rule (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.runtime.engine.spec.policy import (
    acceptance_estimate,
    choose_num_spec_tokens,
    expected_tokens,
    token_rate,
)

S = 20.0  # the CPU saturation size


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_estimate_starts_neutral_and_follows_the_counts() -> None:
    assert acceptance_estimate(0, 0) == 0.5
    assert acceptance_estimate(90, 10) == pytest.approx(91 / 102)
    assert acceptance_estimate(0, 20) < 0.05


def test_speculates_fully_alone_with_good_acceptance() -> None:
    assert choose_num_spec_tokens(8, 0.9, 1, S) == 8
    assert choose_num_spec_tokens(4, 0.5, 1, S) >= 2


def test_speculates_less_as_the_batch_grows_and_not_at_all_when_saturated() -> None:
    ks = [choose_num_spec_tokens(8, 0.8, b, S) for b in (1, 4, 8, 16, 32, 64, 128)]
    assert ks == sorted(ks, reverse=True) and ks[0] == 8
    assert ks[-1] == 0 and choose_num_spec_tokens(8, 0.8, 32, S) <= 1


def test_poor_acceptance_turns_it_off_even_alone() -> None:
    assert choose_num_spec_tokens(8, 0.02, 1, S) == 0
    # a costly draft model needs better acceptance than free n-gram lookups
    assert choose_num_spec_tokens(4, 0.4, 1, S, draft_cost=0.0) > 0
    assert choose_num_spec_tokens(4, 0.4, 1, S, draft_cost=0.5) == 0


def test_nothing_to_propose() -> None:
    assert choose_num_spec_tokens(0, 0.99, 1, S) == 0
    assert choose_num_spec_tokens(4, 0.99, 0, S) == 0


@given(st.integers(1, 16), st.floats(0.0, 1.0), st.integers(1, 512), st.floats(0.0, 1.0))
def test_the_choice_is_never_slower_than_plain(k_max: int, a: float, b: int, draft: float) -> None:
    k = choose_num_spec_tokens(k_max, a, b, S, draft)
    assert 0 <= k <= k_max
    assert token_rate(k, a, b, S, draft) >= token_rate(0, a, b, S, draft)
