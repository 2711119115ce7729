"""Prompt-lookup proposals (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpilot.runtime.engine.spec.ngram import propose_ngram


def test_continues_the_longest_match() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10
    ids = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 2, 3]
    # the last 2-gram (2, 3) occurs at 1..2 and 6..7; the 3-gram (x, 2, 3) only matches as 2-grams,
    # so the most recent 2-gram match wins: it is followed by 7, 8
    assert propose_ngram(ids, 3, 1, 4) == [7, 8, 2]
    # a longer match beats a more recent one
    ids = [4, 5, 6, 10, 11, 0, 5, 6, 12, 4, 5, 6]
    assert propose_ngram(ids, 2, 1, 3) == [10, 11]


def test_min_and_max_n() -> None:
    ids = [1, 2, 3, 4, 5, 3]
    assert propose_ngram(ids, 2, 1, 4) == [4, 5]  # a 1-gram match (3)
    assert propose_ngram(ids, 2, 2, 4) == []  # (5, 3) never occurred before
    ids = [7, 1, 2, 3, 8, 0, 2, 3, 9, 1, 2, 3]
    assert propose_ngram(ids, 1, 1, 2) == [9]  # max_n 2: the most recent (2, 3)
    assert propose_ngram(ids, 1, 1, 3) == [8]  # max_n 3: (1, 2, 3) matches at the start


def test_edge_cases() -> None:
    assert propose_ngram([], 4, 1, 3) == []
    assert propose_ngram([5], 4, 1, 3) == []
    assert propose_ngram([1, 2, 3], 0, 1, 3) == []
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []  # no earlier occurrence of 3
    # the continuation may run into the end of the sequence: a shorter proposal
    assert propose_ngram([1, 2, 1], 4, 1, 3) == [2, 1]
    assert propose_ngram([6, 6, 6, 6], 3, 1, 2) == [6]  # the most recent match, at the very end


@given(st.lists(st.integers(0, 4), min_size=2, max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_proposal_is_a_real_continuation(ids: list[int], k: int, max_n: int) -> None:
    prop = propose_ngram(ids, k, 1, max_n)
    assert len(prop) <= k
    if not prop:
        assert ids[-1] not in ids[:-1]  # with min_n = 1 any earlier occurrence of the last token matches
        return
    # some earlier position i ends a match of the last n >= 1 tokens and prop follows it
    assert any(ids[i] == ids[-1] and ids[i + 1 : i + 1 + len(prop)] == prop for i in range(len(ids) - 1))
