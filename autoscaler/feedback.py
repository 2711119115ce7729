"""The closed loop: what the measured SLO attainment asks of the fleet. Pure; policy.decide() calls it
(in the controller and in the simulator alike) when spec.autoscaling.slo is set.

Every sync, the requests judged since the last one become an SloInterval (attainment.py); the
window is the intervals of the last Behavior.attainment_window_s. Three rules:

1. **Grow on a miss.** When the attainment of the *fresh* intervals (those that began after the last
   step took effect: a step's new replicas need a startup before they can change anything) is below
   the target over at least attainment_min_requests requests, the fleet grows to
   ceil(ready x (1 + step)) (at least one replica more), step = min(feedback_max_step, feedback_gain
   x shortfall / budget), where budget = 1 - target and the shortfall is what the misses prove: their
   count less EVIDENCE_Z Poisson standard deviations (proven_step). 2,000 requests at 98% against a
   99% target (one budget short) ask for ~7% more, at 90% for the most, 50%; 3 late of 66 for 9%, not
   the 35% of their point estimate. This is the feedback term of desired = max(feed-forward,
   feedback).
2. **Measure the capacity.** The planner's per-replica capacity is the replica model's, held
   between two measured bounds in requests/s per Ready replica (planner_capacity): a *floor*, the
   highest load L at which the window's attainment had headroom (a replica sustains L), and a
   *ceiling*, set by a significant miss at a load L the planner thought within capacity: L x (1 -
   cut) (the model is optimistic there), L and the cut read from the requests the fleet served whole
   (those judged a request span after the last step took effect: the others began on a smaller fleet,
   which the step answers) and the cut sized like the step but on the misses less CUT_Z standard
   deviations (a step answers one sync; a cut is remembered, unless its misses neither prove it nor
   agree with the floor: see below). The bounds are loads, not ratios to the model: the model's
   capacity swings with the token mix (fourfold over the Mooncake trace, where one fixed fleet
   serves all of it), and a ratio multiplies that swing; a bound caps it. Except the floor where
   the mix got heavier than it was measured at: a load served with short prompts is no evidence
   for long ones, so there it scales down with the model (floor_at_mix). A miss below the floor
   drops the floor to the new ceiling (the workload got heavier); headroom while running within
   tolerance of the binding bound raises it by capacity_relax per sync (the ceiling toward the
   model, the floor past it: a probe, and rule 3's headroom stops it before misses add up); below
   target since the last step while running as sized, but not yet significantly, lowers it by
   capacity_relax per sync (the mirror of the probe). Not learnt while a backlog is in the window
   or arrivals surge. Both bounds are in status.autoscaler.slo, so a restarted autoscaler keeps
   them.
3. **Scale down only with headroom.** A smaller fleet is allowed only while the window's misses are
   within (1 - attainment_headroom) of the budget (with the defaults: attainment >= 99.5% against a
   99% target), or when too few requests were judged to say (low traffic: little to lose). With no
   measurement at all, scale-down is held: missing metrics are never read as perfect attainment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvpilot.autoscaler.attainment import (
    SOURCE_PODS,
    SOURCE_ROUTER,
    PodLatency,
    SloCounts,
    SloInterval,
    pod_latency,
    pods_interval_counts,
    window,
)
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.spec import Behavior, SloTargets

if TYPE_CHECKING:
    from kvpilot.autoscaler.arrivals import PodCounter

MAX_INTERVAL_S = 300.0  # an older baseline is not differenced (as the arrival counters)
MIN_MISSES = 2  # one unlucky request is not a trend
# A miss count is "below target" when it exceeds the budget's expectation by this many of its standard
# deviations (Poisson): 5 misses in 480 requests is 99.0%, noise at a 99% target; 10 is not.
SIGNIFICANCE_Z = 2.0
# How far below the miss count a step is sized (proven_step), in its standard deviations.
EVIDENCE_Z = 1.0
# ... and a capacity cut: a step answers one sync (the next looks again), a cut is remembered until
# the probe takes it back by capacity_relax a sync, so it is sized on stronger evidence.
CUT_Z = 2.0


# The floor is evidence above the model at the token mix it was measured at and near it, not at a mix
# heavier than this (the model's capacity there below 1/FLOOR_MIX_RANGE of its capacity at the floor's
# mix): floor_at_mix. A mix's sync-to-sync swing on a stationary trace stays within it.
FLOOR_MIX_RANGE = 1.5


@dataclass(frozen=True)
class SloState:
    """What the closed loop remembers between syncs (status.autoscaler.slo)."""

    time: float | None = None  # of the last measurement (the baseline of the next interval)
    router_counts: SloCounts | None = None  # the routers' cumulative counters then
    intervals: tuple[SloInterval, ...] = ()
    # Measured per-replica capacity bounds, requests/s per Ready replica (rule 2); None: not measured.
    capacity_floor: float | None = None
    capacity_ceiling: float | None = None
    fresh_since: float | None = None  # intervals that began before this do not trigger a step
    source: str | None = None  # of the latest interval
    last_backlog: float | None = None  # the last sync with requests waiting beyond the queue target
    # The last capacity cut (rule 2): the load that missed, the ceiling the cut set, and when. For
    # FeedbackSettings.miss_memory_s the probe does not raise the ceiling past that load.
    miss_load: float | None = None
    miss_ceiling: float | None = None
    miss_at: float | None = None
    # The replica model's capacity (requests/s per replica) at the token mix the floor was measured at:
    # the floor holds at that mix and at lighter ones, and at a heavier one only in proportion
    # (floor_at_mix). None: measured before the planner had a mix, taken as it is.
    floor_capacity: float | None = None


@dataclass(frozen=True)
class FeedbackSettings:
    target: float  # share of requests that must meet the SLO
    window_s: float
    min_requests: float
    gain: float
    max_step: float
    headroom: float
    relax: float
    tolerance: float = 0.1  # "running at the ceiling": within this share of it
    miss_memory_s: float = 1800.0  # how long a capacity cut's load caps the probe


@dataclass(frozen=True)
class Feedback:
    """The loop's view at one sync."""

    state: SloState
    attainment: float | None  # over the window; None: no request judged, or no source
    requests: float
    window_s: float
    recommendation: int | None  # replicas the measured attainment asks for; None: no opinion
    allow_scale_down: bool
    text: str  # for the decision's reason


