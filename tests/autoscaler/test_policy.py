"""Table tests and property tests of the pure scaling policy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.autoscaler.policy import (
    ArrivalState,
    History,
    PodCounter,
    RateSample,
    Recommendation,
    ScaleEvent,
    batches_turned_over,
    decide,
    forecast_arrivals,
    measure_arrivals,
    scale_down_limit,
    scale_up_limit,
    service_rate_at_target,
)
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.spec import Behavior, ScalingRule, ScalingTargets

NOW = 1_000_000.0


def snap(
    kvs: list[float],
    waiting: list[int] | None = None,
    ready: int | None = None,
    running: int = 10,
    limited: bool = False,
) -> MetricsSnapshot:
    waiting = waiting or [0] * len(kvs)
    samples = tuple(
        ReplicaSample(f"p{i}", kv, w, running) for i, (kv, w) in enumerate(zip(kvs, waiting, strict=True))
    )
    return MetricsSnapshot(
        ready_replicas=len(kvs) if ready is None else ready, samples=samples, scaling_limited=limited
    )


def targets(**kw: object) -> ScalingTargets:
    base: dict[str, object] = {"min_replicas": 1, "max_replicas": 20}
    base.update(kw)
    return ScalingTargets(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("current", "kvs", "waiting", "expected", "reason_part"),
    [
        (3, [0.91, 0.91, 0.91], None, 4, "kv 0.91 > target 0.70 on 3/3 replicas -> 4"),
        (3, [0.72, 0.70, 0.68], None, 3, "kv 0.70 ~ target 0.70"),  # inside the tolerance band
        (3, [0.76, 0.76, 0.76], None, 3, "(hold)"),  # 0.76/0.70 = 1.086: still inside 10%
        # Queue drives: 32 waiting beyond 4/replica; a replica takes ~14 requests under the KV target
        # (0.7 / (1.0 KV / 20 running)), so 2 + ceil(32 / 14) = 5.
        (2, [0.5, 0.5], [20, 20], 5, "queue 40 waiting"),
        (4, [1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0], 6, "kv 1.00 > target 0.70 on 4/4 replicas -> 6"),
    ],
)
def test_scale_up_table(
    current: int, kvs: list[float], waiting: list[int] | None, expected: int, reason_part: str
):
    d = decide(current, snap(kvs, waiting), targets(), History(), NOW)
    assert d.desired == expected, d.reason
    assert reason_part in d.reason


def test_kv_recommendation_is_ceil_of_ratio():
    # ceil(5 * 0.9 / 0.6) = ceil(7.5) = 8
    d = decide(5, snap([0.9] * 5), targets(target_kv_cache_utilization=0.6), History(), NOW)
    assert d.kv_recommendation == 8
    assert d.desired == 8


def test_plain_average_queue_formula_is_available():
    b = Behavior(queue_recommendation="average")
    d = decide(2, snap([0.5, 0.5], [20, 20]), targets(behavior=b), History(), NOW)
    assert d.queue_recommendation == 10  # ceil(40 / 4)
    assert d.desired == 6  # rate limit: max(+4, +100%) per 15 s from 2


def test_scale_down_waits_for_the_window_then_goes_one_at_a_time():
    t = targets()
    h = History(recommendations=(Recommendation(NOW - 100, 5),))
    d = decide(5, snap([0.1] * 5), t, h, NOW)
    assert d.desired == 5
    assert "scale-down stabilization (240s) holds 5" in d.reason  # the default window
    # Past the window: down, but limited to one replica per 60 s.
    h = History(recommendations=(Recommendation(NOW - 400, 5),))
    d = decide(5, snap([0.1] * 5), t, h, NOW)
    assert d.desired == 4
    assert "scale-down limited" in d.reason
    d2 = decide(4, snap([0.1] * 4), t, d.history, NOW + 15)
    assert d2.desired == 4  # the 60 s period is not over
    d3 = decide(4, snap([0.1] * 4), t, d2.history, NOW + 61)
    assert d3.desired == 3


def test_no_metrics_holds():
    d = decide(3, MetricsSnapshot(ready_replicas=3), targets(), History(), NOW)
    assert d.desired == 3
    assert d.reason.startswith("no metrics from 0/3 ready replicas")


def test_missing_replica_is_held_not_idle():
    # 1 of 3 reporting, idle; the two silent ones are not read as idle.
    d = decide(3, snap([0.05], ready=3), targets(), History(), NOW)
    assert d.desired == 3
    assert "2 not reporting, held" in d.reason
    # ... but a hot reporting replica still scales up, on top of the held ones.
    d = decide(3, snap([0.95], ready=3), targets(), History(), NOW)
    assert d.desired == 4  # ceil(1 * 0.95 / 0.7) = 2, plus 2 held


def test_scaling_limited_holds_scale_up_but_not_scale_down():
    d = decide(3, snap([0.95] * 3, limited=True), targets(), History(), NOW)
    assert d.desired == 3
    assert "ScalingLimited" in d.reason
    d = decide(3, snap([0.05] * 3, limited=True), targets(), History(), NOW)
    assert d.desired == 2


def test_min_max_clamp():
    d = decide(1, snap([0.0]), targets(min_replicas=3), History(), NOW)
    assert d.desired == 3
    assert "minReplicas 3" in d.reason
    d = decide(10, snap([1.0] * 10, [50] * 10), targets(max_replicas=12), History(), NOW)
    assert d.desired == 12
    assert "maxReplicas 12" in d.reason


def test_burst_skips_up_window_and_jumps_further():
    t = targets(scale_up_stabilization_s=60)
    h = History(recommendations=(Recommendation(NOW - 30, 2),))
    # Not a burst: the up window takes the lowest recommendation (2), so no scale-up yet.
    d = decide(2, snap([0.85, 0.85]), t, h, NOW)
    assert d.desired == 2
    # KV saturated with requests waiting: burst.
    d = decide(2, snap([0.97, 0.97], [10, 10]), t, h, NOW)
    assert d.burst
    assert d.desired > 3
    assert "burst" in d.reason


def test_burst_on_fast_queue_growth():
    t = targets()
    h = History(last_queue=(NOW - 15, 0))
    d = decide(2, snap([0.6, 0.6], [20, 20]), t, h, NOW)
    assert d.burst
    assert "queue growing" in d.reason


def test_rate_limits_follow_hpa_semantics():
    up = ScalingRule(pods=4, percent=100, period_s=15)
    assert scale_up_limit(2, (), NOW, up) == 6  # max(2 + 4, 2 * 2)
    assert scale_up_limit(10, (), NOW, up) == 20
    # 10 -> 14 five seconds ago: the period started at 10.
    assert scale_up_limit(14, (ScaleEvent(NOW - 5, 10, 14),), NOW, up) == 20
    down = ScalingRule(pods=1, percent=0, period_s=60)
    assert scale_down_limit(5, (), NOW, down) == 4
    assert scale_down_limit(4, (ScaleEvent(NOW - 30, 5, 4),), NOW, down) == 4
    assert scale_down_limit(4, (ScaleEvent(NOW - 61, 5, 4),), NOW, down) == 3


def test_a_surplus_comes_down_in_proportion_to_its_size_and_near_the_size_asked_one_at_a_time():
    down = ScalingRule(pods=1, percent=0, period_s=60)
    # from 40 toward 11 at half the surplus a period: 26, 19, 15, 13, 12, 11
    sizes, t, events = [40], NOW, ()
    while sizes[-1] > 11:
        n = scale_down_limit(sizes[-1], events, t, down, toward=11, surplus_share=0.5)
        events = (*events, ScaleEvent(t, sizes[-1], n))
        sizes.append(n)
        t += 60
    assert sizes == [40, 26, 19, 15, 13, 12, 11]
    # within the period of the last step, nothing more; the share 0 is the rule alone
    assert scale_down_limit(26, (ScaleEvent(NOW - 30, 40, 26),), NOW, down, 11, 0.5) == 26
    assert scale_down_limit(40, (), NOW, down, toward=11, surplus_share=0.0) == 39
    # never below the size asked, never above the current size
    assert scale_down_limit(12, (), NOW, down, toward=11, surplus_share=1.0) == 11
    assert scale_down_limit(12, (), NOW, down, toward=12, surplus_share=0.5) == 11  # the rule's own step


def test_a_fleet_far_above_what_it_needs_comes_down_by_half_the_surplus_a_minute():
    """40 replicas at 5% KV use, where the recommendations ask for a few: the first step is half the
    surplus, not one replica, and the reason says which limit applied; with the share 0, one."""
    t = targets(max_replicas=60)
    d = decide(40, snap([0.05] * 40), t, History(), NOW)
    asked = d.recommendation
    assert asked < 20 and d.desired == 40 - (40 - asked) // 2, (asked, d.desired)  # 11: 26, not 39
    assert "or 50% of the surplus" in d.reason
    one = replace(t, behavior=replace(t.behavior, scale_down_surplus_share=0.0))
    assert decide(40, snap([0.05] * 40), one, History(), NOW).desired == 39


def test_history_is_bounded():
    t = targets()
    h = History()
    for i in range(200):
        d = decide(3, snap([0.7] * 3), t, h, NOW + 15 * i)
        h = d.history
    assert len(h.recommendations) <= t.history_horizon_s / 15 + 2


# -- properties ------------------------------------------------------------------------------------------

kv_values = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, MetricsSnapshot, ScalingTargets, History, float]:
    min_r = draw(st.integers(0, 5))
    max_r = draw(st.integers(max(1, min_r), 30))
    t = ScalingTargets(
        min_replicas=min_r,
        max_replicas=max_r,
        target_kv_cache_utilization=draw(st.floats(0.2, 1.0)),
        target_queue_depth=draw(st.floats(0.5, 16.0)),
        scale_up_stabilization_s=draw(st.sampled_from([0, 30, 120])),
        scale_down_stabilization_s=draw(st.sampled_from([0, 60, 300])),
    )
    current = draw(st.integers(0, 40))
    ready = draw(st.integers(0, current + 2))
    reporting = draw(st.integers(0, ready))
    samples = tuple(
        ReplicaSample(f"p{i}", draw(kv_values), draw(st.integers(0, 60)), draw(st.integers(0, 64)))
        for i in range(reporting)
    )
    recs = tuple(
        Recommendation(NOW - draw(st.floats(0, 600)), draw(st.integers(0, 40)))
        for _ in range(draw(st.integers(0, 5)))
    )
    events = tuple(
        ScaleEvent(NOW - draw(st.floats(0, 120)), draw(st.integers(0, 40)), draw(st.integers(0, 40)))
        for _ in range(draw(st.integers(0, 3)))
    )
    h = History(recommendations=tuple(sorted(recs, key=lambda r: r.time)), events=events)
    return current, MetricsSnapshot(ready, samples, draw(st.booleans())), t, h, NOW


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_never_outside_min_max(s: tuple[int, MetricsSnapshot, ScalingTargets, History, float]):
    current, snapshot, t, h, now = s
    d = decide(current, snapshot, t, h, now)
    assert t.min_replicas <= d.desired <= t.max_replicas
    assert d.reason


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_missing_metrics_never_scale_down(s: tuple[int, MetricsSnapshot, ScalingTargets, History, float]):
    current, snapshot, t, h, now = s
    if snapshot.missing == 0 and snapshot.reporting > 0:
        return
    d = decide(current, snapshot, t, h, now)
    # Only the spec's own bound may take it lower.
    assert d.desired >= min(current, t.max_replicas)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_scale_down_respects_the_window(s: tuple[int, MetricsSnapshot, ScalingTargets, History, float]):
    current, snapshot, t, h, now = s
    d = decide(current, snapshot, t, h, now)
    if d.desired < current <= t.max_replicas:
        window = [r.replicas for r in h.recommendations if now - r.time <= t.scale_down_stabilization_s]
        assert d.desired >= max([*window, d.recommendation])


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_scale_up_respects_the_window(s: tuple[int, MetricsSnapshot, ScalingTargets, History, float]):
    current, snapshot, t, h, now = s
    d = decide(current, snapshot, t, h, now)
    if d.desired > current >= t.min_replicas and not d.burst:
        window = [r.replicas for r in h.recommendations if now - r.time <= t.scale_up_stabilization_s]
        assert d.desired <= min([*window, d.recommendation])


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 20),
    st.lists(st.tuples(kv_values, st.integers(0, 50)), min_size=1, max_size=20),
    st.floats(0.0, 0.5),
    st.integers(0, 30),
)
def test_monotone_in_load(current: int, loads: list[tuple[float, int]], extra_kv: float, extra_wait: int):
    t = targets(max_replicas=60)
    lo = MetricsSnapshot(
        len(loads), tuple(ReplicaSample(f"p{i}", kv, w, 10) for i, (kv, w) in enumerate(loads))
    )
    hi = MetricsSnapshot(
        len(loads),
        tuple(
            ReplicaSample(f"p{i}", min(1.0, kv + extra_kv), w + extra_wait, 10)
            for i, (kv, w) in enumerate(loads)
        ),
    )
    assert decide(current, hi, t, History(), NOW).desired >= decide(current, lo, t, History(), NOW).desired


def test_pure_same_inputs_same_output():
    args = (3, snap([0.9, 0.2, 0.5], [3, 0, 9]), targets(), History(last_queue=(NOW - 15, 2)), NOW)
    assert decide(*args) == decide(*args)


def test_ceil_does_not_round_up_float_noise():
    # 3 * 0.84 / 0.7 is 3.6000000000000005 in floats; exact values like 2 * 0.7 / 0.7 must stay 2.
    d = decide(2, snap([0.7 * 1.5] * 2), targets(), History(), NOW)
    assert d.kv_recommendation == 3
    hpa = targets(behavior=Behavior(scale_down_exponent=1.0))
    assert decide(4, snap([0.35] * 4), hpa, History(), NOW).kv_recommendation == 2
    # 4 * (0.0784 / 0.7) ** 0.5 = 4 * 0.3346... -> 2; float noise must not make it 3.
    assert decide(4, snap([0.7 / 4] * 4), targets(), History(), NOW).kv_recommendation == 2


def test_scale_down_recommendation_assumes_convex_utilization():
    # Utilization half the target on 8 replicas: the proportional rule (exponent 1) says 4, but a
    # decode-bound replica's KV use grows about as load squared, so 4 replicas would sit at twice
    # the target. The default exponent 0.5 says ceil(8 * 0.5 ** 0.5) = 6.
    s = snap([0.35] * 8)
    assert decide(8, s, targets(), History(), NOW).kv_recommendation == 6
    hpa = targets(behavior=Behavior(scale_down_exponent=1.0))
    assert decide(8, s, hpa, History(), NOW).kv_recommendation == 4
    # Scale-up stays proportional.
    assert decide(4, snap([1.0] * 4), targets(), History(), NOW).kv_recommendation == 6


def test_full_batch_slots_count_as_load_when_kv_is_low():
    # Short requests: 8 of 8 batch slots busy on every replica, KV almost empty. Without the slot
    # signal the KV recommendation alone would read the fleet as idle and scale it down.
    s = snap([0.09, 0.09, 0.09], running=8)
    blind = decide(3, s, targets(scale_down_stabilization_s=0.0), History(), NOW)
    assert blind.desired < 3
    d = decide(3, s, targets(max_num_seqs=8, scale_down_stabilization_s=0.0), History(), NOW)
    assert d.desired == 5  # ceil(3 * 1.0 / 0.7)
    assert d.avg_utilization == pytest.approx(1.0) and d.avg_kv_cache_usage == pytest.approx(0.09)
    assert "kv 0.09, slots 1.00 > target 0.70 on 3/3 replicas -> 5" in d.reason


def test_slots_cap_what_a_replica_absorbs_from_the_queue():
    # KV says a replica could run 0.7 / (0.1 / 4) = 28 requests, but it has only 8 slots: the queue
    # of 40 beyond target (2 replicas x 4) is absorbed at 0.7 * 8 = 5.6 per new replica.
    s = snap([0.1, 0.1], waiting=[24, 24], running=4)
    d = decide(2, s, targets(max_num_seqs=8), History(), NOW)
    assert d.queue_recommendation == 2 + 8  # ceil(40 / 5.6) = 8
    wide = decide(2, s, targets(), History(), NOW)
    assert wide.queue_recommendation == 2 + 2  # ceil(40 / 28)


def test_least_loaded_queue_ignores_a_backlog_stranded_on_one_replica():
    s = snap([0.9, 0.3, 0.3], waiting=[120, 0, 0])
    least = targets(behavior=Behavior(queue_recommendation="least-loaded"))
    assert decide(3, s, least, History(), NOW).queue_recommendation == 0
    assert decide(3, s, targets(), History(), NOW).queue_recommendation > 3  # "absorb" counts it
    # Every replica queueing beyond the target: the arrival share is too much for a replica.
    busy = snap([0.9, 0.9, 0.9], waiting=[30, 20, 14])
    assert decide(3, busy, least, History(), NOW).queue_recommendation > 3


# -- the arrival-rate recommendation ---------------------------------------------------------------------


def csnap(pods: list[tuple[str, float, int, int, float | None]], ready: int | None = None) -> MetricsSnapshot:
    """(pod, kv, waiting, running, completed_total) per reporting replica."""
    samples = tuple(ReplicaSample(p, kv, w, r, c) for p, kv, w, r, c in pods)
    return MetricsSnapshot(ready_replicas=len(samples) if ready is None else ready, samples=samples)


def test_arrivals_are_completions_plus_in_flight_growth():
    before = ArrivalState(NOW - 15, (PodCounter("a", 100.0, 10), PodCounter("b", 50.0, 10)))
    snapshot = csnap([("a", 0.5, 2, 10, 130.0), ("b", 0.5, 0, 12, 80.0)])
    rate, done, counters = measure_arrivals(snapshot, before, NOW)
    # a: 30 done + 2 more in flight; b: 30 done + 2 more in flight -> 64 over 15 s.
    assert rate == pytest.approx(64 / 15)
    assert done == pytest.approx(30 / 15)  # per replica
    assert counters == (PodCounter("a", 130.0, 12), PodCounter("b", 80.0, 12))


def test_arrivals_handle_new_pods_resets_and_missing_replicas():
    before = ArrivalState(NOW - 10, (PodCounter("a", 100.0, 5),))
    # a restarted (counter went down: it counts from 0); c is new and started empty; its count is
    # capped at the busiest known replica's arrivals in case it only missed the last scrape.
    snapshot = csnap([("a", 0.5, 0, 5, 20.0), ("c", 0.5, 0, 5, 500.0)])
    rate, _, _ = measure_arrivals(snapshot, before, NOW)
    assert rate == pytest.approx((20 + 0 + 20) / 10)
    # A Ready replica that did not report is taken to get the average share.
    rate_missing, _, _ = measure_arrivals(csnap([("a", 0.5, 0, 5, 120.0)], ready=2), before, NOW)
    assert rate_missing == pytest.approx(2 * 20 / 10)
    # A Prometheus rate instead of a counter.
    prom = MetricsSnapshot(1, (ReplicaSample("a", 0.5, 0, 7, completion_rate=3.0),))
    rate_prom, done_prom, _ = measure_arrivals(prom, before, NOW)
    assert rate_prom == pytest.approx((30 + 2) / 10) and done_prom == pytest.approx(3.0)


def test_requests_the_router_holds_arrived_and_its_drain_is_not_a_missed_replica():
    """The router's central queue (MetricsSnapshot.router_queue) counts: requests it queued since the
    last sync arrived, and what it handed to new replicas since is their in flight, not a missed
    replica's count for the cap to cut."""
    before = ArrivalState(NOW - 10, (PodCounter("a", 100.0, 8),), router_queue=50)
    # the router held 50 -> 80: 30 more arrived beside a's 10 done + 0 more in flight
    grew = replace(csnap([("a", 0.9, 0, 8, 110.0)]), router_queue=80)
    assert measure_arrivals(grew, before, NOW)[0] == pytest.approx((10 + 30) / 10)
    # new replicas b and c took 40 of the queue (50 -> 20) and 6 new requests; a finished 10
    drained = replace(
        csnap([("a", 0.9, 0, 8, 110.0), ("b", 0.9, 0, 23, 0.0), ("c", 0.9, 0, 23, 0.0)]), router_queue=20
    )
    assert measure_arrivals(drained, before, NOW)[0] == pytest.approx((10 + 46 - 30) / 10)
    # without the router's count both times, its queue is not read (as before)
    assert measure_arrivals(grew, replace(before, router_queue=None), NOW)[0] == pytest.approx(10 / 10)


