"""The decode role's KV link and the TTFT breakdown of disaggregated requests. Pure; pd_policy.decide_pd
calls both (in the controller and in the simulator alike).

**The link.** A decode pod pulls each handed-over request's KV blocks over its NIC before the engine
sees the request (runtime/serving/kv_transfer.py): every pull runs at once, as its own HTTP stream, so
the pulls in flight share the link (a processor-sharing server: concurrency does not raise the link's
throughput, it spreads it). When the pulls arrive faster than the link moves them, every pull slows
down and TTFT grows on the decode side, whatever the prefill pool does; only more decode pods (more
links) help. From each decode pod's counters between two syncs (kvpilot_kv_transfer_seconds' sum and
count, kvpilot_kv_transfer_bytes_total{direction="received"}; ReplicaSample.kv_transfer_*):

- bytes/s received, pulls, mean seconds per pull W;
- mean pulls in flight L = the change of the seconds' sum / the interval (Little's law);
- the link's busy share: in a processor-sharing queue the mean number in the system is rho/(1-rho)
  whatever the pull sizes, so rho = L/(1+L), and the link's bandwidth = bytes/s / rho
  = (bytes per pull / W) x (1 + L): one pull's rate when pulls never overlap, the bytes moved when
  the link never idles. Smoothed over syncs (bytes-weighted over the pods), never below the most
  bytes/s one pod received in an interval (a link did that much: it can). Until a pull is measured,
  the calibration's kv_link_bytes_s stands in (with spec.autoscaling.slo), else nothing;
- demand (decode replicas, fractional) = the bytes/s all decode pods receive (the mean over the last
  minute: prompts differ by 100x in size) / (link x target utilization, DEFAULT_LINK_TARGET_UTILIZATION): at 60% busy a pull takes 2.5x its bare time.
  The raw recommendation ceil(demand) runs through the decode role's stabilization windows and rate
  limits (pd_prefill.stabilize, with its own recommendations and the role's scale events).

**The TTFT breakdown.** A disaggregated request's TTFT is its prefill leg (the router's
kvpilot_router_pd_prefill_seconds: the prefill queue and compute), its pull (the decode pods'
kvpilot_kv_transfer_seconds) and the decode pod's admission and first step. Each stage's wait is its
measured mean over the interval less its bare time: the prefill leg less the mean prompt over one
prefill replica's throughput (pd_prefill's: measured at saturation, else the calibration's idle
rate), the pull less its bytes over the link. The pulls' share of the two waits (smoothed) says
which stage the TTFT misses the router counts come from: above one half they are the decode role's
(pd_policy), so misses caused by pulls queued at the decode pods' links grow decode, not prefill.
Unknown (no disaggregated request measured yet): all TTFT misses are the prefill role's. The decode
pod's admission wait is the third stage; no metric exports it for transferred requests alone, so it
is not in the split: the decode role's KV, slot and queue signals size for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvpilot.autoscaler.arrivals import MAX_COUNTER_AGE_S, RateSample
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.pd_prefill import RATE_LEVEL_S, stabilize
from kvpilot.autoscaler.pd_signals import RouterPdCounts
from kvpilot.autoscaler.policy import Recommendation, ScaleEvent
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.spec import ScalingTargets

DEFAULT_LINK_TARGET_UTILIZATION = 0.6  # share of its link a decode pod is sized to keep busy with pulls
LINK_SMOOTHING = 0.5  # weight of a new link estimate
SHARE_SMOOTHING = 0.5  # weight of a new TTFT split
MIN_WAIT_S = (
    0.5  # both stages' mean waits together below this: no stage queues enough to miss, the split holds
)
_EPS = 1e-9


@dataclass(frozen=True)
class PullCounter:
    """One decode pod's pull counters at a sync."""

    pod: str
    seconds: float
    pulls: float
    bytes: float


@dataclass(frozen=True)
class LinkState:
    """The decode role's link estimate (status.autoscaler.disaggregation.decode)."""

    time: float | None = None
    counters: tuple[PullCounter, ...] = ()
    link_bytes_s: float | None = None  # one decode pod's link, measured (smoothed)
    rates: tuple[RateSample, ...] = ()  # bytes/s the decode pods received, by sync (the last RATE_LEVEL_S)
    recommendations: tuple[Recommendation, ...] = ()  # the link's raw recommendations


