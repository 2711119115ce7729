"""The surge headroom (autoscaler/surge.py): level shifts, the levels, the hold, and decide() with it."""

from __future__ import annotations

import pytest

from kvpilot.autoscaler.policy import ArrivalState, History, PodCounter, RateSample, decide
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.spec import Behavior, ScalingTargets
from kvpilot.autoscaler.state import decision_to_status, history_from_status
from kvpilot.autoscaler.surge import (
    level_quantile,
    level_shift,
    reaction_s,
    record_level,
    rising_shift,
    shifted,
    surge_hold,
)

NOW = 1_000_000.0


def test_reaction_is_the_sync_that_sees_it_plus_the_startup_in_syncs():
    assert reaction_s(15.0, 10.0) == 30.0  # seen within a sync, Ready by the next but one
    assert reaction_s(15.0, 60.0) == 75.0
    assert reaction_s(15.0, None) == 30.0  # at least two syncs
    assert reaction_s(15.0, 0.0) == 30.0


@pytest.mark.parametrize(
    ("a", "b", "shift"),
    [
        (4.0, 4.6, False),  # Poisson noise of a 15 s count
        (4.0, 120.0, True),  # a 30x surge from quiet
        (120.0, 4.0, True),  # and the fall back: either way
        (100.0, 160.0, False),  # a 1.6x burst at a high rate: the forecast follows it
        (32.0, 96.0, False),  # 3x, but the counts' noise leaves less than 3x for sure
        (30.0, 190.0, True),  # a flash crowd's 6x
        (0.0, 0.3, False),  # from idle to a handful of requests: noise
    ],
)
def test_shift_is_a_change_by_the_ratio_beyond_noise(a: float, b: float, shift: bool):
    assert shifted(RateSample(NOW - 15, a), RateSample(NOW, b), 3.0, 15.0) is shift


def test_a_level_shift_is_a_change_within_one_reaction_not_a_ramp():
    # 10/s to 60/s: within 30 s it is a shift; over ten minutes (a daily ramp) it is not.
    jump = (
        RateSample(NOW - 45, 10.0),
        RateSample(NOW - 30, 10.0),
        RateSample(NOW - 15, 30.0),
        RateSample(NOW, 60.0),
    )
    assert level_shift(jump, 10.0, 3.0)
    ramp = tuple(RateSample(NOW - 600 + 15 * i, 10.0 + 50.0 * i / 40) for i in range(41))
    assert not level_shift(ramp, 10.0, 3.0)
    # With a 60 s startup the reaction is 75 s: a 3x change over a minute is a shift then.
    slow = (RateSample(NOW - 60, 10.0), *(RateSample(NOW - 45 + 15 * i, 20.0 + 10 * i) for i in range(4)))
    assert not level_shift(slow, 10.0, 3.0)
    assert level_shift(slow, 60.0, 3.0)
    assert not level_shift(jump[-1:], 10.0, 3.0)  # one rate: nothing to compare


def test_levels_are_minute_means_within_the_window():
    rates = tuple(RateSample(NOW + 15 * i, r) for i, r in enumerate((10.0, 20.0, 30.0, 40.0)))
    levels = record_level((), rates[:1], NOW, 1800.0)
    assert levels == (RateSample(NOW, 10.0),)
    # Less than a minute later: no new level.
    assert record_level(levels, rates[:3], NOW + 30, 1800.0) == levels
    # A minute later: the mean of the rates since the last level, weighted by their spans.
    levels = record_level(levels, rates, NOW + 60 - 15, 1800.0)
    assert levels == (RateSample(NOW, 10.0),)
    more = (*rates, RateSample(NOW + 60, 50.0))
    levels = record_level(levels, more, NOW + 60, 1800.0)
    assert levels[-1] == RateSample(NOW + 60, pytest.approx((20 + 30 + 40 + 50) / 4))
    # Older than the window: dropped.
    assert record_level(levels, (RateSample(NOW + 1830, 5.0),), NOW + 1830, 1800.0) == (
        levels[-1],
        RateSample(NOW + 1830, 5.0),
    )


def test_the_hold_serves_the_quantile_of_the_levels_while_a_shift_is_recent():
    levels = tuple(
        RateSample(NOW - 60 * i, r)
        for i, r in enumerate((4.0, 4.0, 4.0, 90.0, 100.0, 96.0, 60.0, 30.0, 4.0, 4.0))
    )
    assert level_quantile(levels, 0.7) == 60.0  # 7th of 10 sorted
    assert level_quantile((), 0.7) is None
    hold = surge_hold(levels, NOW - 600, NOW, 25.0, 1800.0, 0.7)
    assert hold is not None and hold.replicas == 3 and hold.level == 60.0  # ceil(60 / 25)
    assert surge_hold(levels, None, NOW, 25.0, 1800.0, 0.7) is None  # no shift seen: nothing held
    assert surge_hold(levels, NOW - 1801, NOW, 25.0, 1800.0, 0.7) is None  # too long ago
    assert surge_hold(levels, NOW - 600, NOW, None, 1800.0, 0.7) is None  # no per-replica rate


def _snap(pods: list[tuple[str, float, int, int, float]]) -> MetricsSnapshot:
    return MetricsSnapshot(
        ready_replicas=len(pods), samples=tuple(ReplicaSample(p, kv, w, r, c) for p, kv, w, r, c in pods)
    )


