"""The closed loop on measured SLO attainment (attainment.py, feedback.py, policy.decide, state.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.api.models import AutoscalerStatus
from kvpilot.autoscaler.attainment import (
    PodLatency,
    SloCounts,
    SloInterval,
    count_within,
    counts_from_latency,
    pod_latency,
    pods_interval_counts,
    window,
)
from kvpilot.autoscaler.feedback import (
    CUT_Z,
    FLOOR_MIX_RANGE,
    FeedbackSettings,
    SloState,
    evaluate,
    floor_at_mix,
    planner_capacity,
    proven_step,
    record_interval,
    request_span_s,
    served_load_limit,
    smallest_proven_size,
)
from kvpilot.autoscaler.policy import ArrivalState, History, PodCounter, decide
from kvpilot.autoscaler.replica_model import calibration_by_name
from kvpilot.autoscaler.router_source import parse_router_slo
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.slo import prefill_terms
from kvpilot.autoscaler.sources import parse_metrics_text
from kvpilot.autoscaler.spec import ScalingTargets
from kvpilot.autoscaler.startup import STARTUP_AWARE_MIN_S, startup_rise_limit
from kvpilot.autoscaler.state import decision_to_status, history_from_status

NOW = 1_000_000.0
SLO = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 2, "tpotSeconds": 0.05}
SETTINGS = FeedbackSettings(
    target=0.99, window_s=120.0, min_requests=20, gain=0.1, max_step=0.5, headroom=0.5, relax=0.03
)


def _targets(**autoscaling: object) -> ScalingTargets:
    spec = {"minReplicas": 1, "maxReplicas": 20, "slo": SLO, "scaleDownStabilizationSeconds": 0}
    return ScalingTargets.from_spec({**spec, **autoscaling}, max_num_seqs=64)


def _history(pods: int, router_met: float, *, mix: bool = True, **slo: object) -> History:
    counters = tuple(PodCounter(f"p{i}", 1000.0, 4, 1000.0 * 2000, 1000.0 * 200) for i in range(pods))
    arrivals = ArrivalState(
        time=NOW - 15.0,
        counters=counters,
        token_mix=(2000.0, 200.0) if mix else None,
        mix_requests=200.0 if mix else 0.0,
    )
    state = SloState(time=NOW - 15.0, router_counts=SloCounts(met=router_met), **slo)  # type: ignore[arg-type]
    return History(arrivals=arrivals, slo=state)


def _samples(pods: int, done: float = 1010.0, kv: float = 0.2) -> tuple[ReplicaSample, ...]:
    return tuple(
        ReplicaSample(
            f"p{i}", kv, 0, 4, done, prompt_tokens_total=done * 2000, generation_tokens_total=done * 200
        )
        for i in range(pods)
    )


# -- attainment.py -------------------------------------------------------------------------------


def test_counts_difference_and_reset():
    before = SloCounts(met=100, missed_ttft=2)
    assert SloCounts(met=150, missed_ttft=4, failed=1).since(before) == SloCounts(50, 2, 0, 1)
    assert SloCounts(met=10).since(before) is None  # a router restarted: no interval, not a guess
    assert SloCounts().attainment is None  # no requests is unknown, never perfect
    assert SloCounts(met=99, missed_tpot=1).attainment == pytest.approx(0.99)
    assert SloCounts.from_outcomes({"met": 3, "missed_ttft": 1, "bogus": 7}).total == 4


def test_histogram_bound_takes_the_bucket_below_the_target():
    buckets = ((0.5, 10.0), (1.0, 30.0), (2.5, 45.0), (math.inf, 50.0))
    assert count_within(buckets, 2.0) == (30.0, 50.0)  # 2.0 s is not a bound: the 1.0 bucket counts
    assert count_within(buckets, 2.5) == (45.0, 50.0)
    assert count_within(((1.0, 3.0),), 2.0) is None  # no +Inf bucket: not a histogram
    lat = pod_latency(buckets, ((0.05, 900.0), (math.inf, 1000.0)), 2.0, 0.05)
    assert lat == PodLatency(30.0, 50.0, 900.0, 1000.0)
    # 20 first tokens late; of the 30 in time, 10% of the gaps were slow.
    got = counts_from_latency(lat)
    assert (got.met, got.missed_ttft, got.missed_tpot) == pytest.approx((27.0, 20.0, 3.0))


def test_pods_interval_counts_difference_new_and_restarted_pods():
    before = {"a": PodLatency(10, 10, 100, 100), "b": PodLatency(50, 60, 0, 0)}
    now = {
        "a": PodLatency(20, 30, 200, 200),  # +10 in time of +20
        "b": PodLatency(5, 5, 0, 0),  # restarted: what it has since
        "c": PodLatency(4, 4, 10, 10),  # new since the last sync: all of it
    }
    got = pods_interval_counts(now, before)
    assert got == SloCounts(met=19.0, missed_ttft=10.0)
    assert pods_interval_counts(now, {}) is None  # no baseline: nothing to difference


def test_window_keeps_recent_intervals_and_fresh_ones():
    ivs = (
        SloInterval(NOW - 200, 15, SloCounts(met=5, missed_ttft=5), 1.0),
        SloInterval(NOW - 30, 15, SloCounts(met=90, missed_ttft=10), 2.0),
        SloInterval(NOW, 15, SloCounts(met=100), 4.0),
    )
    w = window(ivs, NOW, 120.0)
    assert w.counts == SloCounts(met=190, missed_ttft=10) and w.load_per_replica == pytest.approx(3.0)
    assert window(ivs, NOW, 120.0, since=NOW - 20).counts == SloCounts(met=100)


# -- feedback.py ---------------------------------------------------------------------------------


def _state(*intervals: tuple[float, SloCounts, float | None], **kw: object) -> SloState:
    ivs = tuple(SloInterval(t, 15.0, c, load) for t, c, load in intervals)
    return SloState(time=NOW, intervals=ivs, source="router", **kw)  # type: ignore[arg-type]


def test_a_significant_miss_grows_the_fleet_and_corrects_the_capacity():
    state = _state((NOW, SloCounts(met=180, missed_tpot=20), 2.0))  # 90% at 2 req/s per replica
    fb = evaluate(state, NOW, current=5, ready=5, settings=SETTINGS, model_capacity=4.0, settle_s=10)
    # 9 budgets short: the largest step, +50%
    assert fb.recommendation == 8 and not fb.allow_scale_down
    assert "measured attainment 0.900 < target 0.990" in fb.text
    # missed at half the model's capacity: the model is optimistic there; the planner's ceiling is
    # below the load that missed, by what the misses prove at CUT_Z standard deviations (45%: the
    # cut is remembered, so it asks for more evidence than the step)
    cut = proven_step(20, 200, 0.01, SETTINGS.gain, SETTINGS.max_step, CUT_Z)
    assert cut == pytest.approx(0.1 * ((20 - 2 * math.sqrt(20)) / 200 - 0.01) / 0.01)
    assert fb.state.capacity_ceiling == pytest.approx(2.0 * (1 - cut)) and fb.state.capacity_floor is None
    assert planner_capacity(fb.state, 4.0) == pytest.approx(2.0 * (1 - cut))
    # a ceiling is a load, not a ratio: the model's swing with the token mix does not carry past it
    assert planner_capacity(fb.state, 8.0) == pytest.approx(2.0 * (1 - cut))
    assert planner_capacity(fb.state, 0.5) == pytest.approx(0.5)
    assert fb.state.fresh_since == NOW + 10
    # the next sync sees only what began after the step took effect: no second step on old misses
    later = evaluate(fb.state, NOW + 15, 8, 5, SETTINGS, 4.0, 10)
    assert later.recommendation is None and not later.allow_scale_down


def test_a_few_misses_ask_for_what_they_prove_not_their_point_estimate():
    # 3 late of 66 (95.5%): significant against 99%, but one burst of long prompts can do that. The
    # point estimate (3.5 budgets short) asked +35% and cut the capacity by as much; the misses less
    # one standard deviation prove 0.9 budgets: +9%. At two (a cut's evidence) they prove nothing
    # below the load that missed: the ceiling is that load.
    state = _state((NOW, SloCounts(met=63, missed_ttft=3), 2.0))
    fb = evaluate(state, NOW, current=10, ready=10, settings=SETTINGS, model_capacity=4.0, settle_s=10)
    step = proven_step(3, 66, 0.01, SETTINGS.gain, SETTINGS.max_step)
    assert step == pytest.approx(0.1 * ((3 - math.sqrt(3)) / 66 - 0.01) / 0.01)
    assert proven_step(3, 66, 0.01, SETTINGS.gain, SETTINGS.max_step, CUT_Z) == 0.0
    assert fb.recommendation == 11 and fb.state.capacity_ceiling == pytest.approx(2.0)
    # many misses prove nearly their whole shortfall; the largest step stays the cap
    assert proven_step(40, 1000, 0.01, 0.1, 0.5) == pytest.approx(0.1 * (40 - math.sqrt(40) - 10) / 10)
    assert proven_step(300, 1000, 0.01, 0.1, 0.5) == 0.5
    assert proven_step(1, 10, 0.01, 0.1, 0.5) == 0.0  # one miss proves nothing
    # however small the proof, a significant miss adds a replica
    small = _state((NOW, SloCounts(met=38, missed_ttft=2), 2.0))
    assert evaluate(small, NOW, 10, 10, SETTINGS, 4.0, 10).recommendation == 11


def test_capacity_is_learnt_from_requests_the_fleet_served_whole():
    # The last step took effect at NOW - 20 (a cold start's queue, a burst): the misses since then
    # (17 of 42) are requests that began on the smaller fleet. They grow the fleet at once, but teach
    # no capacity until intervals that began a request span (here 25 s) after the step are judged.
    # Cutting the capacity for them held one trace's fleet at 2-3x its need for half an hour.
    early = _state((NOW, SloCounts(met=25, missed_tpot=17), 0.7), fresh_since=NOW - 20)
    fb = evaluate(early, NOW, 3, 3, SETTINGS, 1.1, 10, span_s=25.0)
    assert fb.recommendation == 5 and fb.state.capacity_ceiling is None
    # without the span (or once the served window holds the misses) the same counts cut it
    assert evaluate(early, NOW, 3, 3, SETTINGS, 1.1, 10).state.capacity_ceiling is not None
    # requests served whole by the fleet as it is: those teach the capacity, at their own load
    served = _state(
        (NOW - 15, SloCounts(met=25, missed_tpot=17), 0.9),
        (NOW, SloCounts(met=190, missed_tpot=10), 0.7),
        fresh_since=NOW - 40,
    )
    fb = evaluate(served, NOW, 3, 3, SETTINGS, 1.1, 10, span_s=25.0)
    cut = proven_step(10, 200, 0.01, SETTINGS.gain, SETTINGS.max_step, CUT_Z)
    assert fb.recommendation is not None and fb.state.capacity_ceiling == pytest.approx(0.7 * (1 - cut))
    # too few of them to judge: the fleet grows, the capacity waits
    few = _state(
        (NOW - 15, SloCounts(met=25, missed_tpot=17), 0.9),
        (NOW, SloCounts(met=10, missed_tpot=5), 0.7),
        fresh_since=NOW - 40,
    )
    fb = evaluate(few, NOW, 3, 3, SETTINGS, 1.1, 10, span_s=25.0)
    assert fb.recommendation is not None and fb.state.capacity_ceiling is None


def test_request_span_is_the_ttft_target_and_the_output_at_the_tpot_target():
    targets = _targets().slo
    assert targets is not None
    assert request_span_s(targets, None) == 0.0
    span = request_span_s(targets, (12000.0, 300.0))
    assert span == pytest.approx(targets.slo.ttft_target(12000, targets.calibration) + 300 * 0.05)
    assert request_span_s(targets, (12000.0, 600.0)) == pytest.approx(span + 300 * 0.05)


def test_noise_within_the_budget_is_not_a_miss():
    # 5 misses in 480 requests: 98.96%, but within two standard deviations of a 1% budget
    state = _state((NOW, SloCounts(met=475, missed_ttft=5), 2.0))
    fb = evaluate(state, NOW, 5, 5, SETTINGS, 4.0, 10)
    assert fb.recommendation is None and fb.state.capacity_ceiling is None and not fb.allow_scale_down


def test_a_backlog_is_left_to_the_queue_rule():
    state = _state((NOW, SloCounts(met=100, missed_ttft=100), 2.0), last_backlog=NOW - 30)
    fb = evaluate(state, NOW, 5, 5, SETTINGS, 4.0, 10)
    assert fb.recommendation is None and fb.state.capacity_ceiling is None


def test_scale_down_needs_headroom_and_a_measurement():
    full = _state((NOW, SloCounts(met=1000), 3.0))
    fb = evaluate(replace(full, capacity_ceiling=2.0), NOW, 5, 5, SETTINGS, 4.0, 10)
    assert fb.allow_scale_down and fb.attainment == 1.0
    # headroom at 3 req/s per replica proves 3: the floor, and a ceiling below it is lifted to it
    assert fb.state.capacity_floor == pytest.approx(3.0) and fb.state.capacity_ceiling == pytest.approx(3.0)
    # running at the ceiling with headroom: it is probed upward by capacity_relax, toward the model
    at_ceiling = evaluate(replace(full, capacity_ceiling=3.0), NOW, 5, 5, SETTINGS, 4.0, 10)
    assert at_ceiling.state.capacity_ceiling == pytest.approx(3.0 * 1.03)
    # the model pessimistic (2/s) where 3 were sustained: the floor holds the planner at 3, and
    # running at it with headroom probes it upward
    floor = evaluate(replace(full, capacity_floor=3.0), NOW, 5, 5, SETTINGS, 2.0, 10)
    assert floor.state.capacity_floor == pytest.approx(3.0 * 1.03)
    assert planner_capacity(floor.state, 2.0) == pytest.approx(3.0 * 1.03)
    # far below the bound (1 req/s per replica at a 3/s ceiling): no evidence, no probe
    idle = _state((NOW, SloCounts(met=1000), 1.0), capacity_ceiling=3.0)
    assert evaluate(idle, NOW, 5, 5, SETTINGS, 4.0, 10).state.capacity_ceiling == pytest.approx(3.0)
    # a miss below the floor: the workload got heavier, the floor comes down with the ceiling
    heavier = _state((NOW, SloCounts(met=180, missed_tpot=20), 2.0), capacity_floor=3.0)
    dropped = evaluate(heavier, NOW, 5, 5, SETTINGS, 4.0, 10).state
    cut = 2.0 * (1 - proven_step(20, 200, 0.01, SETTINGS.gain, SETTINGS.max_step, CUT_Z))
    assert dropped.capacity_ceiling == pytest.approx(cut) and dropped.capacity_floor == pytest.approx(cut)
    tight = _state((NOW, SloCounts(met=992, missed_ttft=8), 3.0))  # 99.2%: met, but no headroom
    assert not evaluate(tight, NOW, 5, 5, SETTINGS, 4.0, 10).allow_scale_down
    few = _state((NOW, SloCounts(met=5, failed=1), 3.0))  # low traffic: little to lose
    assert evaluate(few, NOW, 5, 5, SETTINGS, 4.0, 10).allow_scale_down
    unknown = evaluate(SloState(), NOW, 5, 5, SETTINGS, 4.0, 10)
    assert unknown.attainment is None and not unknown.allow_scale_down


def test_a_floor_served_at_a_lighter_mix_counts_at_a_heavier_one_only_in_proportion():
    # 1.8 requests/s per replica served with headroom where the model, at that token mix, said 2.8
    light = evaluate(_state((NOW, SloCounts(met=1000), 1.8)), NOW, 2, 2, SETTINGS, 2.8, 10).state
    assert light.capacity_floor == pytest.approx(1.8) and light.floor_capacity == pytest.approx(2.8)
    # prompts got longer: the model says 1.5/s. 1.8/s of short prompts is no evidence for 1.8 of long
    # ones: the floor counts as 1.8 x 1.5 / 2.8, below the model, which the planner takes (1.8 before)
    assert floor_at_mix(light, 1.5) == pytest.approx(1.8 * 1.5 / 2.8)
    assert planner_capacity(light, 1.5) == pytest.approx(1.5)
    # ... and so does the scale-down limit: 2.2/s on one replica is within 1.25x the floor as measured
    # (2.25), far past it where the mix is now
    assert served_load_limit(1, 2, 2.2, light.capacity_floor)[0] == 1
    assert served_load_limit(1, 2, 2.2, floor_at_mix(light, 1.5))[0] == 2
    # a floor above a pessimistic model (3/s served where it said 2) holds at its mix and lighter ones,
    # and at a heavier one in proportion, near its mix (the model at 1/FLOOR_MIX_RANGE of its capacity
    # there or more); farther, the model's error at one mix says nothing of its error at the other
    # (a model pessimistic at short prompts was optimistic at long ones): the floor counts up to the
    # model's capacity there, not above it
    pessimistic = evaluate(_state((NOW, SloCounts(met=1000), 3.0)), NOW, 5, 5, SETTINGS, 2.0, 10).state
    assert pessimistic.floor_capacity == pytest.approx(2.0)
    assert planner_capacity(pessimistic, 2.0) == pytest.approx(3.0)
    assert planner_capacity(pessimistic, 2.5) == pytest.approx(3.0)
    near = 2.0 / FLOOR_MIX_RANGE
    assert planner_capacity(pessimistic, near) == pytest.approx(3.0 / FLOOR_MIX_RANGE)
    assert planner_capacity(pessimistic, 0.99 * near) == pytest.approx(0.99 * near)
    assert planner_capacity(pessimistic, 1.0) == pytest.approx(1.0)
    # ... and the scale-down limit is held to it: 9/s on 5 replicas (1.8/s each) is within 1.25x
    # the floor scaled (1.5/s each) but 1.8x the model's 1.0
    assert served_load_limit(5, 9, 9.0, floor_at_mix(pessimistic, 1.0))[0] == 8
    # measured before the planner had a mix: taken as it is
    assert floor_at_mix(SloState(capacity_floor=3.0), 1.0) == 3.0
    # a sync that does not move the floor keeps its mix; a new floor is measured at the current one
    again = evaluate(replace(light, intervals=(SloInterval(NOW + 15, 15.0, SloCounts(met=1000), 0.5),)),
                     NOW + 15, 2, 2, SETTINGS, 1.5, 10).state  # fmt: skip
    assert (again.capacity_floor, again.floor_capacity) == (light.capacity_floor, light.floor_capacity)
    higher = evaluate(replace(light, intervals=(SloInterval(NOW + 15, 15.0, SloCounts(met=1000), 1.2),)),
                      NOW + 15, 2, 2, SETTINGS, 1.5, 10).state  # fmt: skip
    assert higher.capacity_floor == pytest.approx(1.2) and higher.floor_capacity == pytest.approx(1.5)


def test_a_load_judged_at_a_lighter_mix_than_the_planner_sizes_for_raises_the_floor_in_proportion():
    """The planner's prompt mix (the prompts admitted) leads the requests judged (the finished ones):
    right after the mix triples, the window's 1.8/s per replica were served at the old mix, where the
    model said 2.8/s, and the model says 1.2 at the new one. The floor is raised to 1.8 x 1.2 / 2.8,
    written in the new mix's terms, not to 1.8 as if the heavy requests had been served at that load."""
    ok = _state((NOW, SloCounts(met=1000), 1.8))
    led = evaluate(ok, NOW, 2, 2, SETTINGS, 1.2, 10, judged_capacity=2.8).state
    assert led.capacity_floor == pytest.approx(1.8 * 1.2 / 2.8) and led.floor_capacity == pytest.approx(1.2)
    assert planner_capacity(led, 1.2) == pytest.approx(1.2)  # the model's, not the old load's
    # judged at the same mix, or at a heavier one (the mix got lighter): the load as served
    assert evaluate(ok, NOW, 2, 2, SETTINGS, 1.2, 10, judged_capacity=1.2).state.capacity_floor == 1.8
    assert evaluate(ok, NOW, 2, 2, SETTINGS, 2.8, 10, judged_capacity=1.2).state.capacity_floor == 1.8


