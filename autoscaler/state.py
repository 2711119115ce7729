"""The policy's memory in the InferenceModel's status, so a restarted autoscaler continues where it stopped.

status.autoscaler (written by field manager kvpilot-autoscaler with a merge patch):
  lastDecision: {time, fromReplicas, toReplicas, reason, metrics: {kvCacheUsage, queueDepth, readyReplicas,
                 reporting}}
  history: [{time, replicas, backlog?}]  recommendations inside the longest stabilization window
                                         (backlog: sized for a backlog, held only while it queues)
  scaleEvents: [{time, fromReplicas, toReplicas}]   scale changes inside the longest rate-limit period
  lastScaleTime
  redundancy: {time, replicas, rate, perReplica}   when the redundancy floor last applied (held for the
                                         scale-down window, redundancy.held_redundancy)
  arrivals: {time, pods: [{pod, completed, inFlight, promptTokens?, generationTokens?}],
             rates: [{time, rate}], serviceRate, tokenMix?: {prompt, output},
             levels?: [{time, rate}], shiftAt?, routerQueue?}  (levels, shiftAt: the surge headroom's,
             surge.py; routerQueue: the router's held requests at `time`)
                                         the arrival-rate estimate's counters and trend (policy.ArrivalState)
Times are RFC 3339 UTC strings (arrivals' with milliseconds: rates are counter differences over them).
The block's schema is the shared model `kvpilot.api.models.AutoscalerStatus`; reading it back is one
parse of that model (which drops, never guesses, what does not parse), then a translation into the
policy's dataclasses; writing it builds the same model and dumps it by alias (absent values left out,
except lastDecision.metrics.kvCacheUsage, written as null so the merge patch clears a stale one).
Everything here is pure: dicts in, dataclasses out, and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpilot.api.models import (
    ArrivalsStatus,
    AutoscalerStatus,
    DecisionMetrics,
    HistoryEntry,
    PodCounters,
    RatePoint,
    RedundancyFloorStatus,
    ScaleEventEntry,
    ScalingDecision,
    SloCountsStatus,
    SloStatus,
    TokenMix,
)
from kvpilot.api.models import (
    SloInterval as SloIntervalStatus,
)
from kvpilot.autoscaler.attainment import PodLatency, SloCounts, SloInterval
from kvpilot.autoscaler.feedback import SloState
from kvpilot.autoscaler.policy import (
    TOKEN_MIX_WINDOW_REQUESTS,
    ArrivalState,
    Decision,
    History,
    PodCounter,
    RateSample,
    Recommendation,
    ScaleEvent,
)
from kvpilot.autoscaler.redundancy import Redundancy

MAX_REASON = 1024  # the CRD's maxLength for lastDecision.reason


def _seconds(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


def arrivals_from_status(block: Any) -> ArrivalState:
    """Read back arrivals_to_status; entries that do not parse are skipped (a pod without its
    entry is counted as new, capped: see policy.measure_arrivals)."""
    parsed = AutoscalerStatus.model_validate({"arrivals": block}).arrivals
    return _arrivals(parsed) if parsed is not None else ArrivalState()


def _latency(p: PodCounters) -> PodLatency | None:
    values = (p.ttft_within, p.ttft_count, p.itl_within, p.itl_count)
    if any(v is None for v in values):
        return None
    return PodLatency(*(float(v or 0.0) for v in values))


def _arrivals(a: ArrivalsStatus) -> ArrivalState:
    pods = tuple(
        PodCounter(
            p.pod,
            p.completed,
            p.in_flight,
            p.prompt_tokens,
            p.generation_tokens,
            p.finished_lengths,
            p.admitted,
            p.admitted_prompt_tokens,
            _latency(p),
        )
        for p in a.pods or []
    )
    rates = sorted((RateSample(r.time.timestamp(), r.rate) for r in a.rates or []), key=lambda r: r.time)
    mix = a.token_mix
    return ArrivalState(
        time=_seconds(a.time),
        counters=pods,
        rates=tuple(rates),
        service_rate=a.service_rate or None,
        token_mix=None if mix is None else (mix.prompt, mix.output),
        mix_requests=0.0 if mix is None else TOKEN_MIX_WINDOW_REQUESTS,
        levels=tuple(
            sorted((RateSample(r.time.timestamp(), r.rate) for r in a.levels or []), key=lambda r: r.time)
        ),
        shift_at=_seconds(a.shift_at),
        router_queue=a.router_queue,
    )


def arrivals_to_status(state: ArrivalState) -> dict[str, Any]:
    return _arrivals_model(state).dump()


def _arrivals_model(state: ArrivalState) -> ArrivalsStatus:
    mix = state.token_mix
    return ArrivalsStatus(
        time=_time(state.time),
        pods=[
            PodCounters(
                pod=c.pod,
                completed=c.completed,
                in_flight=c.in_flight,
                prompt_tokens=c.prompt_tokens,
                generation_tokens=c.generation_tokens,
                finished_lengths=c.finished_lengths,
                admitted=c.admitted,
                admitted_prompt_tokens=c.admitted_prompt_tokens,
                **(
                    {}
                    if c.latency is None
                    else {
                        "ttft_within": c.latency.ttft_within,
                        "ttft_count": c.latency.ttft_count,
                        "itl_within": c.latency.itl_within,
                        "itl_count": c.latency.itl_count,
                    }
                ),
            )
            for c in state.counters
        ],
        rates=[RatePoint(time=_at(r.time), rate=round(r.rate, 4)) for r in state.rates],
        service_rate=None if state.service_rate is None else round(state.service_rate, 4),
        token_mix=None if mix is None else TokenMix(prompt=round(mix[0], 1), output=round(mix[1], 1)),
        levels=[RatePoint(time=_at(r.time), rate=round(r.rate, 4)) for r in state.levels] or None,
        shift_at=_time(state.shift_at),
        router_queue=state.router_queue,
    )


def _counts(c: SloCountsStatus) -> SloCounts:
    return SloCounts(c.met, c.missed_ttft, c.missed_tpot, c.failed)


def _counts_model(c: SloCounts) -> SloCountsStatus:
    return SloCountsStatus(
        met=round(c.met, 3),
        missed_ttft=round(c.missed_ttft, 3),
        missed_tpot=round(c.missed_tpot, 3),
        failed=round(c.failed, 3),
    )


def _slo_state(s: SloStatus) -> SloState:
    return SloState(
        time=_seconds(s.router_time),
        router_counts=None if s.router_counts is None else _counts(s.router_counts),
        intervals=tuple(
            sorted(
                (
                    SloInterval(i.time.timestamp(), i.seconds, _counts(i.counts), i.load_per_replica)
                    for i in s.intervals or []
                ),
                key=lambda i: i.time,
            )
        ),
        capacity_floor=s.capacity_floor or None,
        capacity_ceiling=s.capacity_ceiling or None,
        fresh_since=_seconds(s.fresh_since),
        source=s.source,
        last_backlog=_seconds(s.last_backlog),
        miss_load=s.miss_load or None,
        miss_ceiling=s.miss_ceiling or None,
        miss_at=_seconds(s.miss_at),
        floor_capacity=s.floor_model_capacity or None,
    )


def _slo_model(decision: Decision) -> SloStatus | None:
    state, targets = decision.history.slo, decision.judge_targets
    if targets is None:
        return None
    return SloStatus(
        prefill_seconds_per_token=targets.prefill_s_per_token,
        prefill_seconds_per_token_squared=targets.prefill_s_per_token_sq,
        attainment=None if decision.attainment is None else round(decision.attainment, 5),
        window_seconds=round(decision.attainment_window_s, 3),
        requests=round(decision.attainment_requests, 3),
        source=state.source,
        target=decision.attainment_target,
        capacity_factor=None if decision.capacity_factor is None else round(decision.capacity_factor, 4),
        capacity_floor=None if state.capacity_floor is None else round(state.capacity_floor, 5),
        floor_model_capacity=None if state.floor_capacity is None else round(state.floor_capacity, 5),
        capacity_ceiling=None if state.capacity_ceiling is None else round(state.capacity_ceiling, 5),
        fresh_since=_time(state.fresh_since),
        last_backlog=_time(state.last_backlog),
        miss_load=None if state.miss_load is None else round(state.miss_load, 5),
        miss_ceiling=None if state.miss_ceiling is None else round(state.miss_ceiling, 5),
        miss_at=_time(state.miss_at),
        router_time=_time(state.time),
        router_counts=None if state.router_counts is None else _counts_model(state.router_counts),
        intervals=[
            SloIntervalStatus(
                time=_at(i.time),
                seconds=round(i.seconds, 3),
                counts=_counts_model(i.counts),
                load_per_replica=None if i.load_per_replica is None else round(i.load_per_replica, 5),
            )
            for i in state.intervals
        ],
    )


def _at(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def _time(t: float | None) -> datetime | None:
    return None if t is None else _at(t)


def history_from_status(autoscaler_status: Mapping[str, Any] | None) -> History:
    """Read back what history_to_status wrote; entries that do not parse are skipped, never guessed."""
    if not autoscaler_status:
        return History()
    status = AutoscalerStatus.model_validate(autoscaler_status)
    recs = [Recommendation(h.time.timestamp(), h.replicas, bool(h.backlog)) for h in status.history or []]
    events = [
        ScaleEvent(e.time.timestamp(), e.from_replicas, e.to_replicas) for e in status.scale_events or []
    ]
    last = status.last_decision
    last_queue: tuple[float, int] | None = None
    if last is not None:
        t, f, to = _seconds(last.time), last.from_replicas, last.to_replicas
        metrics = last.metrics
        q = metrics.queue_depth if metrics else None
        if t is not None and q is not None and q.is_integer() and metrics and metrics.reporting:
            last_queue = (t, int(q))
        # Older writers (or a schema that pruned scaleEvents) still leave the last change here.
        last_scale = _seconds(status.last_scale_time)
        if (
            not events
            and last_scale is not None
            and f is not None
            and to is not None
            and f != to
            and t is not None
            and abs(last_scale - t) < 1.0
        ):
            events.append(ScaleEvent(last_scale, f, to))
    recs.sort(key=lambda r: r.time)
    events.sort(key=lambda e: e.time)
    return History(
        recommendations=tuple(recs),
        events=tuple(events),
        last_queue=last_queue,
        arrivals=_arrivals(status.arrivals) if status.arrivals is not None else ArrivalState(),
        slo=_slo_state(status.slo) if status.slo is not None else SloState(),
        redundancy=None
        if (r := status.redundancy) is None
        else (r.time.timestamp(), Redundancy(r.replicas, r.rate, r.per_replica)),
    )


def kv_cache_usage_text(avg_kv: float | None) -> str | None:
    """The printer column: "42%"."""
    return None if avg_kv is None else f"{round(avg_kv * 100)}%"


def decision_to_status(
    decision: Decision,
    now: float,
    previous: Mapping[str, Any] | None,
    decided_by: str | None = None,
    held_kind: str | None = None,
) -> dict[str, Any]:
    """The status.autoscaler block for a decision (the whole block: merge patch replaces the lists).
    `decided_by`: the deciding replica's identity; `held_kind`: why a hold is noteworthy (hold_kind)."""
    h = decision.history
    last_scale: datetime | None = _at(now) if decision.desired != decision.current else None
    if last_scale is None and previous:
        last_scale = AutoscalerStatus.model_validate(
            {"lastScaleTime": previous.get("lastScaleTime")}
        ).last_scale_time
    status = AutoscalerStatus(
        last_decision=ScalingDecision(
            time=_at(now),
            from_replicas=decision.current,
            to_replicas=decision.desired,
            reason=decision.reason[:MAX_REASON],
            metrics=DecisionMetrics(
                kvCacheUsage=None
                if decision.avg_kv_cache_usage is None
                else round(decision.avg_kv_cache_usage, 4),
                queue_depth=decision.total_waiting,
                ready_replicas=decision.ready,
                reporting=decision.reporting,
            ),
        ),
        history=[
            HistoryEntry(time=_at(r.time), replicas=r.replicas, backlog=r.backlog or None)
            for r in h.recommendations
        ],
        scale_events=[
            ScaleEventEntry(time=_at(e.time), from_replicas=e.from_replicas, to_replicas=e.to_replicas)
            for e in h.events
        ],
        last_scale_time=last_scale,
        redundancy=None
        if h.redundancy is None
        else RedundancyFloorStatus(
            time=_at(h.redundancy[0]),
            replicas=h.redundancy[1].replicas,
            rate=round(h.redundancy[1].rate, 5),
            per_replica=round(h.redundancy[1].per_replica, 5),
        ),
        arrivals=_arrivals_model(h.arrivals),
        decided_by=decided_by,
        held_kind=held_kind,
        slo=_slo_model(decision),
    )
    block = status.dump()
    # a merge patch keeps what it does not name: an unknown KV usage is written as null, clearing the last one
    block["lastDecision"]["metrics"].setdefault("kvCacheUsage", None)
    return block