@pytest.mark.parametrize(
    "previous",
    [
        ArrivalState(),  # first sync: nothing to difference
        ArrivalState(NOW - 3600, (PodCounter("a", 1.0, 0),)),  # too old
        ArrivalState(NOW - 15, (PodCounter("z", 1.0, 0),)),  # nobody seen twice
    ],
)
def test_no_arrival_rate_without_a_previous_sync(previous: ArrivalState):
    rate, done, counters = measure_arrivals(csnap([("a", 0.5, 0, 5, 10.0)]), previous, NOW)
    assert rate is None and done is None
    assert counters == (PodCounter("a", 10.0, 5),)  # remembered for the next sync


def test_no_counter_no_arrival_rate():
    before = ArrivalState(NOW - 15, (PodCounter("a", 1.0, 0),))
    assert measure_arrivals(snap([0.5]), before, NOW) == (None, None, ())


def test_forecast_follows_a_rising_trend_only_and_is_capped():
    rising = tuple(RateSample(NOW - 60 + 15 * i, 10.0 + 0.1 * 15 * i) for i in range(5))
    assert forecast_arrivals(rising, NOW, 60.0, 2.0) == pytest.approx(16.0 + 0.1 * 60)
    falling = tuple(RateSample(NOW - 60 + 15 * i, 20.0 - 15 * 0.1 * i) for i in range(5))
    assert forecast_arrivals(falling, NOW, 60.0, 2.0) == pytest.approx(14.0)
    steep = (RateSample(NOW - 15, 1.0), RateSample(NOW, 10.0))
    assert forecast_arrivals(steep, NOW, 60.0, 2.0) == pytest.approx(20.0)
    assert forecast_arrivals(rising[-1:], NOW, 60.0, 2.0) == pytest.approx(16.0)
    assert forecast_arrivals(rising, NOW, 0.0, 2.0) == pytest.approx(16.0)