def test_the_probe_stops_at_a_load_that_missed_while_it_is_remembered():
    # A fleet of 2 sized at a 0.8/s ceiling runs at 0.5/s per replica with headroom: the probe raises
    # the ceiling 3% a sync, and once it passes the fleet's whole rate (1.0/s) the planner halves the
    # fleet into the load at which it missed (1.0/s per replica, cut to 0.8) minutes before. So while
    # the cut is remembered the probe stops at that load.
    missed = _state((NOW, SloCounts(met=190, missed_tpot=10), 1.0))
    cut = evaluate(missed, NOW, 1, 1, SETTINGS, 2.0, 10)
    assert cut.state.miss_load == pytest.approx(1.0) and cut.state.miss_at == NOW
    ceiling = cut.state.capacity_ceiling
    assert ceiling is not None and ceiling < 1.0

    def probe(state: SloState, t: float, load: float) -> SloState:
        ok = replace(state, intervals=(SloInterval(t, 15.0, SloCounts(met=300), load),), time=t)
        return evaluate(ok, t, 2, 2, SETTINGS, 2.0, 10).state

    state, t = cut.state, NOW
    for _ in range(40):
        t += 15
        state = probe(state, t, 0.5)
    assert state.capacity_ceiling == pytest.approx(1.0)  # up to the load that missed, not past it
    assert state.capacity_floor == pytest.approx(0.5)
    # forgotten after miss_memory_s: the probe goes on toward the model
    later = probe(state, NOW + SETTINGS.miss_memory_s + 15, 0.5)
    assert later.miss_load is None and later.capacity_ceiling == pytest.approx(1.03)
    # served past the cut's ceiling by a probe step (the load outran the fleet with headroom): the
    # cut was wrong, the memory ends at once
    outran = probe(cut.state, NOW + 15, (ceiling or 0) * 1.05)
    assert outran.miss_load is None and outran.capacity_floor == pytest.approx((ceiling or 0) * 1.05)


