"""The arrival-rate estimate: what the fleet's counters say about the requests arriving, their token mix
and the rate one replica sustains. Pure functions over MetricsSnapshots and the state remembered
between syncs (ArrivalState, kept in status.autoscaler.arrivals); policy.decide() calls them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.autoscaler.attainment import PodLatency
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample


@dataclass(frozen=True)
class PodCounter:
    """One replica at the previous sync: its completed-requests counter (None when its source gave a
    rate instead) and its requests in flight (waiting + running)."""

    pod: str
    completed: float | None
    in_flight: int
    prompt_tokens: float | None = None  # the replica's prompt / generated token counters
    generation_tokens: float | None = None
    # Its latency histograms at the SLO targets (attainment.PodLatency), for the fallback without a router.
    latency: PodLatency | None = None


@dataclass(frozen=True)
class RateSample:
    time: float
    rate: float  # requests/s arriving at the fleet


@dataclass(frozen=True)
class ArrivalState:
    """What the arrival-rate estimate remembers between syncs."""

    time: float | None = None  # of the counters below
    counters: tuple[PodCounter, ...] = ()
    rates: tuple[RateSample, ...] = ()  # within Behavior.arrival_trend_window_s
    service_rate: float | None = None  # requests/s one replica sustains at the target (smoothed)
    token_mix: tuple[float, float] | None = None  # (prompt, output) tokens per request (smoothed)
    # Finished requests behind token_mix (capped at TOKEN_MIX_WINDOW_REQUESTS); the planner waits for
    # MIN_MIX_REQUESTS. Not written to the status: a mix read back from it counts as established.
    mix_requests: float = 0.0
    # The surge headroom's memory (surge.py): the mean rate of every minute of Behavior.surge_window_s,
    # and when the rate last shifted level.
    levels: tuple[RateSample, ...] = ()
    shift_at: float | None = None


MAX_COUNTER_AGE_S = 300.0
# The service-rate estimate is only updated when replicas are at least this share of the target busy:
# at lower load, completions per replica are a few noisy requests and the extrapolation is long.
MIN_INFORMATIVE_LOAD = 0.25
SERVICE_RATE_SMOOTHING = 0.5  # weight of the new estimate


def measure_arrivals(
    snapshot: MetricsSnapshot, previous: ArrivalState, now: float
) -> tuple[float | None, float | None, tuple[PodCounter, ...]]:
    """(arrivals/s, completions/s per reporting replica, counters to remember) since the last sync.

    A replica's arrivals over the interval are the requests it finished (counter difference, or its
    reported completion rate x the interval) plus the change in its requests in flight. A replica
    not seen at the last sync started empty (it became Ready since), so its counter and in-flight
    count are all new; that is capped at the busiest known replica's arrivals, in case it was only
    missing from the last scrape. A counter that went down was reset (the process restarted).
    A replica without a counter (Prometheus has no rate for a series a few seconds old) is counted
    like a new one, with no completions. Ready replicas that did not report are assumed to get the
    average replica's share. None when no replica has a counter, there is no previous sync or it is
    too old, or no replica was seen both times.
    """
    samples = snapshot.samples
    have_any = any(s.completed_total is not None or s.completion_rate is not None for s in samples)
    counters = tuple(
        PodCounter(
            s.pod,
            s.completed_total,
            s.num_running + s.num_waiting,
            s.prompt_tokens_total,
            s.generation_tokens_total,
        )
        for s in samples
        if s.completion_rate is not None or s.completed_total is not None
    )
    t0 = previous.time
    if not have_any or t0 is None or not 0.0 < now - t0 <= MAX_COUNTER_AGE_S:
        return None, None, counters
    dt = now - t0
    before = {c.pod: c for c in previous.counters}
    known_arrivals: list[float] = []
    known_done: list[float] = []
    new_arrivals: list[float] = []
    for s in samples:
        in_flight = s.num_running + s.num_waiting
        prev = before.get(s.pod)
        if s.completion_rate is not None:
            done = max(0.0, s.completion_rate) * dt
        elif prev is not None and prev.completed is not None and s.completed_total is not None:
            diff = s.completed_total - prev.completed
            done = s.completed_total if diff < 0 else diff
        else:  # no counter, or none to difference it with: count it as a new replica
            prev, done = None, s.completed_total or 0.0
        if prev is None:
            new_arrivals.append(max(0.0, done + in_flight))
        else:
            known_arrivals.append(max(0.0, done + in_flight - prev.in_flight))
            known_done.append(done)
    if not known_arrivals:
        return None, None, counters
    cap = max(known_arrivals)
    total = sum(known_arrivals) + sum(min(a, cap) for a in new_arrivals)
    if snapshot.missing:
        total *= snapshot.ready_replicas / len(samples)
    return total / dt, sum(known_done) / dt / len(known_done), counters


# The token mix is a running mean over about this many finished requests: prompt lengths are
# heavy-tailed (Mooncake: 15k mean, up to 120k), so one sync's few dozen requests give a mean that
# swings by half, and the SLO planner's capacity (steeper still with the TPOT tail rule) with it.
TOKEN_MIX_WINDOW_REQUESTS = 200.0
# The planner sizes from the mix only once this many requests finished: the first ones to finish are
# the short ones (a 15 s window after a cold start sees outputs of ~10 tokens where the mean is 150), and
# sizing for them asked for 33 replicas where 5-10 serve Mooncake (docs/autoscaler.md).
MIN_MIX_REQUESTS = TOKEN_MIX_WINDOW_REQUESTS


def measure_token_mix(snapshot: MetricsSnapshot, previous: ArrivalState) -> tuple[float, float] | None:
    """(prompt, output) tokens per finished request since the last sync, from the replicas seen both
    times with completion and token counters; None when none finished a request (or a counter went
    down: a restart)."""
    totals = token_totals(snapshot, previous)
    if totals is None:
        return None
    done, prompt, output = totals
    return prompt / done, output / done


def smooth_token_mix(
    previous: tuple[float, float] | None, totals: tuple[float, float, float]
) -> tuple[float, float]:
    """The running token mix after `totals` = (requests, prompt tokens, output tokens) finished: the new
    requests weigh in as done / (done + TOKEN_MIX_WINDOW_REQUESTS), so the mix follows the last ~200
    requests whatever the sync interval and load."""
    done, prompt, output = totals
    mix = (prompt / done, output / done)
    if previous is None:
        return mix
    w = done / (done + TOKEN_MIX_WINDOW_REQUESTS)
    return (w * mix[0] + (1.0 - w) * previous[0], w * mix[1] + (1.0 - w) * previous[1])


def token_totals(snapshot: MetricsSnapshot, previous: ArrivalState) -> tuple[float, float, float] | None:
    """(requests finished, their prompt tokens, their output tokens) since the last sync; see
    measure_token_mix."""
    before = {c.pod: c for c in previous.counters}
    done = prompt = output = 0.0
    for s in snapshot.samples:
        prev = before.get(s.pod)
        if (
            prev is None
            or None in (prev.completed, prev.prompt_tokens, prev.generation_tokens)
            or None in (s.completed_total, s.prompt_tokens_total, s.generation_tokens_total)
        ):
            continue
        d = (s.completed_total or 0.0) - (prev.completed or 0.0)
        p = (s.prompt_tokens_total or 0.0) - (prev.prompt_tokens or 0.0)
        g = (s.generation_tokens_total or 0.0) - (prev.generation_tokens or 0.0)
        if d < 0 or p < 0 or g < 0:
            continue
        done, prompt, output = done + d, prompt + p, output + g
    if done <= 0:
        return None
    return done, prompt, output


# A rate differs from another, or a trend is real, when it is this many Poisson standard deviations
# away (the closed loop's significance level, feedback.SIGNIFICANCE_Z).
RATE_SIGNIFICANCE_Z = 2.0


def _spans(rates: tuple[RateSample, ...]) -> list[float]:
    """Seconds behind each sample: the gap since the one before (the first gets the second's)."""
    gaps = [max(1e-9, b.time - a.time) for a, b in itertools.pairwise(rates)]
    return [gaps[0], *gaps]


def _mean_and_noise(rates: tuple[RateSample, ...], spans: list[float]) -> tuple[float, float]:
    """The mean rate over `rates` (arrivals over their seconds) and the Poisson standard deviation of
    the latest sync's rate at that mean."""
    mean = sum(r.rate * s for r, s in zip(rates, spans, strict=True)) / sum(spans)
    return mean, math.sqrt(max(mean, 1e-12) / spans[-1])


def rate_surging(rates: tuple[RateSample, ...]) -> bool:
    """Whether the latest rate is above the mean over `rates` by more than the noise (a surge)."""
    if len(rates) < 2:
        return False
    mean, noise = _mean_and_noise(rates, _spans(rates))
    return rates[-1].rate - mean > RATE_SIGNIFICANCE_Z * noise


def forecast_arrivals(rates: tuple[RateSample, ...], now: float, lead_s: float, max_growth: float) -> float:
    """The arrival rate to plan for lead_s ahead: a level plus a rising trend times lead_s, at most
    max_growth x the latest rate.

    The level is the latest rate when it differs from the mean over `rates` (arrivals over their
    seconds) by more than RATE_SIGNIFICANCE_Z Poisson standard deviations of one sync's count (a
    real change), else that mean: a 15 s count of 60 requests is +-13% noise, and a fleet sized for
    the largest of such counts over the scale-down window runs ~25% above what the rate needs. The
    trend is the least-squares slope of `rates` (the latest included, last), counted only when it
    is rising by more than RATE_SIGNIFICANCE_Z of its standard error (a falling one would only speed
    up scale-down, which the down window is there to slow)."""
    latest = rates[-1].rate
    if len(rates) < 2:
        return latest
    spans = _spans(rates)
    mean, noise = _mean_and_noise(rates, spans)
    level = latest if abs(latest - mean) > RATE_SIGNIFICANCE_Z * noise else mean
    if lead_s <= 0:
        return level
    n = len(rates)
    mt = sum(r.time for r in rates) / n
    mr = sum(r.rate for r in rates) / n
    var = sum((r.time - mt) ** 2 for r in rates)
    if var <= 0:
        return level
    slope = sum((r.time - mt) * (r.rate - mr) for r in rates) / var
    typical = math.sqrt(max(mean, 1e-12) * n / sum(spans))  # sd of a sample's rate, typical span
    if slope <= RATE_SIGNIFICANCE_Z * typical / math.sqrt(var):
        slope = 0.0
    return min(level + slope * lead_s, latest * max_growth)


def batches_turned_over(samples: Sequence[ReplicaSample]) -> bool:
    """Whether the replicas have finished at least as many requests as they run now: only then are
    their completions a throughput. A cold start's first batch, full of long requests of which a
    few finished, is not (its completion rate is a fraction of what the replica sustains). True when
    the replicas do not export a completion counter (nothing to tell it by)."""
    counted = [s for s in samples if s.completed_total is not None]
    if not counted:
        return True
    return sum(s.completed_total or 0.0 for s in counted) >= sum(s.num_running for s in counted)


def service_rate_at_target(
    completions_per_replica: float, utilization: float, target: float, exponent_below: float
) -> float | None:
    """Requests/s one replica sustains at the target utilization, from what it does now.

    Above the target (queueing, a full batch) throughput is about proportional to utilization. Below
    it, utilization grows faster than load (as for Behavior.scale_down_exponent): load at the target
    is load now x (target / u) ** exponent_below (Behavior.arrival_service_exponent). None when the
    replicas are too idle to say.
    """
    if completions_per_replica <= 0 or utilization < MIN_INFORMATIVE_LOAD * target:
        return None
    ratio = target / utilization
    return completions_per_replica * ratio ** (1.0 if ratio < 1.0 else exponent_below)
