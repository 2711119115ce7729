"""Surge headroom: capacity held ahead of a surge on traffic that has shown it jumps between levels.
Pure functions; policy.decide() calls them every sync with the arrival rates it measured.

A fleet sized for the rate it measures meets a surge one reaction later: the sync that sees it, then
a startup (sync + startup, at least two syncs). Traffic that changes smoothly (a daily cycle, Poisson
noise around a level) gives the forecast time to follow, and nothing needs holding ahead. Traffic
that has jumped between levels (a batch job, a tenant switching on, a flash crowd, an hour boundary)
can jump again, and the first reaction's worth of a jump lands on a fleet sized for before it: a 30x
surge from a quiet hour queues ~25 s of arrivals on one replica, more misses than a day's budget.

So, from what the fleet measured:
- A **level shift**: the arrival rate changed by at least `shift_ratio` within one reaction
  (rising or falling), beyond Poisson noise: (high - Z sd) >= shift_ratio x (low + Z sd), sd the
  Poisson standard deviation of one sync's count at the high rate. Smooth traffic never shows one
  (the daily cycle changes by a few percent per reaction; noise is taken out).
- A **rising shift in progress**: the latest sync's rate rose by a shift's share of one sync at the
  shortest reaction (sqrt(shift_ratio)), beyond noise. The forecast then plans for the most the trend
  is allowed (Behavior.arrival_max_growth x the latest rate) at once, instead of a sync later.
- The **levels**: the mean arrival rate of every minute of the last `window_s`.
- While a shift was seen within `window_s`, the fleet keeps the replicas that serve the
  `quantile` of the levels (the rate the traffic held or exceeded for 1 - quantile of the window):
  traffic that jumps can jump back to a level it held recently; the quiet stretch between two
  surges is where this costs replicas, and there they are cheap next to the misses.

The state (levels, the last shift's time) is in ArrivalState, written to status.autoscaler.arrivals, so
a restarted autoscaler keeps it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kvpilot.autoscaler.arrivals import RATE_SIGNIFICANCE_Z, RateSample

LEVEL_SAMPLE_S = 60.0  # one level per this many seconds: the mean rate of the syncs since the last one


@dataclass(frozen=True)
class SurgeHold:
    """What the surge headroom asks at one sync (None: it is not holding)."""

    replicas: int
    level: float  # requests/s held for: the quantile of the window's levels
    shift_at: float  # when the last level shift was seen
    per_replica: float

    def text(self, now: float, window_s: float, quantile: float) -> str:
        return (
            f"surge headroom: level shift {now - self.shift_at:.0f}s ago, holding {self.level:.2f}/s "
            f"(p{quantile * 100:.0f} of {window_s / 60:.0f} min) at {self.per_replica:.2f}/s per replica"
        )


def reaction_s(span_s: float, startup_s: float | None) -> float:
    """Seconds between a rate change and the first sync at which a replica asked for because of it
    serves: the sync that sees it (one sync interval, `span_s`), then the startup, rounded up to the
    next sync; at least two syncs."""
    span = max(1e-9, span_s)
    startup = max(0.0, startup_s or 0.0)
    return span * (1 + max(1, math.ceil(startup / span - 1e-9)))


def shifted(a: RateSample, b: RateSample, ratio: float, span_s: float) -> bool:
    """Whether the rate changed by at least `ratio` between a and b beyond Poisson noise (a count over
    `span_s` at the higher rate has sd sqrt(rate / span))."""
    hi, lo = max(a.rate, b.rate), min(a.rate, b.rate)
    noise = RATE_SIGNIFICANCE_Z * math.sqrt(max(hi, 0.0) / max(span_s, 1e-9))
    return hi - noise > 0 and hi - noise >= ratio * (lo + noise)


def level_shift(rates: tuple[RateSample, ...], startup_s: float | None, ratio: float) -> bool:
    """Whether the latest rate (rates[-1]) differs from one measured within a reaction before it by a
    level shift (`shifted`)."""
    if len(rates) < 2:
        return False
    latest = rates[-1]
    span = latest.time - rates[-2].time
    if span <= 0:
        return False
    window = reaction_s(span, startup_s)
    return any(shifted(r, latest, ratio, span) for r in rates[:-1] if latest.time - r.time <= window + 1e-6)


def rising_shift(rates: tuple[RateSample, ...], ratio: float) -> bool:
    """Whether the latest rate rose from the one before by a level shift's share of one sync at the
    shortest reaction (two syncs): sqrt(ratio), beyond noise (`shifted`). A shift in progress: the
    rest of it arrives before a replica asked for now is Ready. (Not the share of a longer reaction:
    at a 60 s startup that is 1.25x per sync, which a 2x spike passes, and the 2x forecast it
    asks for is held for the scale-down window; a slower rise is the trend forecast's, which looks
    a startup ahead.)"""
    if len(rates) < 2 or rates[-1].rate <= rates[-2].rate:
        return False
    span = rates[-1].time - rates[-2].time
    if span <= 0:
        return False
    return shifted(rates[-2], rates[-1], math.sqrt(ratio), span)


def record_level(
    levels: tuple[RateSample, ...], rates: tuple[RateSample, ...], now: float, window_s: float
) -> tuple[RateSample, ...]:
    """The levels after this sync: a new one when LEVEL_SAMPLE_S passed since the last (the mean of
    the rates measured since then, weighted by their spans), and none older than window_s."""
    kept = tuple(lv for lv in levels if now - lv.time < window_s and lv.time <= now)
    since = kept[-1].time if kept else None
    if since is not None and now - since < LEVEL_SAMPLE_S:
        return kept
    new = [r for r in rates if (since is None or r.time > since) and r.time <= now]
    if not new:
        return kept
    # Each rate weighs the seconds it was counted over: the gap since the rate (or level) before it;
    # the first of a fresh start, without one, the gap after it.
    times = [r.time for r in new]
    first = times[0] - since if since is not None else (times[1] - times[0] if len(times) > 1 else 1.0)
    spans = [first, *(b - a for a, b in itertools.pairwise(times))]
    spans = [s if s > 0 else 1e-9 for s in spans]
    total = sum(r.rate * s for r, s in zip(new, spans, strict=True))
    return (*kept, RateSample(now, total / sum(spans)))


def level_quantile(levels: tuple[RateSample, ...], quantile: float) -> float | None:
    """The nearest-rank `quantile` of the levels' rates; None without levels."""
    if not levels:
        return None
    values = sorted(lv.rate for lv in levels)
    return values[min(len(values) - 1, max(0, math.ceil(quantile * len(values) - 1e-9) - 1))]


def surge_hold(
    levels: tuple[RateSample, ...],
    shift_at: float | None,
    now: float,
    per_replica: float | None,
    window_s: float,
    quantile: float,
) -> SurgeHold | None:
    """The replicas held for a surge (module doc); None when no shift was seen within window_s, there
    are no levels, or no per-replica rate."""
    if shift_at is None or now - shift_at > window_s or not per_replica or per_replica <= 0:
        return None
    level = level_quantile(levels, quantile)
    if level is None or level <= 0:
        return None
    return SurgeHold(math.ceil(level / per_replica - 1e-9), level, shift_at, per_replica)