def test_an_unproven_cut_below_the_floor_is_not_remembered():
    # 2 late of 50 at 0.25 req/s per replica, where the model says 0.5 and the fleet had served 0.45
    # with headroom (the floor): enough to grow the fleet, but less two standard deviations no miss is
    # left to size a cut on, and the floor says otherwise. The ceiling (and the floor) come down to
    # the load that missed, and the probe may take it back; held there for miss_memory_s, such a cut
    # kept a fleet at 182% of the fixed fleet's replica-hours for half an hour (fleet_battery seed 31).
    missed = _state((NOW, SloCounts(met=48, missed_tpot=2), 0.25), capacity_floor=0.45)
    fb = evaluate(missed, NOW, 4, 4, SETTINGS, 0.5, 10)
    assert fb.recommendation is not None and fb.recommendation > 4
    assert fb.state.capacity_ceiling == pytest.approx(0.25) and fb.state.capacity_floor == pytest.approx(0.25)
    assert fb.state.miss_load is None
    t = NOW + 15
    ok = replace(fb.state, intervals=(SloInterval(t, 15.0, SloCounts(met=300), 0.25),), time=t)
    assert evaluate(ok, t, 5, 5, SETTINGS, 0.5, 10).state.capacity_ceiling == pytest.approx(0.25 * 1.03)
    # the same misses with no floor above them (nothing measured contradicts them), or proven: remembered
    for state in (replace(missed, capacity_floor=0.2), replace(missed, capacity_floor=None)):
        assert evaluate(state, NOW, 4, 4, SETTINGS, 0.5, 10).state.miss_load == pytest.approx(0.25)
    proven = _state((NOW, SloCounts(met=180, missed_tpot=20), 0.25), capacity_floor=0.45)
    assert evaluate(proven, NOW, 4, 4, SETTINGS, 0.5, 10).state.miss_load == pytest.approx(0.25)


