"""SLO attainment as measured: the share of requests that met the SLO over the last minutes.

Two sources, in order of preference:

- **router**: `kvpilot_router_slo_requests_total{model_name, outcome}`, a counter the router increments
  for every request it proxies, judged with kvpilot.api.slo.judge (outcome met, missed_ttft,
  missed_tpot or failed). The autoscaler reads it summed over the router replicas (a direct scrape of
  every router pod, or a Prometheus instant query) and differences it between syncs; a sum that went
  down (a router restarted) gives no interval rather than a wrong one.
- **pods** (no router reports the model): the pods' own histograms,
  `kvpilot_time_to_first_token_seconds` and `kvpilot_inter_token_latency_seconds` (vLLM's
  `time_to_first_token_seconds` and `inter_token_latency_seconds`), counted at the largest bucket
  bound within each target. This is a **bound**, not the router's judgement: a first token counts as
  in time only when it is within the base TTFT target (the prompt's prefill allowance is not known
  per observation, so long prompts read as misses more often than they are), and TPOT is per token
  (a request's TPOT is the mean of its gaps), applied to the requests in time as a share. It also
  misses what the pods never see (requests queued or failed before a pod).

Missing measurements are never read as perfect attainment: no source, no attainment (None), and the
policy then neither grows on it nor lets it permit a scale-down.
Pure: dataclasses in, dataclasses out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvpilot.api.slo import OUTCOMES, Outcome

SOURCE_ROUTER = "router"
SOURCE_PODS = "pods"


@dataclass(frozen=True)
class SloCounts:
    """Requests by outcome (api/slo.OUTCOMES). Counts are floats: the pods' bound yields fractions."""

    met: float = 0.0
    missed_ttft: float = 0.0
    missed_tpot: float = 0.0
    failed: float = 0.0

    @classmethod
    def from_outcomes(cls, by_outcome: Mapping[str, float] | Mapping[Outcome, int]) -> SloCounts:
        """From {outcome: count}; outcomes api/slo does not know are ignored."""
        return cls(**{o: float(by_outcome.get(o, 0.0)) for o in OUTCOMES})

    @property
    def total(self) -> float:
        return self.met + self.missed_ttft + self.missed_tpot + self.failed

    @property
    def missed(self) -> float:
        return self.total - self.met

    @property
    def attainment(self) -> float | None:
        """met / total; None for no requests (unknown, not perfect)."""
        return self.met / self.total if self.total > 0 else None

    def __add__(self, other: SloCounts) -> SloCounts:
        return SloCounts(
            self.met + other.met,
            self.missed_ttft + other.missed_ttft,
            self.missed_tpot + other.missed_tpot,
            self.failed + other.failed,
        )

    def since(self, earlier: SloCounts) -> SloCounts | None:
        """These cumulative counters minus `earlier`; None when any went down (a reset)."""
        d = SloCounts(
            self.met - earlier.met,
            self.missed_ttft - earlier.missed_ttft,
            self.missed_tpot - earlier.missed_tpot,
            self.failed - earlier.failed,
        )
        if min(d.met, d.missed_ttft, d.missed_tpot, d.failed) < -1e-9:
            return None
        return SloCounts(
            max(0.0, d.met), max(0.0, d.missed_ttft), max(0.0, d.missed_tpot), max(0.0, d.failed)
        )

    def text(self) -> str:
        a = self.attainment
        return "no requests" if a is None else f"{a:.3f} of {self.total:.0f} requests"


@dataclass(frozen=True)
class SloInterval:
    """The requests judged between two syncs (ending at `time`, `seconds` long) and the load then."""

    time: float
    seconds: float
    counts: SloCounts
    load_per_replica: float | None = None  # arrivals/s per Ready replica over the interval