def test_forecast_plans_for_the_mean_while_the_rate_moves_within_poisson_noise():
    # ~4 req/s counted over 15 s: 60 requests, +-13% noise. The largest such count is not planned for.
    noisy = tuple(RateSample(NOW - 90 + 15 * i, r) for i, r in enumerate((4.0, 3.4, 4.6, 3.8, 4.4, 3.6)))
    mean = sum(r.rate for r in noisy) / len(noisy)
    for latest in (4.6, 3.4):
        rates = (*noisy, RateSample(NOW, latest))
        expected = (mean * 6 + latest) / 7
        assert forecast_arrivals(rates, NOW, 60.0, 2.0) == pytest.approx(expected)
    # a real change (beyond two standard deviations of one count) is taken at once
    jump = (*noisy, RateSample(NOW, 8.0))
    assert forecast_arrivals(jump, NOW, 60.0, 2.0) >= 8.0


def test_service_rate_at_target():
    # Above target: proportional (a replica at 1.4x the target does 2x what it would at the target).
    assert service_rate_at_target(4.0, 1.4, 0.7, 0.5) == pytest.approx(2.0)
    # Below: load grows as utilization ** 0.5 (quadratic), so 4x the utilization is 2x the load.
    assert service_rate_at_target(1.0, 0.175, 0.7, 0.5) == pytest.approx(2.0)
    assert service_rate_at_target(1.0, 0.175, 0.7, 1.0) == pytest.approx(4.0)
    assert service_rate_at_target(1.0, 0.1, 0.7, 0.5) is None  # too idle to extrapolate from
    assert service_rate_at_target(0.0, 0.5, 0.7, 0.5) is None


