"""The policy's memory in the InferenceModel's status, so a restarted autoscaler continues where it stopped.

status.autoscaler (written by field manager kvpilot-autoscaler with a merge patch):
  lastDecision: {time, fromReplicas, toReplicas, reason, metrics: {kvCacheUsage, queueDepth, readyReplicas,
                 reporting}}
  history: [{time, replicas}]            recommendations inside the longest stabilization window
  scaleEvents: [{time, fromReplicas, toReplicas}]   scale changes inside the longest rate-limit period
  lastScaleTime
  arrivals: {time, pods: [{pod, completed, inFlight, promptTokens?, generationTokens?}],
             rates: [{time, rate}], serviceRate, tokenMix?: {prompt, output}}
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
    ScaleEventEntry,
    ScalingDecision,
    TokenMix,
)
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

MAX_REASON = 1024  # the CRD's maxLength for lastDecision.reason


def _seconds(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


def arrivals_from_status(block: Any) -> ArrivalState:
    """Read back arrivals_to_status; entries that do not parse are skipped (a pod without its
    entry is counted as new, capped: see policy.measure_arrivals)."""
    parsed = AutoscalerStatus.model_validate({"arrivals": block}).arrivals
    return _arrivals(parsed) if parsed is not None else ArrivalState()


def _arrivals(a: ArrivalsStatus) -> ArrivalState:
    pods = tuple(
        PodCounter(p.pod, p.completed, p.in_flight, p.prompt_tokens, p.generation_tokens)
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
            )
            for c in state.counters
        ],
        rates=[RatePoint(time=_at(r.time), rate=round(r.rate, 4)) for r in state.rates],
        service_rate=None if state.service_rate is None else round(state.service_rate, 4),
        token_mix=None if mix is None else TokenMix(prompt=round(mix[0], 1), output=round(mix[1], 1)),
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
    recs = [Recommendation(h.time.timestamp(), h.replicas) for h in status.history or []]
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
        history=[HistoryEntry(time=_at(r.time), replicas=r.replicas) for r in h.recommendations],
        scale_events=[
            ScaleEventEntry(time=_at(e.time), from_replicas=e.from_replicas, to_replicas=e.to_replicas)
            for e in h.events
        ],
        last_scale_time=last_scale,
        arrivals=_arrivals_model(h.arrivals),
        decided_by=decided_by,
        held_kind=held_kind,
    )
    block = status.dump()
    # a merge patch keeps what it does not name: an unknown KV usage is written as null, clearing the last one
    block["lastDecision"]["metrics"].setdefault("kvCacheUsage", None)
    return block
