"""The scaling policy: a pure function from what the fleet reports to the replica count it should have.

decide(current, snapshot, targets, history, now) -> Decision(desired, reason, history)

(Slightly past 600 lines on purpose: the steps below are one decision, read in order; the arrival-rate
measurement, the closed loop and the simulator live in their own modules.)

No I/O, no clock, no randomness: the controller and the fleet simulator call the same function, and a
restarted controller continues from the history it wrote into the InferenceModel's status.

Steps, in order (HPA-like where the HPA has an answer):
1. Recommendations: utilization = ceil(reporting * avg_util / target_kv) (+ non-reporting replicas,
   held), where a replica's utilization is the larger of its KV use and its batch-slot use
   (running / max_num_seqs, when known); queue = the waiting requests beyond target_queue_per_replica,
   at the rate one replica absorbs them. Each is ignored inside the tolerance band.
   Arrival rate (Behavior.arrival_rate): the arrival rate (completions from a per-pod counter plus
   the change in waiting + running), forecast arrival_lead_s ahead with a rising linear trend, over
   the rate one replica sustains at the target (its completion rate now, scaled to the target).
   SLO planner (targets.slo, spec.autoscaling.slo), Dynamo's throughput-planner idea: the forecast
   arrival rate over what one replica serves within the TTFT/TPOT targets at the observed token
   mix (prompt tokens per request admitted where the pods count them, else per request finished,
   and output tokens per request finished, from per-pod counters; while requests queue, the last
   sync's admitted prompts where heavier: arrivals.backlog_mix), computed from the
   replica model (slo.replica_capacity), within the per-replica bounds the closed loop measured
   (feedback.planner_capacity); it replaces the completion-rate service estimate above.
   Startup-aware (startup.py; the startup measured from the pods, else declared): the forecast
   looks at least one startup ahead, the scale-down window is at least HOLD_STARTUPS startups, and
   for startups of STARTUP_AWARE_MIN_S or more the queue rule sizes the backlog expected one startup
   from now (startup.backlog_replicas) instead of the immediate "absorb" count.
   Surge headroom (surge.py): after a level shift of the arrival rate in the recent history, the
   replicas for a level the traffic held recently; a rising shift in progress forecasts
   arrival_max_growth x the latest rate at once.
   The raw recommendation is the largest: the KV and queue rules are the floor for surprises. A ready replica that did not report is never read as idle:
   with any replica missing, the raw recommendation is at least the current size.
2. Burst mode: KV saturated (>= 0.95) with requests waiting, or the queue growing fast, skips the
   scale-up window, asks burst_factor more (not while the closed loop measures the SLO met) and uses
   the larger burst rate limit.
3. Stabilization: scale up to the smallest recommendation in the up window (default 0 s, i.e. now),
   scale down to the largest recommendation in the down window (default 240 s); one sized for a
   backlog (the startup-aware queue rule) counts there only while requests still queue.
4. Rate limits over the events in the rule's period, like HPA behavior policies; a scale-down may
   also take Behavior.scale_down_surplus_share of the surplus over the size asked.
5. ScalingLimited (pods Unschedulable): never ask for more than we have.
6. Redundancy (redundancy.py): while the forecast load needs at least Behavior.redundancy_load of one
   replica, at least Behavior.redundancy_replicas (a floor, like minReplicas), held for the
   scale-down window after the load last needed it.
7. Clamp to [minReplicas, maxReplicas].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from kvpilot.api.slo import SloTargets as JudgeTargets
from kvpilot.autoscaler.arrivals import (
    MAX_COUNTER_AGE_S,
    MIN_INFORMATIVE_LOAD,
    MIN_MIX_REQUESTS,
    SERVICE_RATE_SMOOTHING,
    TOKEN_MIX_WINDOW_REQUESTS,
    ArrivalState,
    PodCounter,
    RateSample,
    admitted_prompt_totals,
    backlog_mix,
    batches_turned_over,
    forecast_arrivals,
    measure_arrivals,
    measure_token_mix,
    rate_surging,
    service_rate_at_target,
    smooth_mean,
    smooth_token_mix,
    token_totals,
)
from kvpilot.autoscaler.feedback import (
    Feedback,
    SloState,
    evaluate,
    feedback_settings,
    floor_at_mix,
    measure_slo,
    planner_capacity,
    request_span_s,
    served_load_limit,
)
from kvpilot.autoscaler.redundancy import Redundancy, held_redundancy, redundancy
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.slo import output_cdf_from_buckets, replicas_needed
from kvpilot.autoscaler.spec import ScalingRule, ScalingTargets
from kvpilot.autoscaler.startup import (
    STARTUP_AWARE_MIN_S,
    backlog_replicas,
    forecast_lead_s,
    scale_down_hold_s,
    startup_rise_limit,
)
from kvpilot.autoscaler.surge import level_shift, record_level, rising_shift, surge_hold

# The arrival-rate estimate lives in arrivals.py; its names are re-exported for the callers of decide().
__all__ = [
    "MAX_COUNTER_AGE_S",
    "MIN_INFORMATIVE_LOAD",
    "MIN_MIX_REQUESTS",
    "SERVICE_RATE_SMOOTHING",
    "TOKEN_MIX_WINDOW_REQUESTS",
    "ArrivalState",
    "Decision",
    "History",
    "PodCounter",
    "RateSample",
    "Recommendation",
    "ScaleEvent",
    "admitted_prompt_totals",
    "batches_turned_over",
    "decide",
    "forecast_arrivals",
    "measure_arrivals",
    "measure_token_mix",
    "scale_down_limit",
    "scale_down_limit_text",
    "scale_up_limit",
    "service_rate_at_target",
    "smooth_token_mix",
    "token_totals",
]

_EPS = 1e-9


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int
    backlog: bool = False  # sized by the startup-aware queue rule for a backlog (startup.backlog_replicas)


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True)
class History:
    """What the policy remembers between calls (bounded by targets.history_horizon_s)."""

    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()
    # (time, total waiting) at the previous sync with metrics, for the queue growth rate.
    last_queue: tuple[float, int] | None = None
    arrivals: ArrivalState = field(default_factory=ArrivalState)
    slo: SloState = field(
        default_factory=SloState
    )  # the closed loop's measurements and capacity correction (feedback.py)
    # When the redundancy floor last applied, and its size (held for the scale-down window;
    # status.autoscaler.redundancy).
    redundancy: tuple[float, Redundancy] | None = None


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    history: History
    current: int
    recommendation: int  # raw: after the missing-metrics hold, before stabilization and limits
    kv_recommendation: int | None = None
    queue_recommendation: int | None = None
    arrival_recommendation: int | None = None
    slo_recommendation: int | None = None
    surge_recommendation: int | None = None  # the surge headroom's hold (surge.py); None: not holding
    slo_capacity: float | None = None  # requests/s one replica serves within the SLO at token_mix
    token_mix: tuple[float, float] | None = None
    arrival_rate: float | None = None  # requests/s arriving, measured over the last sync interval
    arrival_forecast: float | None = None  # requests/s expected Behavior.arrival_lead_s ahead
    service_rate: float | None = None  # requests/s one replica sustains at the target
    startup_s: float | None = None  # replica startup the decision assumed (measured, else declared)
    # The closed loop (feedback.py): measured attainment over the window, the requests it judged, where
    # it came from, what it asked for, and the planner's capacity correction.
    attainment: float | None = None
    attainment_requests: float = 0.0
    attainment_window_s: float = 0.0
    attainment_source: str | None = None
    feedback_recommendation: int | None = None
    capacity_factor: float | None = None  # slo_capacity / the replica model's: the measured correction
    signal: str = ""  # the signal that set the size: named at the end of the reason's first clause
    # What requests are judged with (api/slo.judge), published in status.autoscaler.slo for the router.
    judge_targets: JudgeTargets | None = None
    attainment_target: float | None = None
    burst: bool = False
    avg_kv_cache_usage: float | None = None
    avg_utilization: float | None = None  # max(KV use, batch-slot use), averaged over reporting replicas
    total_waiting: int = 0
    reporting: int = 0
    ready: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def action(self) -> Literal["up", "down", "hold"]:
        if self.desired > self.current:
            return "up"
        if self.desired < self.current:
            return "down"
        return "hold"


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def _period_start(
    current: int, events: tuple[ScaleEvent, ...], now: float, period_s: float
) -> tuple[int, int]:
    """(replicas added, replicas removed) by events inside the last period_s."""
    added = removed = 0
    for e in events:
        if now - e.time < period_s:
            delta = e.to_replicas - e.from_replicas
            if delta > 0:
                added += delta
            else:
                removed -= delta
    return added, removed


def scale_up_limit(current: int, events: tuple[ScaleEvent, ...], now: float, rule: ScalingRule) -> int:
    """Largest size allowed now: max(start + pods, start * (1 + percent)) where start is the size at
    the beginning of the period (HPA's calculateScaleUpLimitWithScalingRules)."""
    added, removed = _period_start(current, events, now, rule.period_s)
    start = max(0, current - added + removed)
    return max(start + rule.pods, _ceil(start * (1.0 + rule.percent / 100.0)), current)


def scale_down_limit(
    current: int,
    events: tuple[ScaleEvent, ...],
    now: float,
    rule: ScalingRule,
    toward: int | None = None,
    surplus_share: float = 0.0,
) -> int:
    """Smallest size allowed now: min(start - pods, start * (1 - percent)) where start is the size at
    the beginning of the period, and, given the size the recommendations ask (`toward`), also
    start - floor(surplus_share x (start - toward)): a surplus comes down in proportion to its size
    (from 40 toward 11 at a half: 26, 19, 15, 13, 12, 11, one period each), and near the size asked by
    the rule's steps."""
    added, removed = _period_start(current, events, now, rule.period_s)
    start = current + removed - added
    proposed = min(start - rule.pods, math.floor(start * (1.0 - rule.percent / 100.0) + _EPS))
    if toward is not None and toward < start:
        proposed = min(proposed, start - math.floor(surplus_share * (start - toward) + _EPS))
    return min(max(0, proposed), current)


def scale_down_limit_text(limit: int, rule: ScalingRule, surplus_share: float) -> str:
    """The reason's words for a scale-down that `scale_down_limit` held at `limit`."""
    surplus = "" if not surplus_share else f" or {surplus_share:.0%} of the surplus"
    return f"scale-down limited to {limit} (max -{rule.pods} or {rule.percent:g}% per {rule.period_s:g}s{surplus})"


def _kv_text(avg: float, target: float, tol: float) -> str:
    ratio = avg / target
    rel = "~" if abs(ratio - 1.0) <= tol else (">" if ratio > 1.0 else "<")
    return f"kv {avg:.2f} {rel} target {target:.2f}"


# Counters older than this are not differenced (an autoscaler that was down for a while starts over).


def _forecast_text(forecast: float, arrival_rate: float | None, lead: float, rising: bool) -> str:
    """The forecast's part of a reason, when it differs from the rate measured."""
    if abs(forecast - (arrival_rate or 0.0)) <= _EPS:
        return ""
    return (
        f" (rising shift: forecast {forecast:.2f}/s)"
        if rising
        else f" (forecast {forecast:.2f}/s in {lead:g}s)"
    )


def decide(
    current: int,
    snapshot: MetricsSnapshot,
    targets: ScalingTargets,
    history: History,
    now: float,
) -> Decision:
    """Desired replica count, a human reason, and the history to pass to the next call."""
    b = targets.behavior
    tol = b.tolerance
    n = snapshot.reporting
    ready = snapshot.ready_replicas
    missing = snapshot.missing
    waiting = snapshot.total_waiting
    avg_kv = snapshot.avg_kv_cache_usage
    # A replica is as full as its scarcest capacity: KV blocks, or batch slots (max_num_seqs) when
    # requests are short. Both are held to the same target.
    slots = targets.max_num_seqs
    avg_slots = sum(min(1.0, s.num_running / slots) for s in snapshot.samples) / n if slots and n else None
    avg_util = None if avg_kv is None else max(avg_kv, avg_slots or 0.0)
    notes: list[str] = []
    # Replica startup (pod created -> Ready): measured from the pods, else declared; None: unknown.
    startup = snapshot.startup_s if snapshot.startup_s is not None else targets.startup_s
    lead = forecast_lead_s(b.arrival_lead_s, startup)

    kv_rec: int | None = None
    queue_rec: int | None = None
    q_startup = ""
    arrival_rec: int | None = None
    slo_rec: int | None = None
    surge_rec: int | None = None
    spare: Redundancy | None = None
    slo_capacity: float | None = None
    model_capacity: float | None = None
    burst = False
    surge_rising = False  # the forecast planned for a rising level shift (surge.rising_shift)
    # The arrival rate is measured (and remembered) whether or not it drives the size.
    arrivals = history.arrivals
    arrival_rate, forecast, service_rate = None, None, arrivals.service_rate
    admitted: tuple[float, float] | None = None  # generations and prompt tokens admitted since the last sync
    if n > 0:
        arrival_rate, per_replica_done, counters = measure_arrivals(snapshot, arrivals, now)
        rates = tuple(r for r in arrivals.rates if now - b.arrival_trend_window_s < r.time < now)
        levels, shift_at = arrivals.levels, arrivals.shift_at
        if arrival_rate is not None:
            rates = (*rates, RateSample(now, arrival_rate))
            forecast = forecast_arrivals(rates, now, lead, b.arrival_max_growth)
            if b.surge_headroom:
                levels = record_level(levels, rates, now, b.surge_window_s)
                if level_shift(rates, startup, b.surge_shift_ratio):
                    shift_at = now
                if rising_shift(rates, b.surge_shift_ratio):
                    rising = b.arrival_max_growth * arrival_rate
                    if rising > forecast:
                        forecast, surge_rising = rising, True
        carried = per_replica_done
        below_target = (
            arrival_rate is not None
            and n > 0
            and avg_util is not None
            and avg_util < targets.target_kv_cache_utilization
            and waiting <= targets.target_queue_depth * n
        )
        if below_target and arrival_rate is not None:
            # Below the target with no queue beyond it, the replicas take every arrival, and their
            # completions lag the arrivals while long requests fill the batches (a cold start: 0.09/s
            # finished where 0.67/s arrived, and 23 replicas asked where 3 serve). At or above the
            # target the completions are the throughput once the batches turned over (below).
            carried = max(per_replica_done or 0.0, arrival_rate / n)
        if carried is not None and avg_util is not None:
            estimate = service_rate_at_target(
                carried, avg_util, targets.target_kv_cache_utilization, b.arrival_service_exponent
            )
            # At or above the target the completions are the throughput only once the batches
            # turned over (batches_turned_over); before, they lag: one replica full of 12k-token
            # prompts finished 0.19/s where it sustains 0.55/s, and 22 replicas were asked where 7
            # serve (the fleet simulator's battery, seed 46).
            if estimate is not None and (below_target or batches_turned_over(snapshot.samples)):
                service_rate = (
                    estimate
                    if service_rate is None
                    else SERVICE_RATE_SMOOTHING * estimate + (1.0 - SERVICE_RATE_SMOOTHING) * service_rate
                )
        token_mix, mix_requests = arrivals.token_mix, arrivals.mix_requests
        judged_prompt = arrivals.judged_prompt
        if targets.slo is not None:
            totals = token_totals(snapshot, arrivals)
            if totals is not None:
                before = judged_prompt
                if before is None and token_mix is not None:
                    before = token_mix[0]
                judged_prompt = smooth_mean(before, totals[0], totals[1])
            admitted = admitted_prompt_totals(snapshot, arrivals)
            token_mix = smooth_token_mix(token_mix, totals, admitted)
            if totals is not None:
                mix_requests = min(TOKEN_MIX_WINDOW_REQUESTS, mix_requests + totals[0])
        arrivals = ArrivalState(
            now if counters else None,
            counters,
            rates,
            service_rate,
            token_mix,
            mix_requests,
            judged_prompt,
            levels=levels,
            shift_at=shift_at,
            router_queue=snapshot.router_queue if counters else None,
        )
    loop = targets.slo if targets.slo is not None and b.slo_feedback else None
    slo_state = history.slo
    if loop is not None:
        load = arrival_rate / ready if arrival_rate is not None and ready > 0 else None
        backlog = snapshot.total_waiting > targets.target_queue_depth * max(1, n)
        slo_state, latency = measure_slo(
            history.slo, history.arrivals.counters, snapshot, loop, now, load, backlog, b
        )
        if n > 0:  # the counters were just taken: they carry the pods' histograms too
            arrivals = replace(
                arrivals, counters=tuple(replace(c, latency=latency.get(c.pod)) for c in arrivals.counters)
            )
    fb: Feedback | None = None
    fb_in_driver = False
    signal = ""
    if current == 0 and snapshot.router_queue:
        # Scale from zero: nothing runs, so nothing reports; the router holding requests is the signal.
        raw = 1
        signal = "scale from zero"
        driver = f"scale from zero: {snapshot.router_queue} requests held by the router"
    elif n == 0 or avg_kv is None or avg_util is None:
        raw = current
        signal = "no metrics"
        driver = f"no metrics from 0/{ready} ready replicas" if ready else "no ready replica reports metrics"
    else:
        target_kv = targets.target_kv_cache_utilization

        def utilization_rec(util: float) -> int:
            ratio = util / target_kv
            if abs(ratio - 1.0) <= tol:
                return current
            # Below target, utilization is convex in load (in-flight = arrivals x latency, and a
            # fuller batch is slower), so n * u / target removes too many replicas; a replica's
            # utilization is taken to grow as load ** (1 / exponent) instead.
            exponent = 1.0 if ratio > 1.0 else b.scale_down_exponent
            rec = _ceil(n * ratio**exponent) + missing
            # Starting pods (current - ready) neither report nor get read as idle: KV above target
            # never asks for fewer replicas, KV below target never asks for more.
            return max(rec, current) if ratio > 1.0 else min(rec, current)

        kv_rec = utilization_rec(avg_util)
        # A replica takes about as many requests as fit under the KV target (target / KV per running
        # request), far more than targetQueueDepth. "absorb" (default): the queue beyond the target
        # asks for one more replica per that many requests, and replicas already starting count as
        # absorbing theirs. "average" is the plain HPA AverageValue form, ceil(waiting / target); it
        # overshoots several-fold in bursts (docs/autoscaler.md) and is kept for comparison.
        starting = max(0, current - ready)
        running = sum(s.num_running for s in snapshot.samples)
        kv_per_request = n * avg_kv / running if running and avg_kv > 0 else 0.0
        # No KV in use: the queue is not KV-bound, so a new replica is taken to absorb a lot (and
        # the recommendation stays monotone in load). Capped to keep the arithmetic finite.
        per_request_cap = 1e6
        absorb = per_request_cap
        if kv_per_request * per_request_cap > targets.target_kv_cache_utilization:
            absorb = targets.target_kv_cache_utilization / kv_per_request
        if slots:  # nor more than its batch slots at the target
            absorb = min(absorb, targets.target_kv_cache_utilization * slots)
        absorb = max(targets.target_queue_depth, absorb)
        if b.queue_recommendation == "average":
            queue_rec = _ceil(waiting / targets.target_queue_depth)
        else:
            if b.queue_recommendation == "least-loaded":
                # Round-robin gives every replica the same share of arrivals, so the least-loaded
                # replica's queue is what that share does to a replica: the fleet is short of capacity
                # only when even it queues. A backlog stranded on replicas that were Ready when a burst
                # began is left out: new replicas never take it (it drains where it is), and counting
                # it asked for 40 replicas where 13 sufficed (docs/autoscaler.md).
                least = min(s.num_waiting for s in snapshot.samples)
                # requests the router holds wait for a free slot anywhere: all of them count
                excess = n * (least - targets.target_queue_depth) + (snapshot.router_queue or 0)
            else:
                excess = waiting - targets.target_queue_depth * n
            queue_rec = current + _ceil((excess - starting * absorb) / absorb) if excess > 0 else 0
            queue_rec = max(0, queue_rec)
        planner_on = (
            targets.slo is not None
            and forecast is not None
            and arrivals.token_mix is not None
            and arrivals.mix_requests >= MIN_MIX_REQUESTS
        )
        planner = targets.slo
        tail_text = ""
        if planner is not None and planner.tpot_tail_budget is not None:
            # The TPOT tail rule's output lengths: configured, else measured from the replicas'
            # output-length histograms, else (slo.output_share_at_most) geometric at the mean.
            source = "configured"
            if planner.output_cdf is None:
                measured = output_cdf_from_buckets(snapshot.output_tokens_buckets)
                source = "geometric"
                if measured is not None:
                    planner = replace(planner, output_cdf=measured)
                    source = "measured"
            tail_text = f", TPOT tail within {planner.tpot_tail_budget:.1%} ({source} output lengths)"
        model_capacity = judged_capacity = None
        if planner_on and planner is not None and arrivals.token_mix is not None:
            queued = waiting > targets.target_queue_depth * n
            model_capacity = planner.capacity(*backlog_mix(arrivals.token_mix, admitted, queued))
            if arrivals.judged_prompt is not None:
                judged_capacity = planner.capacity(arrivals.judged_prompt, arrivals.token_mix[1])
        if loop is not None:
            settle = startup if startup is not None else b.arrival_lead_s
            last_up = max((e.time for e in history.events if e.to_replicas > e.from_replicas), default=None)
            fb = evaluate(
                slo_state,
                now,
                current,
                ready,
                feedback_settings(loop, b),
                model_capacity,
                settle,
                last_up,
                surging=rate_surging(arrivals.rates),
                span_s=request_span_s(loop, arrivals.token_mix),
                judged_capacity=judged_capacity,
            )
            slo_state = fb.state
        if model_capacity is not None:
            # The replica model's capacity, within the bounds replicas were measured to sustain.
            slo_capacity = model_capacity if loop is None else planner_capacity(slo_state, model_capacity)
        # Startup-aware queue rule: with the startup known and a per-replica rate (the planner's
        # capacity, else the measured service rate at the target), size for the forecast rate plus
        # the backlog expected when the pods asked for now are Ready, drained within DRAIN_STARTUPS
        # startups more (startup.backlog_replicas). Replicas already starting are part of that count.
        per_replica = slo_capacity if slo_capacity else (service_rate if b.arrival_rate else None)
        q_startup = ""
        if (
            startup is not None
            and startup >= STARTUP_AWARE_MIN_S
            and forecast is not None
            and per_replica
            and b.queue_recommendation == "absorb"
        ):
            excess = waiting - targets.target_queue_depth * n
            if excess > 0:
                cap = max(current, targets.max_replicas)
                # While requests queue, the measured rate reads low (a full queue rejects, and
                # completions are capped by the Ready replicas): the highest rate in the trend
                # window is the floor.
                rate = max(forecast, *(r.rate for r in arrivals.rates))
                queue_rec = min(cap, backlog_replicas(waiting, rate, per_replica, ready, startup))
                q_startup = f" over a {startup:g}s startup"
            else:
                queue_rec = 0
        if current > 0 and abs(queue_rec / current - 1.0) <= tol:
            queue_rec = current
        if q_startup and kv_rec > max(current, queue_rec):
            # A batch full of the backlog reads as high utilization at any fleet size, and the
            # backlog is sized above: the utilization rule counts only what the backlog leaves,
            # the utilization less the excess queue's share of the fleet at the target (a
            # replica holds `absorb` requests there). A queue far smaller than the batches leaves
            # the utilization whole: full batches then come from the arrivals (the replica model
            # sizing the queue rule may be optimistic, and the utilization is what says so).
            backlog_util = target_kv * max(0, waiting - targets.target_queue_depth * n) / (absorb * n)
            net_rec = utilization_rec(max(0.0, avg_util - backlog_util))
            if net_rec < kv_rec:
                notes.append(
                    f"utilization ({kv_rec}) less the backlog's {backlog_util:.2f} -> "
                    f"{max(current, net_rec)} while it drains"
                )
                kv_rec = max(current, net_rec)
        raw = max(kv_rec, queue_rec)
        a_part = ""
        if (
            planner_on
            and targets.slo is not None
            and slo_capacity is not None
            and forecast is not None
            and arrivals.token_mix is not None
        ):
            mix = arrivals.token_mix
            cap = max(current, targets.max_replicas)
            slo_rec = min(cap, replicas_needed(forecast, slo_capacity))
            if current > 0 and abs(slo_rec / current - 1.0) <= tol:
                slo_rec = current
            a_part = f"slo planner: arrivals {arrival_rate or 0.0:.2f}/s"
            a_part += _forecast_text(forecast, arrival_rate, lead, surge_rising)
            a_part += (
                f" of {mix[0]:.0f}+{mix[1]:.0f} tokens at {slo_capacity:.2f}/s per replica within "
                f"TTFT {targets.slo.ttft_s:g}s, TPOT {targets.slo.tpot_s:g}s{tail_text}"
            )
            if model_capacity is not None and abs(slo_capacity - model_capacity) > _EPS:
                bound = "floor" if slo_capacity > model_capacity else "ceiling"
                a_part += f" (model {model_capacity:.2f}/s, measured {bound})"
            arrival_rec = slo_rec
            if slo_rec > raw:
                raw = slo_rec
        elif b.arrival_rate and forecast is not None and service_rate:
            # Capped: a saturated fleet finishing almost nothing gives a tiny service rate.
            cap = max(current, targets.max_replicas)
            arrival_rec = _ceil(min(float(cap), forecast * b.arrival_headroom / service_rate))
            if current > 0 and abs(arrival_rec / current - 1.0) <= tol:
                arrival_rec = current
            a_part = f"arrivals {arrival_rate:.2f}/s"
            a_part += _forecast_text(forecast, arrival_rate, lead, surge_rising)
            a_part += f" at {service_rate:.2f}/s per replica"
            if arrival_rec > raw:
                raw = arrival_rec
        # Surge headroom (surge.py): after a level shift, the replicas for a level held recently.
        hold = (
            surge_hold(
                arrivals.levels, arrivals.shift_at, now, per_replica, b.surge_window_s, b.surge_quantile
            )
            if b.surge_headroom
            else None
        )
        h_part = ""
        if hold is not None:
            surge_rec = min(max(current, targets.max_replicas), hold.replicas)
            if surge_rec > raw:
                raw = surge_rec
                h_part = hold.text(now, b.surge_window_s, b.surge_quantile)
        spare = redundancy(
            forecast, per_replica, b.redundancy_replicas, b.redundancy_load, targets.max_replicas
        )
        kv_part = _kv_text(avg_kv, target_kv, tol)
        if avg_slots is not None and avg_slots > avg_kv:
            kv_part = f"kv {avg_kv:.2f}, " + _kv_text(avg_slots, target_kv, tol).replace("kv", "slots", 1)
        q_part = (
            f"queue {waiting} waiting ({waiting / n:.1f}/replica, target {targets.target_queue_depth:g})"
            + q_startup
        )
        if queue_rec > kv_rec:
            driver = f"{q_part}, {kv_part}"
        else:
            driver = f"{kv_part}, {q_part}" if waiting else kv_part
        driver += f" on {n}/{ready} replicas"
        if a_part:
            driver = (
                f"{a_part}, {driver}"
                if arrival_rec == raw and raw > max(kv_rec, queue_rec)
                else f"{driver}, {a_part}"
            )
        signal = _winner(raw, kv_rec, queue_rec, arrival_rec, targets.slo is not None and planner_on)
        if h_part:
            signal = "surge headroom"
            driver = f"{h_part}; {driver}"
        elif surge_rising and signal in ("slo planner", "arrivals") and arrival_rec is not None:
            signal = f"{signal} (rising shift)"
        # The measured attainment wins when it asks for the most, on a tie, and when the planner asks
        # for more only because of the capacity ceiling this miss measured (the miss set the size).
        measured_ceiling = (
            signal == "slo planner"
            and model_capacity is not None
            and slo_capacity is not None
            and slo_capacity < model_capacity
        )
        if (
            fb is not None
            and fb.recommendation is not None
            and (fb.recommendation >= raw or measured_ceiling)
        ):
            raw = max(raw, fb.recommendation)
            signal = "measured attainment"
            driver = f"{fb.text}; {driver}"
            fb_in_driver = True
        if missing:
            driver += f" ({missing} not reporting, held)"
            if current > raw:
                raw, signal = current, "replicas not reporting"

        # Burst: saturated and queueing, or the queue growing fast. Only matters when scaling up.
        burst_note = ""
        if waiting > 0 and avg_util >= b.burst_kv_threshold:
            what = "kv" if avg_util == avg_kv else "slots"
            burst_note = f"burst: {what} {avg_util:.2f} >= {b.burst_kv_threshold:.2f} with {waiting} waiting"
        elif history.last_queue is not None and now > history.last_queue[0]:
            t0, w0 = history.last_queue
            growth = (waiting - w0) / (now - t0) / n
            if growth >= b.burst_queue_growth_per_replica_s and waiting > targets.target_queue_depth * n:
                burst_note = f"burst: queue growing {growth:.2f}/s/replica"
        if burst_note and raw > current:
            burst = True
            notes.append(burst_note)
            # The startup-aware queue rule already sized for the backlog a startup from now: no
            # extra factor on top (it asked 14 where 9 were enough on flash_crowd x8).
            # Nor while the closed loop measures the SLO met: the queue rule's own size is asked,
            # and a miss (or the next sync's queue) asks for more.
            met = (
                loop is not None
                and fb is not None
                and fb.recommendation is None
                and fb.attainment is not None
                and fb.attainment >= loop.attainment_target
            )
            if not q_startup and not met:
                raw = max(raw, _ceil(raw * b.burst_factor))
            elif met:
                notes.append("no burst factor: attainment met")

    # Stabilization windows (the new recommendation included).
    down_s = scale_down_hold_s(targets.scale_down_stabilization_s, startup)
    horizon = max(targets.history_horizon_s, down_s)
    recs = tuple(r for r in history.recommendations if now - r.time <= horizon and r.time <= now)
    backlog_sized = bool(q_startup) and queue_rec is not None and queue_rec >= raw
    recs = (*recs, Recommendation(now, raw, backlog_sized))
    up_window = [r.replicas for r in recs if now - r.time <= targets.scale_up_stabilization_s]
    # A size asked for a backlog holds the scale-down window only while requests still queue beyond
    # the target: once the backlog drained, the replicas it asked for are not what the load needs.
    drained = waiting <= targets.target_queue_depth * max(1, n)
    down_window = [r.replicas for r in recs if now - r.time <= down_s and not (r.backlog and drained)]
    up_candidate = raw if burst else min(up_window)
    down_candidate = max(down_window)
    if up_candidate > current:
        stabilized = up_candidate
        if stabilized < raw:
            notes.append(f"scale-up stabilization ({targets.scale_up_stabilization_s:g}s) -> {stabilized}")
    elif down_candidate < current:
        stabilized = down_candidate
        if stabilized > raw:
            notes.append(f"scale-down stabilization ({down_s:g}s) -> {stabilized}")
    else:
        stabilized = current
        if raw < current:
            notes.append(f"scale-down stabilization ({down_s:g}s) holds {current}")
        elif raw > current:
            notes.append(f"scale-up stabilization ({targets.scale_up_stabilization_s:g}s) holds {current}")

    # Rate limits.
    events = tuple(e for e in history.events if now - e.time < horizon and e.time <= now)
    desired = stabilized
    if desired > current:
        rule = b.burst_scale_up if burst else b.scale_up
        limit = scale_up_limit(current, events, now, rule)
        if desired > limit:
            notes.append(
                f"scale-up limited to {limit} (max +{rule.pods} or {rule.percent:g}% per {rule.period_s:g}s)"
            )
            desired = limit
    elif desired < current:
        rule = b.scale_down
        limit = scale_down_limit(current, events, now, rule, desired, b.scale_down_surplus_share)
        if desired < limit:
            notes.append(scale_down_limit_text(limit, rule, b.scale_down_surplus_share))
            desired = limit

    fb_noted = fb is None or fb_in_driver  # the feedback's text is in the reason
    if desired < current and fb is not None and not fb.allow_scale_down:
        unknown = fb.attainment is None
        extra = "" if unknown else " (scale down only with attainment headroom)"
        notes.append(f"scale-down held: {fb.text}{extra}")
        desired, fb_noted = current, True
        signal = "attainment unknown" if unknown else "attainment headroom"
    elif desired < current and loop is not None and fb is None:
        notes.append("scale-down held: attainment unknown (no SLO measurement)")
        desired = current
        signal = "attainment unknown"
    # A scale-down sized at the larger of the forecast and the latest rate, stopped short of loads never
    # served on time and, at a long startup, of no room for the rate to rise.
    down_rate = None if forecast is None else max(forecast, arrival_rate or 0.0)
    if fb is not None:
        desired, held = served_load_limit(
            desired, current, down_rate, floor_at_mix(slo_state, model_capacity)
        )
        if held is not None:
            notes.append(held)
            signal = "served load"
    if slo_capacity is not None:
        desired, short = startup_rise_limit(desired, current, down_rate, slo_capacity, startup)
        if short is not None:
            notes.append(short)
            signal = "startup rise"

    if snapshot.scaling_limited and desired > current:
        notes.append(f"ScalingLimited (pods unschedulable): holding {current} instead of {desired}")
        desired = current

    floor_mark = history.redundancy if spare is None else (now, spare)
    if spare is None and n > 0:
        spare = held_redundancy(history.redundancy, now, down_s)
    if spare is not None and desired < spare.replicas and not snapshot.scaling_limited:
        # A floor while the model is busy, as minReplicas is one always (redundancy.py).
        notes.append(f"{spare.text()}: held at {spare.replicas}, not {desired}")
        desired, signal = spare.replicas, "redundancy"

    clamped = min(max(desired, targets.min_replicas), targets.max_replicas)
    if clamped != desired:
        bound = "minReplicas" if clamped > desired else "maxReplicas"
        notes.append(f"clamped to {bound} {clamped}")
        desired = clamped

    if desired != current:
        events = (*events, ScaleEvent(now, current, desired))
    last_queue = (now, waiting) if n > 0 else None
    new_history = History(
        recommendations=recs,
        events=events,
        last_queue=last_queue,
        arrivals=arrivals,
        slo=slo_state,
        redundancy=floor_mark,
    )

    verb = "hold" if desired == current else ("up" if desired > current else "down")
    reason = f"{driver} -> {desired}" if desired != current else f"{driver} -> {desired} ({verb})"
    if signal:
        reason += f" [signal: {signal}]"
    if fb is not None and not fb_noted:
        notes.append(fb.text)
    if notes:
        reason += "; " + "; ".join(notes)
    return Decision(
        desired=desired,
        reason=reason,
        history=new_history,
        current=current,
        recommendation=raw,
        kv_recommendation=kv_rec,
        queue_recommendation=queue_rec,
        arrival_recommendation=arrival_rec,
        slo_recommendation=slo_rec,
        surge_recommendation=surge_rec,
        slo_capacity=slo_capacity,
        token_mix=arrivals.token_mix,
        arrival_rate=arrival_rate,
        arrival_forecast=forecast,
        service_rate=service_rate,
        startup_s=startup,
        burst=burst,
        avg_kv_cache_usage=avg_kv,
        avg_utilization=avg_util,
        total_waiting=waiting,
        reporting=n,
        ready=ready,
        notes=tuple(notes),
        attainment=None if fb is None else fb.attainment,
        attainment_requests=0.0 if fb is None else fb.requests,
        attainment_window_s=0.0 if fb is None else fb.window_s,
        attainment_source=slo_state.source if loop is not None else None,
        feedback_recommendation=None if fb is None else fb.recommendation,
        capacity_factor=(
            slo_capacity / model_capacity
            if loop is not None and slo_capacity is not None and model_capacity
            else None
        ),
        signal=signal,
        judge_targets=None if targets.slo is None else targets.slo.slo.judge_targets(targets.slo.calibration),
        attainment_target=None if targets.slo is None else targets.slo.attainment_target,
    )


def _winner(
    raw: int, kv_rec: int | None, queue_rec: int | None, arrival_rec: int | None, planner: bool
) -> str:
    """The signal whose recommendation is the raw one (the first, in this order, on a tie)."""
    for name, rec in (
        ("slo planner" if planner else "arrivals", arrival_rec),
        ("queue", queue_rec),
        ("utilization", kv_rec),
    ):
        if rec is not None and rec == raw:
            return name
    return "utilization"