def test_arrival_rate_scales_up_before_kv_and_queue_do():
    t = targets()
    # 2 replicas at the KV target: KV and queue say hold. Arrivals rose from 10/s to 16/s over the
    # last minute, and each replica sustains ~5/s at the target (it finishes 5/s at u = 0.7).
    rates = tuple(RateSample(NOW - 60 + 15 * i, 10.0 + 1.5 * i) for i in range(4))
    h = History(
        arrivals=ArrivalState(
            NOW - 15, (PodCounter("a", 0.0, 40), PodCounter("b", 0.0, 40)), rates, service_rate=5.0
        )
    )
    pods = [("a", 0.7, 0, 40 + 45, 75.0), ("b", 0.7, 0, 40 + 45, 75.0)]
    d = decide(2, csnap(pods), t, h, NOW)
    assert d.kv_recommendation == 2 and d.queue_recommendation == 0  # nothing waits
    assert d.arrival_rate == pytest.approx(2 * (75 + 45) / 15)  # 16/s
    assert d.service_rate == pytest.approx(5.0)
    assert d.arrival_forecast is not None and d.arrival_forecast > d.arrival_rate
    assert d.arrival_recommendation == d.desired == 5  # ceil(22 / 5)
    assert d.reason.startswith("arrivals 16.00/s (forecast")
    # The same with the option off: hold.
    off = decide(2, csnap(pods), targets(behavior=Behavior(arrival_rate=False)), h, NOW)
    assert off.desired == 2 and off.arrival_recommendation is None
    assert off.arrival_rate == d.arrival_rate  # still measured (and remembered)