def test_below_target_but_not_yet_significant_steps_the_capacity_down():
    # 98.5% over 200 requests at 3 req/s per replica, the planner sizing at 3: within noise of a 1%
    # budget (no step), but below target while running as sized: the capacity steps down 3%.
    state = _state((NOW, SloCounts(met=197, missed_tpot=3), 3.0), capacity_ceiling=3.0)
    fb = evaluate(state, NOW, 5, 5, SETTINGS, 4.0, 10)
    assert fb.recommendation is None and not fb.allow_scale_down
    assert fb.state.capacity_ceiling == pytest.approx(3.0 * 0.97)
    # the same misses from before the last step took effect do not count again
    stale = evaluate(replace(state, fresh_since=NOW + 5), NOW, 5, 5, SETTINGS, 4.0, 10)
    assert stale.state.capacity_ceiling == pytest.approx(3.0)


def test_a_surge_s_misses_grow_the_fleet_but_teach_no_capacity():
    state = _state((NOW, SloCounts(met=180, missed_tpot=20), 2.0))
    fb = evaluate(state, NOW, 5, 5, SETTINGS, 4.0, 10, surging=True)
    assert fb.recommendation == 8 and fb.state.capacity_ceiling is None


def test_no_burst_factor_while_the_measured_slo_is_met():
    """A queue blip on a fleet meeting its SLO asks the queue rule's own size, not 1.5x it."""
    targets = _targets()

    def burst(router_slo: SloCounts) -> int:
        # KV saturated with requests waiting: burst mode
        samples = tuple(replace(s, kv_cache_usage=0.97, num_waiting=40) for s in _samples(4))
        d = decide(4, MetricsSnapshot(4, samples, router_slo=router_slo), targets, _history(4, 1000.0), NOW)
        assert d.burst
        return d.recommendation  # before the rate limits

    met = burst(SloCounts(met=1200))
    missed = burst(SloCounts(met=1170, missed_ttft=30))
    assert missed >= math.ceil(met * 1.5)


