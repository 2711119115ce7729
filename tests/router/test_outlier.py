"""Passive outlier ejection as pure decisions (router/outlier.py): counter -> eject? until when?"""

from __future__ import annotations

import pytest

from kvpilot.router.outlier import Ejection, OutlierDetector, OutlierSettings, max_ejected

PODS = ("a", "b", "c", "d")


def detector(**kw: float) -> OutlierDetector:
    return OutlierDetector(OutlierSettings(**kw))  # type: ignore[arg-type]


def test_consecutive_failures_eject_and_a_success_starts_the_count_over() -> None:
    d = detector(consecutive_failures=3, base_ejection_s=10)
    assert d.failure("a", 0.0, PODS) is None
    assert d.failure("a", 0.1, PODS) is None
    d.success("a")
    assert d.failure("a", 0.2, PODS) is None
    assert d.failure("a", 0.3, PODS) is None
    assert d.failure("a", 1.0, PODS) == Ejection("a", until=11.0, seconds=10.0, count=1, failures=3)
    assert d.is_ejected("a", 10.9) and not d.is_ejected("a", 11.0)
    assert d.ejected(PODS, 5.0) == ["a"]


def test_failures_while_ejected_are_not_counted() -> None:
    d = detector(consecutive_failures=2, base_ejection_s=10)
    d.failure("a", 0.0, PODS)
    assert d.failure("a", 0.0, PODS) is not None
    for t in (1.0, 2.0, 3.0):  # stragglers sent before the ejection
        assert d.failure("a", t, PODS) is None
    assert d.failure("a", 10.0, PODS) is None  # back: the count starts from zero
    assert d.failure("a", 10.1, PODS) is not None


def test_the_backoff_grows_with_each_ejection_up_to_the_cap() -> None:
    d = detector(consecutive_failures=1, base_ejection_s=10, max_ejection_s=25)
    first = d.failure("a", 0.0, PODS)
    second = d.failure("a", 10.0, PODS)  # failed again the moment it came back
    third = d.failure("a", 30.0, PODS)
    assert first is not None and second is not None and third is not None
    assert (first.seconds, second.seconds, third.seconds) == (10.0, 20.0, 25.0)
    assert (first.count, second.count, third.count) == (1, 2, 3)


def test_the_multiplier_decays_while_the_pod_is_back() -> None:
    d = detector(consecutive_failures=1, base_ejection_s=10, max_ejection_s=300)
    for t in (0.0, 10.0, 30.0):  # ejected 3 times in a row: 10, 20, 30 s
        d.failure("a", t, PODS)
    # back at 60; 25 s later two base periods have passed: 3 - 2 + 1 = 2
    again = d.failure("a", 85.0, PODS)
    assert again is not None and (again.count, again.seconds) == (2, 20.0)
    later = d.failure("a", 105.0 + 1000.0, PODS)  # long healthy: starts over
    assert later is not None and (later.count, later.seconds) == (1, 10.0)


@pytest.mark.parametrize(
    ("pods", "percent", "most"),
    [(1, 100, 0), (2, 50, 1), (2, 100, 1), (3, 50, 1), (4, 50, 2), (10, 10, 1), (3, 10, 1), (5, 0, 0)],
)
def test_max_ejected_is_a_share_at_least_one_never_the_last(pods: int, percent: float, most: int) -> None:
    assert max_ejected(pods, percent) == most


def test_max_ejection_percent_keeps_pods_in_and_asks_again_when_one_is_back() -> None:
    d = detector(consecutive_failures=1, base_ejection_s=10, max_ejection_percent=50)
    assert d.failure("a", 0.0, PODS) is not None
    assert d.failure("b", 0.0, PODS) is not None
    assert d.failure("c", 1.0, PODS) is None  # 2 of 4 out already
    assert d.ejected(PODS, 1.0) == ["a", "b"]
    assert d.failure("c", 10.5, PODS) is not None  # a and b are back: c's count stood, it goes now


def test_the_last_pod_is_never_ejected_and_zero_percent_turns_ejection_off() -> None:
    d = detector(consecutive_failures=1, max_ejection_percent=100)
    assert d.failure("a", 0.0, ("a",)) is None
    assert d.failure("a", 0.0, ("a", "b")) is not None
    assert d.failure("b", 0.0, ("a", "b")) is None  # a is out: b is the last
    off = detector(consecutive_failures=1, max_ejection_percent=0)
    assert all(off.failure("a", float(t), PODS) is None for t in range(5))


def test_a_forgotten_pod_starts_clean() -> None:
    d = detector(consecutive_failures=1, base_ejection_s=10)
    d.failure("a", 0.0, PODS)
    d.forget("a")
    assert not d.is_ejected("a", 1.0)
    again = d.failure("a", 1.0, PODS)
    assert again is not None and again.count == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"consecutive_failures": 0},
        {"base_ejection_s": 0},
        {"base_ejection_s": 10, "max_ejection_s": 5},
        {"max_ejection_percent": 101},
        {"max_ejection_percent": -1},
    ],
)
def test_settings_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OutlierSettings(**bad)  # type: ignore[arg-type]