def test_a_cold_start_reads_the_service_rate_from_arrivals_not_lagging_completions():
    """Below the utilization target with nothing queued, the replicas carry every arrival; their
    completions lag while long requests fill the batches. Read from completions alone, a replica
    looked like 0.07/s and the arrival rule asked for 23 replicas where 3 serve."""
    t = targets()
    h = History(arrivals=ArrivalState(NOW - 15, (PodCounter("a", 0.0, 0), PodCounter("b", 0.0, 0))))
    # 15 s after start: 11 arrived per pod, 1 finished, 10 running, KV at 0.3, nothing waits
    pods = [("a", 0.3, 0, 10, 1.0), ("b", 0.3, 0, 10, 1.0)]
    d = decide(2, csnap(pods), t, h, NOW)
    assert d.arrival_rate == pytest.approx(22 / 15)
    assert d.service_rate is not None and d.service_rate >= 11 / 15  # at least what each carries now
    assert d.arrival_recommendation is not None and d.arrival_recommendation <= 2
    # At the target the completions are the throughput once the batches turned over (each replica
    # finished as many as it runs); before, they lag as much, and no service rate is read from them
    full = [("a", 0.7, 0, 10, 1.0), ("b", 0.7, 0, 10, 1.0)]
    at_target = decide(2, csnap(full), t, h, NOW)
    assert at_target.service_rate is None and at_target.arrival_recommendation is None
    turned = [("a", 0.7, 0, 10, 12.0), ("b", 0.7, 0, 10, 12.0)]
    assert decide(2, csnap(turned), t, h, NOW).service_rate == pytest.approx(12 / 15)