def feedback_settings(slo: SloTargets, b: Behavior) -> FeedbackSettings:
    return FeedbackSettings(
        target=slo.attainment_target,
        window_s=b.attainment_window_s,
        min_requests=b.attainment_min_requests,
        gain=b.feedback_gain,
        max_step=b.feedback_max_step,
        headroom=b.attainment_headroom,
        relax=b.capacity_relax,
        tolerance=b.tolerance,
        miss_memory_s=b.surge_window_s,
    )


def floor_at_mix(state: SloState, model_capacity: float | None) -> float | None:
    """The floor (the highest load served with headroom) where the token mix is now: as measured at the
    mix it was measured at or a lighter one, and scaled by the model's capacity ratio at a heavier one.
    A load served with 5.6k-token prompts says little about the same load of 17k-token ones; kept as it
    was, a floor of 11.4/s per replica had the planner size one replica where the model asked for three
    (the mix-shift battery's seed 9: 74% attainment at 60 s startup, 97.8% with this; docs/autoscaler.md,
    "Sixth round"). Proportion holds near the floor's mix only: where the model's capacity is below
    1/FLOOR_MIX_RANGE of its capacity there, the floor counts up to the model's capacity, not above it.
    The model's error depends on the mix (pessimistic at short multi-turn prompts, which hit the prefix
    cache, optimistic at long ones): a floor 2.3x the model at 3.5k-token prompts, scaled, still said
    2.3x at 10k, where replicas sustained 0.8x, and sized the reaction to the shift on it (the
    mix-shift battery at --load 3, seed 1, 60 s startup: 2 -> 5 -> 8 -> 9 replicas over the first
    45 s where the model's capacity asks 10 -> 21 -> 24 for the backlog; docs/autoscaler.md,
    "Twelfth round")."""
    floor, at = state.capacity_floor, state.floor_capacity
    if floor is None or at is None or not model_capacity or model_capacity >= at:
        return floor
    scaled = floor * model_capacity / at
    return min(scaled, model_capacity) if at > FLOOR_MIX_RANGE * model_capacity else scaled


def planner_capacity(state: SloState, model_capacity: float) -> float:
    """Requests/s per replica the planner sizes with: the model's, within the measured bounds (the
    floor at the current mix: floor_at_mix)."""
    c = model_capacity
    if state.capacity_ceiling is not None:
        c = min(c, state.capacity_ceiling)
    floor = floor_at_mix(state, model_capacity)
    if floor is not None:
        c = max(c, floor)
    return c


# A scale-down may raise the load per replica to at most this factor of the highest load the fleet
# served on time (the floor): a smaller fleet past it is a test of a capacity nothing has shown, which
# a small fleet (3 -> 2: +50% each) pays for in misses for a startup.
MAX_UNPROVEN_RISE = 1.25