def test_record_interval_differences_router_counters_and_skips_resets():
    s = record_interval(SloState(), NOW, SloCounts(met=100), {}, {}, 2.0, 120.0)
    assert s.intervals == () and s.source == "router"  # the first read is a baseline
    s = record_interval(s, NOW + 15, SloCounts(met=150, missed_ttft=5), {}, {}, 2.0, 120.0)
    assert s.intervals[-1].counts == SloCounts(met=50, missed_ttft=5)
    s2 = record_interval(s, NOW + 30, SloCounts(met=3), {}, {}, 2.0, 120.0)
    assert len(s2.intervals) == 1  # went down: a router restarted, no interval
    s3 = record_interval(s, NOW + 30, None, {}, {}, 2.0, 120.0, backlog=True)
    assert s3.last_backlog == NOW + 30 and s3.time == s.time  # nothing measured: baseline kept


# -- policy.decide -------------------------------------------------------------------------------


def test_below_target_grows_even_when_the_planner_says_enough():
    targets = _targets()
    history = _history(4, router_met=1000.0)
    # 10 requests per replica in 15 s at 2000+200 tokens: the planner is content with 4 (or fewer),
    # but the routers judged 60 of the last 200 requests as late.
    content = decide(
        4, MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1200)), targets, history, NOW
    )
    assert content.slo_recommendation is not None and content.desired <= 4  # the model says enough
    snap = MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1140, missed_ttft=60))
    d = decide(4, snap, targets, history, NOW)
    # The feedback asks for +50% (6); the miss at 0.67 req/s per replica also sets the planner's
    # ceiling to half that load, so the planner, now sizing from that measurement, asks for 8: the
    # measured attainment set the size.
    assert d.feedback_recommendation == 6
    assert d.history.slo.capacity_ceiling == pytest.approx(2.67 / 4 * 0.5, abs=1e-2)
    assert d.desired == 8 and d.signal == "measured attainment"
    assert d.reason.startswith("measured attainment 0.700 < target 0.990 (router")
    assert "measured ceiling" in d.reason and "[signal: measured attainment]" in d.reason
    assert d.capacity_factor is not None and d.capacity_factor < 0.1


