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
    finished_lengths: float | None = None  # the length histograms' count (ReplicaSample)
    admitted: float | None = None  # its admitted-prompt histogram's count and sum (ReplicaSample)
    admitted_prompt_tokens: float | None = None
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
    # The finished requests' prompt tokens per request (smoothed like token_mix): the mix of the requests
    # the closed loop judges, which token_mix's prompt side (the prompts admitted) leads when it
    # shifts. None: the same as token_mix's (no replica counts admissions, or just read back from the
    # status, which does not keep it).
    judged_prompt: float | None = None
    # The surge headroom's memory (surge.py): the mean rate of every minute of Behavior.surge_window_s,
    # and when the rate last shifted level.
    levels: tuple[RateSample, ...] = ()
    shift_at: float | None = None
    # The router's central queue for the model at the time of `counters` (MetricsSnapshot.router_queue):
    # requests it holds arrived as surely as those on the pods. None: no router reported it.
    router_queue: int | None = None


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
            s.finished_lengths_total,
            s.admitted_total,
            s.admitted_prompt_tokens_total,
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
    # The router's queue: its growth arrived; what it handed to the pods since is in their in flight,
    # new replicas' too (their count past the cap is the queue's drain, not a missed replica's).
    held = 0.0
    drained = 0.0
    if snapshot.router_queue is not None and previous.router_queue is not None:
        held = float(snapshot.router_queue - previous.router_queue)
        drained = max(0.0, -held)
    new = min(sum(new_arrivals), sum(min(a, cap) for a in new_arrivals) + drained)
    total = sum(known_arrivals) + new
    if snapshot.missing:
        total *= snapshot.ready_replicas / len(samples)
    total = max(0.0, total + held)
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


def smooth_mean(previous: float | None, count: float, total: float) -> float:
    """A running mean per request after `count` more requests with `total` tokens: they weigh in as
    count / (count + TOKEN_MIX_WINDOW_REQUESTS), so the mean follows the last ~200 requests whatever
    the sync interval and load."""
    mean = total / count
    if previous is None:
        return mean
    w = count / (count + TOKEN_MIX_WINDOW_REQUESTS)
    return w * mean + (1.0 - w) * previous


# While requests queue beyond the target, the planner sizes for the prompts admitted in the last sync
# when at least this many were and they are heavier than the running mean (backlog_mix).
BACKLOG_MIX_MIN_REQUESTS = 20.0


def backlog_mix(
    mix: tuple[float, float], admitted: tuple[float, float] | None, backlog: bool
) -> tuple[float, float]:
    """The token mix the planner sizes for: the running mean, or, while requests queue beyond the
    target (`backlog`), the prompts admitted since the last sync (`admitted` = (generations, prompt
    tokens)) where they are heavier and at least BACKLOG_MIX_MIN_REQUESTS. A queue says the capacity
    the running mean gives is too high, and when the mix turned heavier, the last sync's prompts are
    the mix that queued: after a mix three times heavier, the running mean (~200 requests) took four
    syncs to follow, with the fleet sized for the old mix and missing 40% of its requests (the
    mix-shift battery's seed 64; docs/autoscaler.md, "Tenth round"). Without a queue, the mean alone:
    a sync's mean of heavy-tailed prompts is noise."""
    if not backlog or admitted is None or admitted[0] < BACKLOG_MIX_MIN_REQUESTS:
        return mix
    recent = admitted[1] / admitted[0]
    return (recent, mix[1]) if recent > mix[0] else mix


def smooth_token_mix(
    previous: tuple[float, float] | None,
    totals: tuple[float, float, float] | None,
    admitted: tuple[float, float] | None = None,
) -> tuple[float, float] | None:
    """The running token mix after `totals` = (requests, prompt tokens, output tokens) finished since
    the last sync (None: none finished). The prompt side follows the prompts admitted instead where
    the replicas count them (`admitted` = (generations, prompt tokens) admitted since the last sync,
    admitted_prompt_totals): a prompt is known when it arrives, an output length only when its request
    finishes, and a heavier mix reaches the finished requests a request's duration late (longer still
    on a saturated fleet, where the heavy requests are the ones that take long). None until a first
    request finished."""
    before_prompt, before_output = previous if previous is not None else (None, None)
    prompt = before_prompt
    if admitted is not None and admitted[0] > 0:
        prompt = smooth_mean(before_prompt, *admitted)
    elif totals is not None and (admitted is None or before_prompt is None):
        prompt = smooth_mean(before_prompt, totals[0], totals[1])
    output = before_output if totals is None else smooth_mean(before_output, totals[0], totals[2])
    if prompt is None or output is None:
        return None
    return prompt, output


def _increase(pairs: Sequence[tuple[float | None, float | None]]) -> tuple[float, ...] | None:
    """Each (now, before) counter pair's increase; None when one is missing or went down (a
    restart)."""
    out = []
    for now_v, then_v in pairs:
        if now_v is None or then_v is None or now_v < then_v:
            return None
        out.append(now_v - then_v)
    return tuple(out)


def token_totals(snapshot: MetricsSnapshot, previous: ArrivalState) -> tuple[float, float, float] | None:
    """(requests finished, their prompt tokens, their output tokens) since the last sync, over the
    replicas seen both times with the counters; see measure_token_mix. The requests are the length
    histograms' count where a replica had it both times, else its completed counter: an aborted
    generation is in no histogram, and counted as finished with no tokens a wave of client timeouts
    on an overloaded fleet would read as a lighter mix."""
    before = {c.pod: c for c in previous.counters}
    done = prompt = output = 0.0
    for s in snapshot.samples:
        prev = before.get(s.pod)
        if prev is None:
            continue
        lengths = s.finished_lengths_total is not None and prev.finished_lengths is not None
        d = _increase(
            (
                (s.finished_lengths_total, prev.finished_lengths)
                if lengths
                else (s.completed_total, prev.completed),
                (s.prompt_tokens_total, prev.prompt_tokens),
                (s.generation_tokens_total, prev.generation_tokens),
            )
        )
        if d is not None:
            done, prompt, output = done + d[0], prompt + d[1], output + d[2]
    if done <= 0:
        return None
    return done, prompt, output


def admitted_prompt_totals(snapshot: MetricsSnapshot, previous: ArrivalState) -> tuple[float, float] | None:
    """(generations admitted, their prompt tokens) since the last sync, over the replicas seen both
    times that count admissions (ReplicaSample.admitted_total); (0, 0) when they admitted none, None
    when no replica counts them (vLLM pods)."""
    before = {c.pod: c for c in previous.counters}
    diffs = []
    for s in snapshot.samples:
        prev = before.get(s.pod)
        if prev is None:
            continue
        d = _increase(
            ((s.admitted_total, prev.admitted), (s.admitted_prompt_tokens_total, prev.admitted_prompt_tokens))
        )
        if d is not None:
            diffs.append(d)
    if not diffs:
        return None
    return sum(d[0] for d in diffs), sum(d[1] for d in diffs)


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