def smallest_proven_size(rate: float, floor: float | None) -> int:
    """The fewest replicas that carry `rate` requests/s at no more than MAX_UNPROVEN_RISE x the floor
    each (0 when no floor is measured: nothing to hold a scale-down to)."""
    if floor is None or floor <= 0.0 or rate <= 0.0:
        return 0
    return math.ceil(rate / (floor * MAX_UNPROVEN_RISE) - 1e-9)


def served_load_limit(
    desired: int, current: int, rate: float | None, floor: float | None
) -> tuple[int, str | None]:
    """A scale-down from `current` to `desired` replicas, stopped short of loads never served on time:
    (the size, the reason's note, None when the size stands). Sizes up and holds pass unchanged."""
    if desired >= current or rate is None or floor is None:
        return desired, None
    proven = min(current, smallest_proven_size(rate, floor))
    if desired >= proven:
        return desired, None
    each = f"{rate / desired:.2f}/s each" if desired > 0 else "unserved"
    return proven, (
        f"scale-down to {proven}, not {desired}: {rate:.2f}/s on {desired} would be {each}, "
        f"past {MAX_UNPROVEN_RISE:g}x the highest load served on time ({floor:.2f}/s)"
    )


def proven_step(
    missed: float, total: float, budget: float, gain: float, max_step: float, z: float = EVIDENCE_Z
) -> float:
    """The feedback step at the misses' count less `z` Poisson standard deviations: the shortfall the
    evidence supports. 3 misses in 66 requests (95.5% against 99%) support 0.9 budgets short, not the
    3.5 of their point estimate; 40 in 1,000 support 2.4 of the 3."""
    proven = max(0.0, missed - z * math.sqrt(missed))
    shortfall = max(0.0, (proven / max(total, 1.0) - budget) / budget)
    return min(max_step, gain * shortfall)


def request_span_s(slo: SloTargets, mix: tuple[float, float] | None) -> float:
    """How long a request of the mean mix (prompt, output tokens) may take within the SLO: its TTFT
    target and its output at the TPOT target (0 when no mix is measured yet). A request judged within
    a span of a step began before the step took effect."""
    if mix is None:
        return 0.0
    prompt, output = mix
    return slo.slo.ttft_target(max(1, int(prompt)), slo.calibration) + max(0.0, output) * slo.tpot_s


def measure_slo(
    state: SloState,
    counters_before: Sequence[PodCounter],
    snapshot: MetricsSnapshot,
    slo: SloTargets,
    now: float,
    load_per_replica: float | None,
    backlog: bool,
    b: Behavior,
) -> tuple[SloState, dict[str, PodLatency]]:
    """This sync's measurement recorded (record_interval), and the pods' latency counts at the SLO's
    targets (kept with their counters, for the next sync's difference)."""
    now_by_pod: dict[str, PodLatency] = {}
    for s in snapshot.samples:
        lat = pod_latency(s.ttft_buckets, s.itl_buckets, slo.ttft_s, slo.tpot_s)
        if lat is not None:
            now_by_pod[s.pod] = lat
    before = {c.pod: c.latency for c in counters_before if c.latency is not None}
    state = record_interval(
        state, now, snapshot.router_slo, now_by_pod, before, load_per_replica, b.attainment_window_s, backlog
    )
    return state, now_by_pod


def record_interval(
    state: SloState,
    now: float,
    router_counts: SloCounts | None,
    pods_now: Mapping[str, PodLatency],
    pods_before: Mapping[str, PodLatency],
    load_per_replica: float | None,
    window_s: float,
    backlog: bool = False,
) -> SloState:
    """The state after this sync's measurement: the routers' counters differenced (preferred), else
    the pods' histograms; intervals older than the window dropped."""
    dt = None if state.time is None else now - state.time
    fresh_baseline = dt is not None and 0.0 < dt <= MAX_INTERVAL_S
    counts: SloCounts | None = None
    source: str | None = None
    if router_counts is not None:
        source = SOURCE_ROUTER
        if fresh_baseline and state.router_counts is not None:
            counts = router_counts.since(state.router_counts)
    elif pods_now:
        source = SOURCE_PODS
        if fresh_baseline:
            counts = pods_interval_counts(pods_now, pods_before)
    intervals = tuple(i for i in state.intervals if now - i.time < window_s and i.time < now)
    if counts is not None and dt is not None:
        intervals = (*intervals, SloInterval(now, dt, counts, load_per_replica))
    measured = router_counts is not None or bool(pods_now)
    return replace(
        state,
        time=now if measured else state.time,
        router_counts=router_counts if router_counts is not None else state.router_counts,
        intervals=intervals,
        source=source or state.source,
        last_backlog=now if backlog else state.last_backlog,
    )