@dataclass(frozen=True)
class PodLatency:
    """A pod's latency histograms at the SLO targets: cumulative counts since the process started."""

    ttft_within: float
    ttft_count: float
    itl_within: float
    itl_count: float

    def since(self, earlier: PodLatency) -> PodLatency | None:
        d = PodLatency(
            self.ttft_within - earlier.ttft_within,
            self.ttft_count - earlier.ttft_count,
            self.itl_within - earlier.itl_within,
            self.itl_count - earlier.itl_count,
        )
        if min(d.ttft_within, d.ttft_count, d.itl_within, d.itl_count) < 0:
            return None  # the process restarted
        return d


def count_within(buckets: Iterable[tuple[float, float]], bound: float) -> tuple[float, float] | None:
    """(observations <= the largest bucket bound <= `bound`, all observations) of a cumulative
    histogram ((le, count) pairs, +Inf included). Taking the bucket below the target makes the share
    a lower bound. None without a +Inf bucket."""
    within, total = 0.0, None
    for le, count in buckets:
        if not math.isfinite(count):
            continue
        if le == math.inf:
            total = count
        elif le <= bound + 1e-12:
            within = max(within, count)
    if total is None:
        return None
    return min(within, total), total


def pod_latency(
    ttft_buckets: Sequence[tuple[float, float]] | None,
    itl_buckets: Sequence[tuple[float, float]] | None,
    ttft_s: float,
    tpot_s: float,
) -> PodLatency | None:
    """The pod's PodLatency at these targets; None unless it exports both histograms."""
    if not ttft_buckets or not itl_buckets:
        return None
    ttft = count_within(ttft_buckets, ttft_s)
    itl = count_within(itl_buckets, tpot_s)
    if ttft is None or itl is None:
        return None
    return PodLatency(ttft[0], ttft[1], itl[0], itl[1])


def counts_from_latency(d: PodLatency) -> SloCounts:
    """The pods' bound as SloCounts: first tokens outside the base TTFT target are missed_ttft; of
    those in time, the share of inter-token gaps outside the TPOT target is missed_tpot."""
    in_time = min(d.ttft_within, d.ttft_count)
    slow_gaps = 1.0 - d.itl_within / d.itl_count if d.itl_count > 0 else 0.0
    missed_tpot = in_time * max(0.0, slow_gaps)
    return SloCounts(met=in_time - missed_tpot, missed_ttft=d.ttft_count - in_time, missed_tpot=missed_tpot)


def pods_interval_counts(
    now_by_pod: Mapping[str, PodLatency], before_by_pod: Mapping[str, PodLatency]
) -> SloCounts | None:
    """The requests the pods served since the last sync, from their histograms: each pod seen both
    times contributes its difference, a pod new since then (it became Ready) everything it has; a
    pod whose counts went down (restarted) contributes what it has since the restart. None when no
    pod exports the histograms, or there is no previous sync to difference against."""
    if not now_by_pod or not before_by_pod:
        return None
    total = SloCounts()
    for pod, now in now_by_pod.items():
        before = before_by_pod.get(pod)
        delta = now.since(before) if before is not None else None
        total = total + counts_from_latency(delta if delta is not None else now)
    return total


@dataclass(frozen=True)
class Window:
    counts: SloCounts
    seconds: float
    load_per_replica: float | None  # time-weighted over the intervals that know it


def window(
    intervals: Sequence[SloInterval], now: float, window_s: float, since: float | None = None
) -> Window:
    """The intervals that ended within the last `window_s` and began at or after `since` (when
    given), added up."""
    counts, seconds, load_s, weight = SloCounts(), 0.0, 0.0, 0.0
    for i in intervals:
        if now - i.time >= window_s or i.time > now:
            continue
        if since is not None and i.time - i.seconds < since - 1e-6:
            continue
        counts = counts + i.counts
        seconds += i.seconds
        if i.load_per_replica is not None:
            load_s += i.load_per_replica * i.seconds
            weight += i.seconds
    return Window(counts, seconds, load_s / weight if weight > 0 else None)
