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
policy's dataclasses. Everything here is pure: dicts in, dataclasses out, and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvpilot.api.models import ArrivalsStatus, AutoscalerStatus
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
from kvpilot.kube.times import format_time

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
    block: dict[str, Any] = {
        "pods": [_counter_to_status(c) for c in state.counters],
        "rates": [{"time": format_time(r.time, 3), "rate": round(r.rate, 4)} for r in state.rates],
    }
    if state.time is not None:
        block["time"] = format_time(state.time, 3)
    if state.service_rate is not None:
        block["serviceRate"] = round(state.service_rate, 4)
    if state.token_mix is not None:
        block["tokenMix"] = {"prompt": round(state.token_mix[0], 1), "output": round(state.token_mix[1], 1)}
    return block


def _counter_to_status(c: PodCounter) -> dict[str, Any]:
    out: dict[str, Any] = {"pod": c.pod, "inFlight": c.in_flight}
    if c.completed is not None:
        out["completed"] = c.completed
    if c.prompt_tokens is not None:
        out["promptTokens"] = c.prompt_tokens
    if c.generation_tokens is not None:
        out["generationTokens"] = c.generation_tokens
    return out


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


def decision_to_status(decision: Decision, now: float, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status.autoscaler block for a decision (the whole block: merge patch replaces the lists)."""
    h = decision.history
    block: dict[str, Any] = {
        "lastDecision": {
            "time": format_time(now),
            "fromReplicas": decision.current,
            "toReplicas": decision.desired,
            "reason": decision.reason[:MAX_REASON],
            "metrics": {
                "kvCacheUsage": None
                if decision.avg_kv_cache_usage is None
                else round(decision.avg_kv_cache_usage, 4),
                "queueDepth": decision.total_waiting,
                "readyReplicas": decision.ready,
                "reporting": decision.reporting,
            },
        },
        "history": [{"time": format_time(r.time), "replicas": r.replicas} for r in h.recommendations],
        "scaleEvents": [
            {"time": format_time(e.time), "fromReplicas": e.from_replicas, "toReplicas": e.to_replicas}
            for e in h.events
        ],
    }
    block["arrivals"] = arrivals_to_status(h.arrivals)
    if decision.desired != decision.current:
        block["lastScaleTime"] = format_time(now)
    elif previous and previous.get("lastScaleTime"):
        block["lastScaleTime"] = previous["lastScaleTime"]
    return block