def test_batches_turned_over() -> None:
    assert not batches_turned_over(csnap([("a", 0.98, 20, 20, 10.0)]).samples)  # a cold start's batch
    # a new replica's empty counter does not hide an old one's turnover, nor make it up
    assert batches_turned_over(csnap([("a", 0.9, 0, 20, 400.0), ("b", 0.5, 0, 10, 0.0)]).samples)
    assert not batches_turned_over(csnap([("a", 0.9, 0, 20, 15.0), ("b", 0.5, 0, 10, 0.0)]).samples)
    assert batches_turned_over(csnap([("a", 0.9, 0, 20, None)]).samples)  # no counter: nothing to tell


def test_arrival_state_continues_across_calls():
    t = targets()
    h = History()
    total = 0.0
    d = None
    for i in range(6):
        total += 60.0  # 4/s finished per replica, nothing queues
        pods = [("a", 0.7, 0, 20, total), ("b", 0.7, 0, 20, total)]
        d = decide(2, csnap(pods), t, h, NOW + 15 * i)
        h = d.history
    assert d is not None and d.arrival_rate == pytest.approx(8.0)
    assert d.service_rate == pytest.approx(4.0)  # at the target: what it does now
    assert d.arrival_recommendation == 2 and d.desired == 2
    assert len(h.arrivals.rates) == 5


