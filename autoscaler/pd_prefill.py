"""The prefill role's signal: the prompt tokens arriving and waiting, over what one prefill replica
processes. Pure; pd_policy.decide_pd calls it (in the controller and in the simulator alike).

A prefill pod runs prompts only (docs/disaggregation.md): it is compute-bound whenever it is busy, so
its capacity is a token rate, not a KV or slot share. From the prefill pods' counters (the prompt
tokens and requests they finished: kvpilot_request_prompt_tokens_sum, else kvpilot_prompt_tokens_total,
and kvpilot_request_success_total, vLLM's names too; sources.PROMPT_TOKEN_METRICS) between two syncs:

- the **prompt token rate** arriving = tokens finished + the change of the tokens in flight (requests
  waiting or running x the mean prompt), per second; its trend is forecast one startup ahead as the
  aggregated policy forecasts request arrivals (arrivals.forecast_arrivals);
- the **per-replica throughput** (prompt tokens/s one prefill replica sustains) is learned from
  saturation: a pod backlogged at both syncs (SATURATED_IN_FLIGHT requests or more in flight) was busy
  all the interval, so what it finished is its capacity (smoothed); any pod that finished more than the
  estimate raises it. Until one is seen, the calibration's idle prefill rate at the mean prompt
  (slo.solo_prefill_s; pessimistic: it knows no prefix-cache hits) stands in, when spec.autoscaling.slo
  names a calibration; without either, the role scales on its queue alone;
- the **token backlog**: requests waiting at the prefill pods and those the router holds that still
  need a prefill pod (pd_signals.held_for_prefill: not the short prompts held in front of the decode
  pool), x the mean prompt;
- **from zero**: such a request the router holds, or a long prompt it served on a decode pod because no
  prefill pod was routable (kvpilot_router_pd_requests_total{path="no_prefill"}, pd_signals.py),
  wakes the role to one replica; its token rate sizes it from there.

Demand (replicas, fractional) = forecast token rate / (throughput x target utilization); the
recommendation adds the backlog drained within a startup (startup.backlog_replicas), else (no
startup known) within the TTFT target. TTFT misses measured by the router steer the role through the
closed loop in pd_policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvpilot.autoscaler.arrivals import MAX_COUNTER_AGE_S, PodCounter, RateSample, forecast_arrivals
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.feedback import SloState, planner_capacity
from kvpilot.autoscaler.policy import (
    Recommendation,
    ScaleEvent,
    scale_down_limit,
    scale_down_limit_text,
    scale_up_limit,
)
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.slo import solo_prefill_s
from kvpilot.autoscaler.spec import ScalingTargets
from kvpilot.autoscaler.startup import backlog_replicas, forecast_lead_s, scale_down_hold_s

DEFAULT_PREFILL_TARGET_UTILIZATION = 0.7  # share of its measured throughput a prefill replica is sized to use
SATURATED_IN_FLIGHT = 2  # requests in flight at both syncs: the pod was busy the whole interval
THROUGHPUT_SMOOTHING = 0.5  # weight of a new saturated measurement
MEAN_PROMPT_SMOOTHING = 0.3
RATE_LEVEL_S = 60.0  # the token rate's level: the mean of the rates measured over this long
_EPS = 1e-9


@dataclass(frozen=True)
class PrefillState:
    """What the prefill role's estimate remembers between syncs (status.autoscaler.disaggregation.prefill)."""

    time: float | None = None  # of the counters below
    counters: tuple[PodCounter, ...] = ()
    rates: tuple[RateSample, ...] = ()  # prompt tokens/s arriving, within the trend window
    throughput: float | None = None  # prompt tokens/s one prefill replica sustains (measured)
    mean_prompt: float | None = None  # prompt tokens per request (smoothed)
    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()


@dataclass(frozen=True)
class PrefillDecision:
    desired: int
    recommendation: int  # raw, before stabilization and rate limits
    demand: float | None  # replicas the forecast token rate needs at the target (fractional)
    signal: str
    text: str
    state: PrefillState
    token_rate: float | None = None
    throughput: float | None = None  # the per-replica rate used (measured, else the model's)
    backlog_tokens: float = 0.0


def model_throughput(cal: Calibration, mean_prompt: float) -> float:
    """Prompt tokens/s of one idle replica prefilling prompts of this length back to back."""
    n = max(1, round(mean_prompt))
    return n / solo_prefill_s(cal, n)