def test_missing_router_counters_are_not_perfect_attainment():
    targets = _targets()
    history = History(arrivals=_history(6, 0.0).arrivals)  # no SLO measurement so far
    quiet = MetricsSnapshot(6, _samples(6, done=1001.0, kv=0.01))
    d = decide(6, quiet, targets, history, NOW)
    assert d.desired == 6 and d.signal == "attainment unknown" and d.attainment is None


def test_pods_histograms_are_the_fallback():
    targets = _targets()

    def pod(i: int, ttft_ok: float, total: float) -> ReplicaSample:
        return replace(
            _samples(1)[0],
            pod=f"p{i}",
            ttft_buckets=((1.0, ttft_ok), (2.5, ttft_ok), (math.inf, total)),
            itl_buckets=((0.05, total * 10), (math.inf, total * 10)),
        )

    before = _history(2, 0.0, mix=False)  # the planner is not sizing yet: the loop alone
    counters = tuple(
        replace(c, latency=PodLatency(100.0, 100.0, 1000.0, 1000.0)) for c in before.arrivals.counters
    )
    history = replace(
        before, arrivals=replace(before.arrivals, counters=counters), slo=SloState(time=NOW - 15.0)
    )
    snap = MetricsSnapshot(2, (pod(0, 120.0, 150.0), pod(1, 120.0, 150.0)))  # 40 of 100 late
    d = decide(2, snap, targets, history, NOW)
    assert d.attainment_source == "pods" and d.attainment == pytest.approx(0.4)
    assert d.desired == 3 and d.signal == "measured attainment"