@dataclass(frozen=True)
class TtftState:
    """The TTFT breakdown (status.autoscaler.disaggregation.ttft)."""

    time: float | None = None  # of the router's counters below
    router: RouterPdCounts | None = None
    decode_share: float | None = None  # of the TTFT misses, the decode role's (smoothed)
    prefill_wait_s: float | None = None  # the last interval's, per disaggregated request
    transfer_wait_s: float | None = None


@dataclass(frozen=True)
class LinkMeasure:
    bytes_s: float  # received by all the decode pods
    pulls: float  # in the interval
    pull_s: float | None  # mean seconds per pull
    bytes_per_pull: float | None
    in_flight: float  # mean pulls in flight per pod


@dataclass(frozen=True)
class LinkDecision:
    desired: int | None  # None: no link known, or no pulls measured: the link says nothing
    recommendation: int | None
    demand: float | None
    text: str
    state: LinkState
    measure: LinkMeasure | None = None
    link_bytes_s: float | None = None  # the estimate used (measured, else the calibration's)


def measure_link(
    snapshot: MetricsSnapshot, prev: LinkState, now: float
) -> tuple[LinkMeasure | None, float | None, tuple[PullCounter, ...]]:
    """(this interval's pulls over the decode pods, the link estimate after it, counters)."""
    dt = None if prev.time is None else now - prev.time
    fresh = dt is not None and 0.0 < dt <= MAX_COUNTER_AGE_S
    before = {c.pod: c for c in prev.counters}
    counters: list[PullCounter] = []
    total_bytes = total_pulls = total_seconds = 0.0
    pods = 0
    estimates: list[tuple[float, float]] = []  # (bytes, link estimate)
    busiest = 0.0
    for s in snapshot.samples:
        if s.kv_transfers_total is None or s.kv_transfer_seconds_total is None:
            continue
        c = PullCounter(
            s.pod, s.kv_transfer_seconds_total, s.kv_transfers_total, s.kv_transfer_bytes_total or 0.0
        )
        counters.append(c)
        b = before.get(s.pod)
        if not fresh or dt is None or b is None or c.pulls < b.pulls or c.seconds < b.seconds:
            continue  # no baseline, or the process restarted
        pods += 1
        n, sec, byt = c.pulls - b.pulls, c.seconds - b.seconds, max(0.0, c.bytes - b.bytes)
        total_pulls += n
        total_seconds += sec
        total_bytes += byt
        busiest = max(busiest, byt / dt)
        if n >= 1 and sec > _EPS and byt > 0:
            in_flight = sec / dt
            estimates.append((byt, byt / sec * (1.0 + in_flight)))
    link = prev.link_bytes_s
    if estimates:
        weight = sum(b for b, _ in estimates)
        sample = sum(b * e for b, e in estimates) / weight
        link = sample if link is None else LINK_SMOOTHING * sample + (1.0 - LINK_SMOOTHING) * link
    if link is not None and busiest > link:
        link = busiest
    if not pods or dt is None:
        return None, link, tuple(counters)
    m = LinkMeasure(
        bytes_s=total_bytes / dt,
        pulls=total_pulls,
        pull_s=total_seconds / total_pulls if total_pulls >= 1 else None,
        bytes_per_pull=total_bytes / total_pulls if total_pulls >= 1 else None,
        in_flight=total_seconds / dt / pods,
    )
    return m, link, tuple(counters)