def measure(
    snapshot: MetricsSnapshot, prev: PrefillState, now: float
) -> tuple[float | None, float | None, float | None, tuple[PodCounter, ...]]:
    """(prompt tokens/s arriving, mean prompt, throughput, counters) since the last sync."""
    dt = None if prev.time is None else now - prev.time
    fresh = dt is not None and 0.0 < dt <= MAX_COUNTER_AGE_S
    before = {c.pod: c for c in prev.counters}
    done_tokens = done_requests = 0.0
    in_flight_change = 0
    known = False
    saturated: list[float] = []
    fastest = 0.0
    counters = []
    for s in snapshot.samples:
        in_flight = s.num_waiting + s.num_running
        counters.append(PodCounter(s.pod, s.completed_total, in_flight, s.prompt_tokens_total))
        if not fresh or s.prompt_tokens_total is None or dt is None:
            continue
        b = before.get(s.pod)
        if b is None:  # new since the last sync: everything it did and holds arrived in the interval
            tokens, reqs, b_in_flight = s.prompt_tokens_total, s.completed_total or 0.0, 0
        elif b.prompt_tokens is None or s.prompt_tokens_total < b.prompt_tokens:
            continue  # no baseline, or the process restarted
        else:
            tokens = s.prompt_tokens_total - b.prompt_tokens
            reqs = max(0.0, (s.completed_total or 0.0) - (b.completed or 0.0))
            b_in_flight = b.in_flight
            pod_rate = tokens / dt
            fastest = max(fastest, pod_rate)
            if b.in_flight >= SATURATED_IN_FLIGHT and in_flight >= SATURATED_IN_FLIGHT:
                saturated.append(pod_rate)
        known = True
        done_tokens += tokens
        done_requests += reqs
        in_flight_change += in_flight - b_in_flight
    mean = prev.mean_prompt
    if done_requests >= 1:
        m = done_tokens / done_requests
        mean = m if mean is None else MEAN_PROMPT_SMOOTHING * m + (1.0 - MEAN_PROMPT_SMOOTHING) * mean
    throughput = prev.throughput
    if saturated:
        sample = sum(saturated) / len(saturated)
        throughput = (
            sample
            if throughput is None
            else THROUGHPUT_SMOOTHING * sample + (1.0 - THROUGHPUT_SMOOTHING) * throughput
        )
    if throughput is not None and fastest > throughput:
        throughput = fastest  # a pod did that much: it can
    rate: float | None = None
    if known and dt is not None:
        rate = max(0.0, (done_tokens + in_flight_change * (mean or 0.0)) / dt)
    return rate, mean, throughput, tuple(counters)


def stabilize(
    raw: int,
    current: int,
    recs: tuple[Recommendation, ...],
    events: tuple[ScaleEvent, ...],
    now: float,
    targets: ScalingTargets,
    startup: float | None,
    remember: int | None = None,
) -> tuple[int, tuple[Recommendation, ...], tuple[ScaleEvent, ...], list[str]]:
    """policy.decide()'s stabilization windows and rate limits for one role's raw recommendation.
    `remember`: what the windows keep of this sync (default raw): a backlog's extra replicas are
    asked for now but not held for the scale-down window once it has drained."""
    b = targets.behavior
    notes: list[str] = []
    down_s = scale_down_hold_s(targets.scale_down_stabilization_s, startup)
    horizon = max(targets.history_horizon_s, down_s)
    past = [r for r in recs if now - r.time <= horizon and r.time < now]
    recs = (*past, Recommendation(now, raw if remember is None else remember))
    up = min([raw, *(r.replicas for r in past if now - r.time <= targets.scale_up_stabilization_s)])
    down = max([raw, *(r.replicas for r in recs if now - r.time <= down_s)])
    desired = up if up > current else (down if down < current else current)
    if raw < current and desired == current:
        notes.append(f"scale-down stabilization ({down_s:g}s) holds {current}")
    events = tuple(e for e in events if now - e.time < horizon and e.time <= now)
    if desired > current:
        limit = scale_up_limit(current, events, now, b.scale_up)
        if desired > limit:
            notes.append(f"scale-up limited to {limit}")
            desired = limit
    elif desired < current:
        limit = scale_down_limit(current, events, now, b.scale_down, desired, b.scale_down_surplus_share)
        if desired < limit:
            notes.append(scale_down_limit_text(limit, b.scale_down, b.scale_down_surplus_share))
            desired = limit
    return desired, recs, events, notes