def test_status_round_trip_keeps_the_loop_and_publishes_the_prefill_terms():
    targets = _targets()
    snap = MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1140, missed_ttft=60))
    d = decide(4, snap, targets, _history(4, router_met=1000.0), NOW)
    block = decision_to_status(d, NOW, None)
    slo = block["slo"]
    a, b = prefill_terms(calibration_by_name("h100/llama-3.1-8b"))
    assert slo["prefillSecondsPerToken"] == a and slo["prefillSecondsPerTokenSquared"] == b
    assert slo["attainment"] == pytest.approx(0.7) and slo["source"] == "router" and slo["target"] == 0.99
    assert AutoscalerStatus.model_validate(block).slo is not None  # declared by the shared model
    back = history_from_status(block).slo
    assert back.capacity_ceiling == pytest.approx(d.history.slo.capacity_ceiling or 0, abs=1e-4)
    assert back.capacity_floor == d.history.slo.capacity_floor
    assert slo["capacityFactor"] == pytest.approx(d.capacity_factor or 0, abs=1e-4)
    assert back.router_counts == SloCounts(met=1140, missed_ttft=60)
    assert back.fresh_since == pytest.approx(d.history.slo.fresh_since or 0, abs=1e-3)
    assert [i.counts for i in back.intervals] == [i.counts for i in d.history.slo.intervals]
    # the cut's memory (the probe's limit) survives a restart too
    assert d.history.slo.miss_load is not None and d.history.slo.miss_at == NOW
    assert back.miss_load == pytest.approx(d.history.slo.miss_load, abs=1e-4)
    assert back.miss_ceiling == pytest.approx(d.history.slo.miss_ceiling or 0, abs=1e-4)
    assert back.miss_at == pytest.approx(NOW, abs=1e-3)
    # and the floor with the model's capacity at the mix it was measured at
    served = decide(4, MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1140)), targets,
                    _history(4, router_met=1000.0), NOW)  # fmt: skip
    assert served.history.slo.capacity_floor is not None and served.history.slo.floor_capacity is not None
    kept = history_from_status(decision_to_status(served, NOW, None)).slo
    assert kept.capacity_floor == pytest.approx(served.history.slo.capacity_floor, abs=1e-4)
    assert kept.floor_capacity == pytest.approx(served.history.slo.floor_capacity, abs=1e-4)


# -- sources -------------------------------------------------------------------------------------


def test_router_slo_counters_and_pod_histograms_parse():
    text = (
        "# TYPE kvpilot_router_slo_requests_total counter\n"
        'kvpilot_router_slo_requests_total{model_name="chat",outcome="met"} 90\n'
        'kvpilot_router_slo_requests_total{model_name="chat",outcome="missed_tpot"} 10\n'
        'kvpilot_router_slo_requests_total{model_name="other",outcome="met"} 5\n'
    )
    got = parse_router_slo(text)
    assert SloCounts.from_outcomes(got["chat"]) == SloCounts(met=90, missed_tpot=10)
    page = (
        'kvpilot_kv_cache_usage_ratio{model_name="m"} 0.5\n'
        'kvpilot_num_requests_waiting{model_name="m"} 0\n'
        "# TYPE kvpilot_time_to_first_token_seconds histogram\n"
        'kvpilot_time_to_first_token_seconds_bucket{model_name="m",le="1.0"} 8\n'
        'kvpilot_time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 10\n'
        'kvpilot_time_to_first_token_seconds_count{model_name="m"} 10\n'
        'kvpilot_time_to_first_token_seconds_sum{model_name="m"} 5\n'
        "# TYPE kvpilot_inter_token_latency_seconds histogram\n"
        'kvpilot_inter_token_latency_seconds_bucket{model_name="m",le="0.05"} 70\n'
        'kvpilot_inter_token_latency_seconds_bucket{model_name="m",le="+Inf"} 100\n'
        'kvpilot_inter_token_latency_seconds_count{model_name="m"} 100\n'
        'kvpilot_inter_token_latency_seconds_sum{model_name="m"} 3\n'
    )
    sample = parse_metrics_text(page, "p0", "m")
    assert sample is not None and sample.ttft_buckets == ((1.0, 8.0), (math.inf, 10.0))
    assert pod_latency(sample.ttft_buckets, sample.itl_buckets, 2.0, 0.05) == PodLatency(8, 10, 70, 100)


# -- the simulator runs the same loop ---------------------------------------------------------------