def decide_link(
    current: int,
    snapshot: MetricsSnapshot,
    targets: ScalingTargets,
    state: LinkState,
    events: tuple[ScaleEvent, ...],
    now: float,
    *,
    startup: float | None,
    calibration: Calibration | None,
    target_utilization: float = DEFAULT_LINK_TARGET_UTILIZATION,
) -> LinkDecision:
    """The decode replicas the pulls need (module doc); `events`: the decode role's scale events (its
    rate limits)."""
    m, measured, counters = measure_link(snapshot, state, now)
    new_state = replace(
        state,
        time=now if counters else state.time,
        counters=counters or state.counters,
        link_bytes_s=measured,
    )
    link = measured if measured is not None else (calibration.kv_link_bytes_s if calibration else None)
    if m is None or link is None or current < 1 or m.pulls < 1:
        text = "no KV pulls measured" if m is None or m.pulls < 1 else "link bandwidth unknown"
        return LinkDecision(None, None, None, text, new_state, m, link)
    # Prompts differ by 100x in size: the level is the mean over the last RATE_LEVEL_S.
    rates = (
        *(r for r in state.rates if now - r.time < RATE_LEVEL_S and r.time < now),
        RateSample(now, m.bytes_s),
    )
    new_state = replace(new_state, rates=rates)
    level = sum(r.rate for r in rates) / len(rates)
    demand = level / (link * target_utilization)
    raw = max(1, math.ceil(demand - _EPS))
    steady = raw if abs(raw / current - 1.0) > targets.behavior.tolerance else current
    desired, recs, _, notes = stabilize(steady, current, state.recommendations, events, now, targets, startup)
    text = (
        f"KV pulls {level / 1e9:.2f} GB/s ({m.pulls:.0f} pulls, mean {m.pull_s or 0.0:.2f} s,"
        f" {m.in_flight:.1f} in flight per pod) over a {link / 1e9:.1f} GB/s link per replica"
        f" ({'measured' if measured is not None else 'calibration'}, target {target_utilization:.0%})"
    )
    if notes:
        text += "; " + "; ".join(notes)
    return LinkDecision(desired, raw, demand, text, replace(new_state, recommendations=recs), m, link)


def bare_prefill_s(mean_prompt: float | None, throughput: float | None) -> float | None:
    """The mean prompt's prefill at one prefill replica's throughput (measured, else the calibration's
    idle rate): what the leg takes without a queue. The measured rate has the pods' prefix-cache hits
    in it (prompt tokens counted whole), which an idle-prefill model of the prompt would not."""
    return mean_prompt / throughput if mean_prompt and throughput else None


def attribute_ttft(
    state: TtftState,
    router: RouterPdCounts | None,
    now: float,
    link: LinkDecision,
    bare_prefill: float | None,
) -> tuple[TtftState, float]:
    """The TTFT breakdown after this sync, and the decode role's share of TTFT misses (module doc)."""
    new = replace(state, time=now if router is not None else state.time, router=router or state.router)
    share = state.decode_share
    prev = state.router
    prefill_wait = transfer_wait = None
    if router is not None and prev is not None and router.prefill_legs >= prev.prefill_legs:
        legs = router.prefill_legs - prev.prefill_legs
        if legs >= 1 and bare_prefill is not None:
            leg_s = max(0.0, router.prefill_seconds - prev.prefill_seconds) / legs
            prefill_wait = max(0.0, leg_s - bare_prefill)
    m = link.measure
    if m is not None and m.pull_s is not None and m.bytes_per_pull is not None and link.link_bytes_s:
        transfer_wait = max(0.0, m.pull_s - m.bytes_per_pull / link.link_bytes_s)
    if prefill_wait is not None and transfer_wait is not None and prefill_wait + transfer_wait >= MIN_WAIT_S:
        sample = transfer_wait / (prefill_wait + transfer_wait)
        share = sample if share is None else SHARE_SMOOTHING * sample + (1.0 - SHARE_SMOOTHING) * share
    new = replace(new, decode_share=share, prefill_wait_s=prefill_wait, transfer_wait_s=transfer_wait)
    return new, share or 0.0


def long_prompts_direct(state: TtftState, router: RouterPdCounts | None) -> float:
    """Long prompts the router sent to a decode pod for lack of a prefill pod since the last sync."""
    if router is None or state.router is None or router.no_prefill < state.router.no_prefill:
        return 0.0
    return router.no_prefill - state.router.no_prefill


__all__ = [
    "DEFAULT_LINK_TARGET_UTILIZATION",
    "LinkDecision",
    "LinkMeasure",
    "LinkState",
    "PullCounter",
    "TtftState",
    "attribute_ttft",
    "bare_prefill_s",
    "decide_link",
    "long_prompts_direct",
    "measure_link",
]