@settings(max_examples=200, deadline=None)
@given(
    current=st.integers(1, 12),
    pods=st.lists(
        st.tuples(
            st.floats(0, 1),
            st.integers(0, 50),
            st.integers(0, 64),
            st.one_of(st.none(), st.floats(0, 1e4)),
        ),
        min_size=0,
        max_size=8,
    ),
    before=st.lists(st.tuples(st.floats(0, 1e4), st.integers(0, 100)), max_size=8),
    service=st.one_of(st.none(), st.floats(0.01, 100)),
)
def test_arrival_rate_only_ever_adds_replicas(
    current: int,
    pods: list[tuple[float, int, int, float | None]],
    before: list[tuple[float, int]],
    service: float | None,
):
    """Combined as the max: whatever the counters say (or lack), the recommendation is never below
    what the policy without the arrival term recommends."""
    snapshot = csnap(
        [(f"p{i}", kv, w, r, c) for i, (kv, w, r, c) in enumerate(pods)], ready=max(len(pods), 1)
    )
    prev = ArrivalState(
        NOW - 15, tuple(PodCounter(f"p{i}", c, f) for i, (c, f) in enumerate(before)), (), service
    )
    h = History(arrivals=prev)
    on = decide(current, snapshot, targets(), h, NOW)
    off = decide(current, snapshot, targets(behavior=Behavior(arrival_rate=False)), h, NOW)
    assert on.recommendation >= off.recommendation
    assert on.desired >= off.desired


def test_router_queue_wakes_a_model_from_zero():
    t = targets(min_replicas=0)
    idle = decide(0, MetricsSnapshot(ready_replicas=0, router_queue=0), t, History(), NOW)
    assert idle.desired == 0
    d = decide(0, MetricsSnapshot(ready_replicas=0, router_queue=3), t, History(), NOW)
    assert d.desired == 1
    assert "scale from zero: 3 requests held by the router" in d.reason
    # no router answering (None) is not a signal: zero stays zero
    assert decide(0, MetricsSnapshot(ready_replicas=0), t, History(), NOW).desired == 0
    # a replica already starting (current 1, none Ready) is not started twice
    assert decide(1, MetricsSnapshot(ready_replicas=0, router_queue=3), t, History(), NOW).desired == 1


def test_router_queue_counts_as_waiting():
    base = snap([0.5, 0.5], [0, 0])
    assert decide(2, base, targets(), History(), NOW).desired == 2
    held = MetricsSnapshot(ready_replicas=2, samples=base.samples, router_queue=40)
    d = decide(2, held, targets(), History(), NOW)
    assert d.desired > 2 and "queue 40 waiting" in d.reason