def test_the_simulated_fleet_closes_the_loop_where_the_model_is_optimistic():
    """The Mooncake head (long prompts: prefill chunks stretch the decodes' TPOT) tiled to 15 minutes:
    the planner alone sizes for its model and misses; with the loop, the measured attainment (the
    simulated router's counter, judged with api/slo.judge) grows the fleet to the target."""
    from kvpilot.autoscaler.fleet_policies import KvpilotPolicy
    from kvpilot.autoscaler.simulator import ROUTERS, FleetSimulator
    from kvpilot.autoscaler.slo import Slo
    from kvpilot.autoscaler.spec import Behavior, SloTargets
    from kvpilot.autoscaler.trace import load_trace

    cal = replace(calibration_by_name("h100/llama-3.1-8b"), startup_s=10)
    head = load_trace(str(Path(__file__).parent / "data" / "mooncake_synthetic_head200.jsonl"))
    span = head[-1].t + 1.0
    trace = [
        replace(r, t=r.t + k * span, hash_ids=tuple(h + 100_000 * k for h in r.hash_ids))
        for k in range(int(900 // span))
        for r in head
    ]
    results = {}
    for loop in (False, True):
        targets = ScalingTargets(
            min_replicas=1,
            max_replicas=30,
            max_num_seqs=cal.max_num_seqs,
            slo=SloTargets(cal, "h100/llama-3.1-8b"),
            behavior=Behavior(slo_feedback=loop),
        )
        sim = FleetSimulator(
            trace, KvpilotPolicy(targets), cal, slo=Slo(), router=ROUTERS["router:kv-aware"]()
        )
        results[loop] = sim.run()
        # the router's counter saw every request, judged as the result judges them
        assert sum(sim._outcomes.values()) == len(trace)
    assert results[False].slo_attainment < 0.95
    assert results[True].slo_attainment >= 0.99
    assert results[True].replica_hours > results[False].replica_hours  # it paid for it, knowingly


def test_a_scale_down_stops_short_of_loads_never_served_on_time():
    # 2.67 req/s on 4 replicas, all on time; the model (12/s per replica) would carry it on one
    targets = _targets()
    snap = MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1200))
    assert smallest_proven_size(2.67, 0.7) == 4 and smallest_proven_size(2.67, 1.0) == 3
    assert smallest_proven_size(2.67, None) == 0 and smallest_proven_size(0.0, 1.0) == 0
    # nothing served above 0.67-0.7/s each: 3 replicas (0.89 each) would be past 1.25x that
    for floor in (None, 0.7):
        held = decide(4, snap, targets, _history(4, router_met=1000.0, capacity_floor=floor), NOW)
        assert held.desired == 4 and held.signal == "served load"
        assert "2.67/s on 3 would be 0.89/s each, past 1.25x the highest load served on time" in held.reason
    # 1/s served on time: one replica fewer is within reach, not two
    step = decide(4, snap, targets, _history(4, router_met=1000.0, capacity_floor=1.0), NOW)
    assert step.desired == 3
    # served far above this load before: the planner's size, as the scale-down rate limit allows
    proven = decide(4, snap, targets, _history(4, router_met=1000.0, capacity_floor=5.0), NOW)
    assert proven.desired < 4 and proven.signal != "served load"
    # the rule alone: a recommendation of none with arrivals left keeps what they need; sizes up,
    # holds and an unmeasured floor pass
    size, note = served_load_limit(0, 2, 0.5, 1.0)
    assert size == 1 and note is not None and "0.50/s on 0 would be unserved" in note
    assert served_load_limit(5, 4, 9.0, 1.0) == (5, None) and served_load_limit(4, 4, 9.0, 1.0) == (4, None)
    assert served_load_limit(2, 4, 9.0, None) == (2, None) and served_load_limit(2, 4, None, 1.0) == (2, None)


def test_a_scale_down_at_a_long_startup_keeps_room_for_the_rate_to_rise():
    # 2.67 req/s on 4 replicas, all on time, the capacity measured at 0.8-0.9/s per replica (the probe
    # raises the ceiling to 0.93 this sync): 3 carry the rate at 96% each. With replicas Ready 10 s after
    # they are asked for that is the size; with 60 s the fleet keeps room for the rate +20% (3.2/s: 4
    # replicas), since a rise would wait a startup for the replica it needs.
    targets = _targets()
    history = _history(4, router_met=1000.0, capacity_floor=0.8, capacity_ceiling=0.9)
    sizes = {}
    for startup in (10.0, 60.0):
        snap = MetricsSnapshot(4, _samples(4), router_slo=SloCounts(met=1200), startup_s=startup)
        sizes[startup] = decide(4, snap, targets, history, NOW)
    assert sizes[10.0].desired == 3 and sizes[10.0].signal != "startup rise"
    held = sizes[60.0]
    assert held.desired == 4 and held.signal == "startup rise"
    assert (
        "scale-down to 4, not 3: a 60s startup keeps room for 3.20/s (+20%) at 0.93/s per replica"
        in held.reason
    )
    # the rule alone: the size that carries the risen rate, never above the current size; sizes up,
    # holds, short startups and unknown inputs pass
    assert startup_rise_limit(1, 4, 2.67, 0.9, 60.0)[0] == 4
    assert startup_rise_limit(1, 6, 2.67, 0.9, 60.0)[0] == 4
    assert startup_rise_limit(1, 6, 2.0, 0.9, 60.0)[0] == 3
    assert startup_rise_limit(1, 6, 2.0, 0.9, STARTUP_AWARE_MIN_S - 1.0) == (1, None)
    assert startup_rise_limit(5, 4, 9.0, 0.9, 60.0) == (5, None) and startup_rise_limit(
        4, 4, 9.0, 0.9, 60.0
    ) == (4, None)
    assert startup_rise_limit(1, 4, None, 0.9, 60.0) == (1, None) and startup_rise_limit(
        1, 4, 2.0, 0.9, None
    ) == (1, None)
    assert startup_rise_limit(1, 4, 2.0, 0.0, 60.0) == (1, None)
    assert startup_rise_limit(0, 4, 0.0, 0.9, 60.0) == (0, None)