def _quiet_after_busy(shift_at: float | None) -> History:
    """4 replicas, each sustaining 5/s; the last half hour ran at 15-20/s, now 1/s."""
    rates = tuple(RateSample(NOW - 60 + 15 * i, 1.0) for i in range(4))
    # 29 minutes: the first 20 at 20/s, the last 9 at 1/s (oldest first).
    levels = tuple(RateSample(NOW - 60 * (29 - i), 20.0 if i < 20 else 1.0) for i in range(29))
    counters = tuple(PodCounter(p, 0.0, 1) for p in "abcd")
    return History(
        arrivals=ArrivalState(NOW - 15, counters, rates, service_rate=5.0, levels=levels, shift_at=shift_at)
    )


def test_decide_holds_capacity_after_a_level_shift_and_names_the_signal():
    quiet = [(p, 0.05, 0, 1, 15.0 / 4) for p in "abcd"]  # 1/s in all
    t = ScalingTargets(min_replicas=1, max_replicas=20, scale_down_stabilization_s=0.0)
    d = decide(4, _snap(quiet), t, _quiet_after_busy(shift_at=NOW - 900), NOW)
    # 20 of the 29 minutes ran at 20/s: p70 is 20/s, 4 replicas at 5/s.
    assert d.surge_recommendation == 4
    assert d.desired == 4
    assert d.signal == "surge headroom"
    assert d.reason.startswith("surge headroom: level shift 900s ago, holding 20.00/s (p70 of 30 min)")
    # No shift seen (smooth traffic), or the option off: the fleet follows the rate down.
    for h, b in (
        (_quiet_after_busy(None), Behavior()),
        (_quiet_after_busy(NOW - 900), Behavior(surge_headroom=False)),
    ):
        d2 = decide(
            4,
            _snap(quiet),
            ScalingTargets(min_replicas=1, max_replicas=20, scale_down_stabilization_s=0.0, behavior=b),
            h,
            NOW,
        )
        assert d2.desired < 4 and d2.signal != "surge headroom", d2.reason
        assert d2.surge_recommendation is None


def test_decide_records_a_shift_when_the_rate_jumps():
    # 1/s for a minute, then 30/s in the last sync: a shift, remembered with the levels.
    h = _quiet_after_busy(None)
    busy = [(p, 0.3, 0, 5, 15.0 * 30 / 4) for p in "abcd"]
    d = decide(4, _snap(busy), ScalingTargets(min_replicas=1, max_replicas=20), h, NOW)
    assert d.arrival_rate == pytest.approx(30.0 + 4 * 4 / 15)
    assert d.history.arrivals.shift_at == NOW
    assert len(d.history.arrivals.levels) == 30  # a minute since the last level: one more
    # Not on a rate within noise of the last.
    calm = [(p, 0.05, 0, 1, 15.0 / 4) for p in "abcd"]
    assert (
        decide(
            4, _snap(calm), ScalingTargets(min_replicas=1, max_replicas=20), h, NOW
        ).history.arrivals.shift_at
        is None
    )


def test_the_surge_memory_survives_a_restart():
    quiet = [(p, 0.05, 0, 1, 15.0 / 4) for p in "abcd"]
    d = decide(
        4, _snap(quiet), ScalingTargets(min_replicas=1, max_replicas=20), _quiet_after_busy(NOW - 900), NOW
    )
    back = history_from_status(decision_to_status(d, NOW, None)).arrivals
    assert back.shift_at == pytest.approx(NOW - 900, abs=1e-3)
    assert [(round(r.time, 3), r.rate) for r in back.levels] == [
        (round(r.time, 3), round(r.rate, 4)) for r in d.history.arrivals.levels
    ]


def test_a_rising_shift_in_progress_is_a_shifts_share_of_one_sync():
    # 3x within the shortest reaction (two syncs): sqrt(3) = 1.73x in one sync, beyond noise.
    flash = (RateSample(NOW - 15, 28.0), RateSample(NOW, 80.0))  # a flash crowd's first sync
    assert rising_shift(flash, 3.0)
    assert not rising_shift((RateSample(NOW - 15, 90.0), RateSample(NOW, 134.0)), 3.0)  # a 1.5x burst
    assert not rising_shift((RateSample(NOW - 15, 80.0), RateSample(NOW, 28.0)), 3.0)  # falling
    assert not rising_shift((RateSample(NOW - 15, 4.0), RateSample(NOW, 6.5)), 3.0)  # noise at 4/s
    assert not rising_shift(flash[-1:], 3.0)


def test_decide_plans_for_the_rising_shift_at_once_and_names_it():
    h = _quiet_after_busy(None)
    t = ScalingTargets(min_replicas=1, max_replicas=20)
    # 1/s, then 8/s (an 8x rise in one sync): the forecast is arrival_max_growth (2) x the latest rate.
    rising = [(p, 0.3, 0, 2, 15.0 * 8 / 4) for p in "abcd"]
    d = decide(4, _snap(rising), t, h, NOW)
    assert d.arrival_rate is not None and d.arrival_forecast == pytest.approx(2 * d.arrival_rate)
    assert "rising shift: forecast" in d.reason
    off = decide(
        4,
        _snap(rising),
        ScalingTargets(min_replicas=1, max_replicas=20, behavior=Behavior(surge_headroom=False)),
        h,
        NOW,
    )
    assert off.arrival_forecast is not None and off.arrival_forecast < d.arrival_forecast