def decide_prefill(
    current: int,
    snapshot: MetricsSnapshot,
    router_queue: int,
    targets: ScalingTargets,
    state: PrefillState,
    now: float,
    *,
    startup: float | None,
    calibration: Calibration | None,
    target_utilization: float,
    ttft_s: float,
    slo_state: SloState | None = None,
    direct_long: float = 0.0,
) -> PrefillDecision:
    """The prefill role's size from its own signals (module doc); `targets`: the role's limits and
    behavior; `router_queue`: requests the router holds for the model that need a prefill pod (a
    wake-up and backlog: pd_signals.held_for_prefill);
    `direct_long`: long prompts the router sent to a decode pod since the last sync for lack of a
    prefill pod (a wake-up: pd_signals.py)."""
    b = targets.behavior
    n, ready = snapshot.reporting, snapshot.ready_replicas
    lead = forecast_lead_s(b.arrival_lead_s, startup)
    rate, mean, measured, counters = measure(snapshot, state, now)
    rates = tuple(r for r in state.rates if now - b.arrival_trend_window_s < r.time < now)
    forecast = level = None
    if rate is not None:
        rates = (*rates, RateSample(now, rate))
        # A 15 s window holds a few dozen prompts of very different lengths: the level is the mean
        # over the last RATE_LEVEL_S, the trend the least-squares slope over the trend window.
        recent = [r.rate for r in rates if now - r.time < RATE_LEVEL_S]
        level = sum(recent) / len(recent)
        forecast = forecast_arrivals((*rates[:-1], RateSample(now, level)), now, lead, b.arrival_max_growth)
    per_prompt = mean if mean is not None else (calibration.max_num_batched_tokens if calibration else None)
    throughput, source = measured, "measured"
    if throughput is None and calibration is not None and per_prompt is not None:
        throughput, source = model_throughput(calibration, per_prompt), "model"
    waiting = sum(s.num_waiting for s in snapshot.samples) + router_queue
    backlog = waiting * (per_prompt or 0.0)
    demand: float | None = None
    steady: int | None = None  # the recommendation without the backlog
    notes: list[str] = []
    if current == 0:
        raw = 1 if router_queue or direct_long > 0 else 0
        if router_queue:
            signal, text = (
                "scale from zero",
                f"scale from zero: {router_queue} requests held by the router need a prefill pod",
            )
        elif raw:
            signal = "long prompts direct"
            text = f"scale from zero: {direct_long:.0f} long prompts served by decode pods for lack of a prefill pod"
        else:
            signal, text = "idle", "at zero, nothing held, no long prompt served direct"
    elif n == 0:
        raw, signal = current, "no metrics"
        text = f"no metrics from 0/{ready} ready prefill replicas" if ready else "no ready prefill replica"
    elif throughput and forecast is not None:
        modelled = throughput * target_utilization
        per_replica = planner_capacity(slo_state, modelled) if slo_state is not None else modelled
        demand = forecast / per_replica
        raw = math.ceil(demand - _EPS)
        signal = "token rate"
        steady = raw if abs(raw / current - 1.0) > b.tolerance else current
        if waiting:
            start = startup or 0.0
            q = backlog_replicas(backlog, forecast, per_replica, ready, start, drain_s=max(start, ttft_s))
            if q > raw:
                raw, signal = q, "token backlog"
        if abs(raw / current - 1.0) <= b.tolerance:
            raw = current
        text = (
            f"prompt tokens {level or 0.0:.0f}/s"
            + (f" (forecast {forecast:.0f}/s in {lead:g}s)" if forecast > (level or 0.0) + _EPS else "")
            + f", backlog {backlog:.0f} tokens ({waiting} waiting)"
            + f" at {throughput:.0f} tokens/s per replica ({source}, target {target_utilization:.0%}"
            + (f" -> {per_replica:.0f} within the measured bounds" if per_replica != modelled else "")
            + ")"
        )
    else:
        # No rate yet (the first sync) or no throughput known: the queue beyond the target.
        excess = waiting - targets.target_queue_depth * n
        raw = current + math.ceil(excess / targets.target_queue_depth - _EPS) if excess > 0 else current
        signal = "queue"
        text = (
            f"queue {waiting} waiting on {n}/{ready} prefill replicas (target {targets.target_queue_depth:g})"
        )
    if snapshot.missing and raw < current:
        raw = current
        notes.append(f"{snapshot.missing} not reporting, held")
    desired, recs, events, more = stabilize(
        raw, current, state.recommendations, state.events, now, targets, startup, steady
    )
    notes += more
    if desired != current:
        events = (*events, ScaleEvent(now, current, desired))
    new_state = replace(
        state,
        time=now if counters else state.time,
        counters=counters if counters else state.counters,
        rates=rates,
        throughput=measured,
        mean_prompt=mean,
        recommendations=recs,
        events=events,
    )
    if notes:
        text += "; " + "; ".join(notes)
    return PrefillDecision(
        desired=desired,
        recommendation=raw,
        demand=demand,
        signal=signal,
        text=text,
        state=new_state,
        token_rate=level,
        throughput=throughput,
        backlog_tokens=backlog,
    )
