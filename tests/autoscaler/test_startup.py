"""The startup-aware parts of the policy: pure functions in autoscaler/startup.py and how decide() uses
the measured (or declared) replica startup."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.autoscaler.policy import (
    ArrivalState,
    Decision,
    History,
    PodCounter,
    RateSample,
    Recommendation,
    decide,
)
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.spec import ScalingTargets
from kvpilot.autoscaler.startup import (
    DRAIN_STARTUPS,
    HOLD_STARTUPS,
    STARTUP_AWARE_MIN_S,
    STARTUP_SAMPLE_PODS,
    backlog_replicas,
    forecast_lead_s,
    measured_startup_s,
    pod_startup_seconds,
    scale_down_hold_s,
)

NOW = 1_000_000.0


def pod(name: str, created: str, ready_at: str | None, ready: bool = True) -> dict[str, object]:
    conditions = (
        []
        if ready_at is None
        else [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_at}]
    )
    return {"metadata": {"name": name, "creationTimestamp": created}, "status": {"conditions": conditions}}


def test_measured_startup_is_the_median_of_known_durations() -> None:
    assert measured_startup_s([]) is None
    assert measured_startup_s([50.0, 70.0, 400.0]) == 70.0  # one slow pod (an image pull) does not move it
    assert measured_startup_s([-1.0, float("nan"), 30.0]) == 30.0


def test_pod_startup_seconds_reads_creation_to_ready() -> None:
    pods = [
        pod("a", "2026-01-01T00:00:00Z", "2026-01-01T00:01:05Z"),
        pod("b", "2026-01-01T00:10:00Z", "2026-01-01T00:10:50Z"),
        pod("starting", "2026-01-01T00:20:00Z", None),
        pod("not-ready", "2026-01-01T00:20:00Z", "2026-01-01T00:20:30Z", ready=False),
        pod("clock-skew", "2026-01-01T00:30:00Z", "2026-01-01T00:29:00Z"),
        {"metadata": {"name": "no-time"}, "status": {}},
    ]
    assert pod_startup_seconds(pods) == [65.0, 50.0]
    assert measured_startup_s(pod_startup_seconds(pods)) == 57.5


def test_pod_startup_seconds_keeps_the_most_recent_pods() -> None:
    pods = [
        pod(
            f"p{i}",
            f"2026-01-01T{i // 60:02d}:{i % 60:02d}:00Z",
            f"2026-01-01T{i // 60:02d}:{i % 60:02d}:{i % 50:02d}Z",
        )
        for i in range(STARTUP_SAMPLE_PODS + 5)
    ]
    got = pod_startup_seconds(list(reversed(pods)))
    assert len(got) == STARTUP_SAMPLE_PODS
    assert got == [float(i % 50) for i in range(5, STARTUP_SAMPLE_PODS + 5)]


def test_horizon_and_hold_grow_with_startup_only() -> None:
    assert forecast_lead_s(60.0, None) == 60.0
    assert forecast_lead_s(60.0, 10.0) == 60.0
    assert forecast_lead_s(60.0, 150.0) == 150.0
    assert scale_down_hold_s(300.0, None) == 300.0
    assert scale_down_hold_s(300.0, 60.0) == 300.0
    assert scale_down_hold_s(300.0, 120.0) == HOLD_STARTUPS * 120.0


def test_backlog_replicas_arithmetic() -> None:
    # 100 req/s forecast, 10 req/s per replica, 4 Ready: they leave 60 req/s unserved for the 60 s
    # startup (3,600) on top of 400 waiting; drained within DRAIN_STARTUPS x 60 s.
    drain = DRAIN_STARTUPS * 60.0
    expected = -(-(100.0 + (400.0 + 60.0 * 60.0) / drain) // 10.0)
    assert backlog_replicas(400, 100.0, 10.0, 4, 60.0) == int(expected)
    # Nothing waiting and enough Ready: just the rate.
    assert backlog_replicas(0, 100.0, 10.0, 12, 60.0) == 10
    assert backlog_replicas(0, 0.0, 10.0, 0, 60.0) == 0
    with pytest.raises(ValueError, match="per_replica_rate"):
        backlog_replicas(10, 1.0, 0.0, 1, 60.0)


@given(
    waiting=st.integers(0, 10_000),
    more=st.integers(0, 10_000),
    rate=st.floats(0.0, 500.0),
    per=st.floats(0.1, 100.0),
    ready=st.integers(0, 50),
    startup=st.floats(0.0, 600.0),
)
def test_backlog_replicas_grows_with_the_backlog_and_covers_the_rate(
    waiting: int, more: int, rate: float, per: float, ready: int, startup: float
) -> None:
    n = backlog_replicas(waiting, rate, per, ready, startup)
    assert backlog_replicas(waiting + more, rate, per, ready, startup) >= n
    assert n * per >= rate - 1e-6


# -- decide() with a startup ---------------------------------------------------------------------------


def backlog_case(startup: float | None) -> tuple[MetricsSnapshot, History, ScalingTargets]:
    """Two Ready replicas, full batches, 500 waiting each; each finished 150 requests in the last 15 s."""
    samples = tuple(ReplicaSample(f"p{i}", 0.9, 500, 20, completed_total=150.0) for i in range(2))
    snapshot = MetricsSnapshot(ready_replicas=2, samples=samples, startup_s=startup)
    counters = tuple(PodCounter(f"p{i}", 0.0, 20) for i in range(2))
    history = History(arrivals=ArrivalState(time=NOW - 15.0, counters=counters, service_rate=10.0))
    return snapshot, history, ScalingTargets(min_replicas=1, max_replicas=100, max_num_seqs=32)


def test_startup_aware_queue_rule_sizes_the_backlog_over_the_startup() -> None:
    snapshot, history, targets = backlog_case(60.0)
    d = decide(2, snapshot, targets, history, NOW)
    assert d.startup_s == 60.0
    assert d.arrival_forecast is not None and d.service_rate is not None
    assert d.queue_recommendation == backlog_replicas(1000, d.arrival_forecast, d.service_rate, 2, 60.0)
    assert "over a 60s startup" in d.reason
    # No burst factor on top of it.
    assert d.recommendation == max(d.queue_recommendation, d.arrival_recommendation or 0)

    snapshot0, history0, _ = backlog_case(None)
    reactive = decide(2, snapshot0, targets, history0, NOW)
    assert reactive.startup_s is None
    assert d.recommendation < reactive.recommendation  # the reactive rule re-asks for the whole queue


def test_a_size_asked_for_a_backlog_holds_the_scale_down_window_only_while_it_queues() -> None:
    """The startup-aware queue rule's size is marked as a backlog's; once the queue drained (at most
    targetQueueDepth a replica), it no longer holds the scale-down window, which another size would:
    60 s after 30 replicas were asked for a backlog, 30 Ready replicas at 5% KV use step down (half
    the surplus over the 9 the utilization asks: 20) instead of holding 30 for the window."""
    snapshot, history, targets = backlog_case(60.0)
    asked = decide(2, snapshot, targets, history, NOW)
    assert asked.history.recommendations[-1].backlog and "over a 60s startup" in asked.reason
    assert (
        not decide(2, replace(snapshot, startup_s=None), targets, history, NOW)
        .history.recommendations[-1]
        .backlog
    )  # the reactive rule sizes no backlog over a startup
    idle = tuple(ReplicaSample(f"p{i}", 0.05, 0, 1) for i in range(30))
    for backlog, expected in ((True, 20), (False, 30)):
        past = History(recommendations=(Recommendation(NOW - 60.0, 30, backlog),))
        d = decide(30, MetricsSnapshot(30, idle, startup_s=60.0), targets, past, NOW)
        assert d.desired == expected, (backlog, d.reason)


def _full_batches(waiting_each: int, startup: float | None = 60.0) -> Decision:
    """8 replicas with every batch slot taken (32 of 32) and `waiting_each` requests waiting on each;
    at a 60 s startup the startup-aware queue rule sizes the backlog."""
    samples = tuple(ReplicaSample(f"p{i}", 0.5, waiting_each, 32, completed_total=150.0) for i in range(8))
    counters = tuple(PodCounter(f"p{i}", 0.0, 38) for i in range(8))
    history = History(arrivals=ArrivalState(time=NOW - 15.0, counters=counters, service_rate=20.0))
    targets = ScalingTargets(min_replicas=1, max_replicas=100, max_num_seqs=32)
    return decide(8, MetricsSnapshot(8, samples, startup_s=startup), targets, history, NOW)


def test_full_batches_during_a_backlog_do_not_add_replicas() -> None:
    """A backlog fills every batch at any fleet size: with the startup-aware queue rule sizing the
    backlog, the utilization rule counts only what the backlog leaves. 160 waiting, 128 past the
    target, are half of what 8 replicas hold at the target (0.7 x 32 each), so the batches would sit
    at 0.5 without them: the current size holds instead of 8 x 1.0 / 0.7 (x 1.5 burst)."""
    d = _full_batches(20)
    assert d.queue_recommendation is not None and d.queue_recommendation <= 8
    assert d.kv_recommendation == 8 and d.desired == 8
    assert "utilization (12) less the backlog's 0.50 -> 8 while it drains" in d.reason
    reactive = _full_batches(20, startup=None)
    assert reactive.kv_recommendation == 12 and reactive.burst and reactive.desired > 12


def test_full_batches_behind_a_short_queue_still_add_replicas() -> None:
    """A queue far smaller than the batches does not explain them: 48 waiting (16 past the target)
    would fill 6% of the fleet at the target, so full batches say the arrivals outgrow the fleet
    (issue 24: on the diurnal trace at 60 s startup the replica model's 39/s a replica sized the
    queue rule at 3 replicas while 3 ran full at 100/s, and the utilization rule, overridden, let the
    queue grow to 1,700 requests). The queue rule alone asks for 7; the utilization, less the backlog, 11."""
    d = _full_batches(6)
    assert d.queue_recommendation is not None and d.queue_recommendation <= 8
    assert d.kv_recommendation == 11 and d.desired == 11
    assert "utilization (12) less the backlog's 0.06 -> 11 while it drains" in d.reason


def test_short_startup_keeps_the_reactive_queue_rule() -> None:
    """A replica Ready by the next sync absorbs its share at once, as the reactive rule assumes."""
    snapshot, history, targets = backlog_case(STARTUP_AWARE_MIN_S / 3)
    short = decide(2, snapshot, targets, history, NOW)
    unknown = decide(2, replace(snapshot, startup_s=None), targets, history, NOW)
    assert (short.desired, short.recommendation, short.queue_recommendation) == (
        unknown.desired,
        unknown.recommendation,
        unknown.queue_recommendation,
    )


def test_declared_startup_is_used_until_one_is_measured() -> None:
    snapshot, history, targets = backlog_case(None)
    declared = decide(2, snapshot, replace(targets, startup_s=60.0), history, NOW)
    measured = decide(2, replace(snapshot, startup_s=60.0), targets, history, NOW)
    assert declared.startup_s == measured.startup_s == 60.0
    assert declared.queue_recommendation == measured.queue_recommendation
    both = decide(2, replace(snapshot, startup_s=90.0), replace(targets, startup_s=60.0), history, NOW)
    assert both.startup_s == 90.0  # the measurement wins


def test_declared_startup_is_validated() -> None:
    with pytest.raises(ValueError, match="startup_s"):
        ScalingTargets(max_replicas=2, startup_s=-1.0)


def test_scale_down_hold_spans_several_startups() -> None:
    """A pod that takes 120 s to start is not released for a dip shorter than HOLD_STARTUPS startups."""
    idle = tuple(ReplicaSample(f"p{i}", 0.05, 0, 1) for i in range(6))
    targets = ScalingTargets(min_replicas=1, max_replicas=20)
    history = History(recommendations=(Recommendation(NOW - 400.0, 6),))
    fast = decide(6, MetricsSnapshot(6, idle, startup_s=60.0), targets, history, NOW)
    slow = decide(6, MetricsSnapshot(6, idle, startup_s=120.0), targets, history, NOW)
    assert fast.desired == 4  # the 300 s window has passed: half the surplus over the 2 asked goes
    assert slow.desired == 6  # 400 s < 4 x 120 s: held
    assert "scale-down stabilization (480s) holds 6" in slow.reason


def test_forecast_looks_one_startup_ahead() -> None:
    """A rising arrival rate is extrapolated over the startup when it is longer than the default lead."""
    samples = tuple(ReplicaSample(f"p{i}", 0.5, 0, 10, completed_total=1000.0) for i in range(2))
    counters = tuple(PodCounter(f"p{i}", 700.0, 10) for i in range(2))
    # 32 -> 40 req/s in a minute: beyond the Poisson noise of 15 s counts
    rates = tuple(RateSample(NOW - 15.0 * k, 40.0 - 2.0 * k) for k in range(4, 0, -1))
    history = History(arrivals=ArrivalState(NOW - 15.0, counters, rates, service_rate=20.0))
    targets = ScalingTargets(min_replicas=1, max_replicas=50)
    d60 = decide(2, MetricsSnapshot(2, samples, startup_s=60.0), targets, history, NOW)
    d180 = decide(2, MetricsSnapshot(2, samples, startup_s=180.0), targets, history, NOW)
    assert d60.arrival_rate == d180.arrival_rate == 40.0
    assert d60.arrival_forecast is not None and d180.arrival_forecast is not None
    assert d180.arrival_forecast > d60.arrival_forecast > 40.0
    assert "in 180s" in d180.reason


def test_missing_metrics_never_scale_down_with_a_startup() -> None:
    idle = tuple(ReplicaSample(f"p{i}", 0.02, 0, 0) for i in range(3))
    targets = ScalingTargets(min_replicas=1, max_replicas=20, scale_down_stabilization_s=0)
    d = decide(5, MetricsSnapshot(4, idle, startup_s=60.0), targets, History(), NOW)
    assert d.desired == 5
    none = decide(5, MetricsSnapshot(4, (), startup_s=60.0), targets, History(), NOW)
    assert none.desired == 5


class _Recorder:
    """Scales 1 -> 3 at the first sync and records the startup each snapshot reports."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None]] = []

    def initial_replicas(self) -> int:
        return 1

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        self.seen.append((now, snapshot.startup_s))
        return 3

    def settings(self) -> dict[str, object]:
        return {}


def test_simulator_measures_startup_like_the_controller() -> None:
    """The controller reads a pod's startup from its creation and Ready times, so a replica that was
    there when the trace began (started before it) reports calibration.startup_s from the first sync,
    as do the two started at the first sync once Ready."""
    from kvpilot.autoscaler.replica_model import calibration_by_name
    from kvpilot.autoscaler.sim_replica import Replica
    from kvpilot.autoscaler.simulator import simulate
    from kvpilot.autoscaler.trace import TraceRequest

    cal = calibration_by_name("h100/llama-3.1-8b", startup_s=40.0)
    trace = [TraceRequest(float(t), 200, 20) for t in range(0, 120, 2)]
    policy = _Recorder()
    simulate(trace, policy, cal, warmup_s=0.0)
    assert policy.seen[0] == (15.0, 40.0)  # the pod there at the start: known from the first sync
    assert {s for _, s in policy.seen} == {40.0}
    there = Replica(rid=0, cal=cal, created=0.0, ready_at=0.0, free_blocks=1, ready=True, started_ready=True)
    started = Replica(rid=1, cal=cal, created=15.0, ready_at=70.0, free_blocks=1, ready=True)
    assert (there.startup_s, started.startup_s) == (40.0, 55.0)