def evaluate(
    state: SloState,
    now: float,
    current: int,
    ready: int,
    settings: FeedbackSettings,
    model_capacity: float | None,
    settle_s: float,
    last_scale_up: float | None = None,
    surging: bool = False,
    span_s: float = 0.0,
    judged_capacity: float | None = None,
) -> Feedback:
    """Apply the three rules (module doc). `model_capacity`: requests/s per replica the replica model
    gives at the current token mix (None: the planner is not sizing yet, the factor is left alone);
    `settle_s`: how long a step takes to show (a startup); `last_scale_up`: when the fleet last grew
    for any reason (the intervals before its replicas could serve are not fresh either: their misses
    are the shortfall that scale-up answered). A backlog (requests waiting beyond the queue target)
    is answered by the queue rule: for a window after one, nothing here grows the fleet or corrects
    the capacity: a backlog's misses, also those judged after it drained, say the fleet was short
    for a while, not that the model is wrong. Nor while arrivals are surging (`surging`: the latest
    rate above the trend window's mean beyond noise): a surge's misses say the fleet was late.
    `span_s` (request_span_s): the capacity is learnt only from intervals that began a request span
    after the fresh window opened, whose requests the fleet as it is now served from start to end; the
    growth step does not wait for them. `judged_capacity`: the model's capacity at the mix of the
    requests judged (the finished ones), where the planner's mix (`model_capacity`'s) leads them:
    a load served at a lighter mix raises the floor only in proportion (None: the same mix)."""
    s = settings
    budget = 1.0 - s.target
    w = window(state.intervals, now, s.window_s)
    win, win_s, win_load = w.counts, w.seconds, w.load_per_replica
    since = state.fresh_since
    if last_scale_up is not None:
        since = max(since or 0.0, last_scale_up + settle_s)
    if state.last_backlog is not None:  # its queued requests finish (and are judged) for a while after
        since = max(since or 0.0, state.last_backlog + s.window_s)
    f = window(state.intervals, now, s.window_s, since=since)
    fresh = f.counts
    served = window(state.intervals, now, s.window_s, since=None if since is None else since + span_s)
    # The floor in the current mix's terms; a new value is written with the current mix as its own.
    floor0 = floor = floor_at_mix(state, model_capacity)
    ceiling = state.capacity_ceiling
    miss_load, miss_ceiling, miss_at = state.miss_load, state.miss_ceiling, state.miss_at
    if miss_at is not None and now - miss_at > s.miss_memory_s:
        miss_load = miss_ceiling = miss_at = None
    attainment = win.attainment
    src = state.source or "no source"
    where = f"({src}, {win_s:.0f}s, {win.total:.0f} requests)"
    rec: int | None = None
    fresh_since = state.fresh_since
    fresh_att = fresh.attainment
    recent_backlog = state.last_backlog is not None and now - state.last_backlog < s.window_s
    # Where the planner sizes now, and how close the window's load ran to it (within the tolerance and
    # one replica's share: a fleet of n cannot be sized finer).
    used = planner_capacity(state, model_capacity) if model_capacity else None
    band = s.tolerance + 1.0 / max(1, ready)
    at_capacity = used is not None and win_load is not None and win_load >= (1.0 - band) * used
    if (
        fresh_att is not None
        and fresh.total >= s.min_requests
        and fresh.missed >= MIN_MISSES
        and fresh.missed > budget * fresh.total + SIGNIFICANCE_Z * math.sqrt(budget * fresh.total)
        and ready > 0
    ):
        # The step (and the capacity cut below) is what the misses prove, not their point estimate:
        # a few misses in one short interval (often one burst of long prompts) ask for one replica
        # more, many misses for as much as their shortfall says.
        step = proven_step(fresh.missed, fresh.total, budget, s.gain, s.max_step)
        rec = max(current, math.ceil(ready * (1.0 + step) - 1e-9), ready + 1)
        # Missed at a load the planner thought within capacity: the model is optimistic there.
        # (Missed above it: the fleet was short of the planner's own size; nothing learnt.) Learnt
        # from the requests the fleet served whole (`served`): those that began before the last step
        # took effect were short of it (a cold start's queue, a burst before the step), which the
        # step answers; cutting the capacity for them cost a fleet 2-3x its need for half an hour.
        served_load = served.load_per_replica
        if (
            model_capacity
            and served_load is not None
            and served.counts.total >= s.min_requests
            and not recent_backlog
            and not surging
            and served_load <= planner_capacity(state, model_capacity) + 1e-9
        ):
            cut = proven_step(served.counts.missed, served.counts.total, budget, s.gain, s.max_step, CUT_Z)
            ceiling = served_load * (1.0 - cut)
            # Remembered (the probe stops at this load for miss_memory_s) unless the misses neither
            # prove a shortfall at CUT_Z nor agree with what was measured: an unproven miss below a
            # load the fleet served with headroom (the floor) may be noise or a heavier mix (more
            # misses would prove that, and be remembered); held there, 2 late of 50 at half the floor
            # kept a fleet at 182% of the fixed fleet's replica-hours for 30 minutes. It still sets
            # the ceiling (and the floor) at the load that missed; the probe may take it back.
            if cut > 0.0 or floor is None or served_load >= floor:
                miss_load, miss_ceiling, miss_at = served_load, ceiling, now
            if floor is not None and floor > ceiling:
                floor = ceiling  # proven at a lighter workload than now
        fresh_since = now + settle_s
        text = (
            f"measured attainment {fresh_att:.3f} < target {s.target:.3f} "
            f"({src}, {fresh.total:.0f} requests since the last step) -> {rec} (+{step:.0%})"
        )
        allow = False
    elif attainment is None:
        # No request judged in the window: with a source that reports, the fleet was idle (nothing to
        # lose); without one, unknown, and never read as perfect.
        allow = state.source is not None and state.time is not None and now - state.time < MAX_INTERVAL_S
        text = (
            f"attainment: no requests judged {where}" if allow else "attainment unknown (no SLO measurement)"
        )
    elif win.total < s.min_requests:
        allow = True
        text = f"attainment {attainment:.3f} {where}: too few requests to judge"
    else:
        allow = win.missed <= (1.0 - s.headroom) * budget * win.total + 1e-9
        text = f"attainment {attainment:.3f} {where}"
        if attainment >= s.target and allow and win_load is not None:
            # the load served, in the terms of the mix the planner sizes for (a lighter mix's load
            # proves less at a heavier one, as floor_at_mix scales the floor)
            served_now = win_load
            if model_capacity and judged_capacity and judged_capacity > model_capacity:
                served_now = win_load * model_capacity / judged_capacity
            floor = max(floor or 0.0, served_now)
            # Running as sized, with headroom: the binding bound is probed upward (a miss takes it
            # back), the ceiling toward the model, the floor beyond it.
            if used is not None and model_capacity and at_capacity:
                if floor0 is not None and used > model_capacity:
                    floor = max(floor, used * (1.0 + s.relax))
                elif ceiling is not None and used < model_capacity:
                    ceiling = min(model_capacity, ceiling * (1.0 + s.relax))
                    if miss_load is not None:  # not past a load that missed, while it is remembered
                        ceiling = min(ceiling, max(state.capacity_ceiling or 0.0, miss_load))
            if ceiling is not None:
                ceiling = max(ceiling, floor)
            if miss_load is not None and (
                floor >= miss_load or (miss_ceiling is not None and floor > miss_ceiling * (1.0 + s.relax))
            ):
                miss_load = miss_ceiling = miss_at = None  # served more than the cut left: proven since
        elif attainment < s.target:
            text += f" < target {s.target:.3f}, waiting {max(0.0, (fresh_since or now) - now):.0f}s for the last step"
            fresh_below = fresh_att is not None and fresh_att < s.target and fresh.total >= s.min_requests
            if used is not None and at_capacity and fresh_below and not recent_backlog and not surging:
                # Below target since the last step while running as sized, not yet significant:
                # the mirror of the probe, the capacity steps down by capacity_relax per sync.
                ceiling = used * (1.0 - s.relax)
                if floor is not None and floor > ceiling:
                    floor = ceiling
        else:
            text += " (no headroom)"
    moved = floor != floor0
    return Feedback(
        state=replace(
            state,
            capacity_floor=floor if moved else state.capacity_floor,
            floor_capacity=(model_capacity or None) if moved else state.floor_capacity,
            capacity_ceiling=ceiling,
            fresh_since=fresh_since,
            miss_load=miss_load,
            miss_ceiling=miss_ceiling,
            miss_at=miss_at,
        ),
        attainment=attainment,
        requests=win.total,
        window_s=win_s,
        recommendation=rec,
        allow_scale_down=allow,
        text=text,
    )
