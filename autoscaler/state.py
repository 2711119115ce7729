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
Times are RFC 3339 UTC strings (arrivals' with milliseconds: rates are counter differences over them). Everything here is pure: dicts in, dataclasses out, and back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpilot.autoscaler.policy import (
    ArrivalState,
    Decision,
    History,
    PodCounter,
    RateSample,
    Recommendation,
    ScaleEvent,
)

MAX_REASON = 1024  # the CRD's maxLength for lastDecision.reason


def format_time(t: float) -> str:
    """RFC 3339 with second precision (what Kubernetes itself writes)."""
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_time_ms(t: float) -> str:
    """RFC 3339 with milliseconds, for the arrival estimate's counter times."""
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def parse_time(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) and v >= 0 else None


def arrivals_from_status(block: Any) -> ArrivalState:
    """Read back arrivals_to_status; entries that do not parse are skipped (a pod without its
    entry is counted as new, capped: see policy.measure_arrivals)."""
    if not isinstance(block, Mapping):
        return ArrivalState()
    pods: list[PodCounter] = []
    for item in block.get("pods") or []:
        if not isinstance(item, Mapping) or not isinstance(item.get("pod"), str):
            continue
        in_flight = _int(item.get("inFlight"))
        completed = item.get("completed")
        done = None if completed is None else _number(completed)
        if in_flight is None or in_flight < 0 or (completed is not None and done is None):
            continue
        tokens = [
            _number(item.get(k)) if item.get(k) is not None else None
            for k in ("promptTokens", "generationTokens")
        ]
        pods.append(PodCounter(item["pod"], done, in_flight, tokens[0], tokens[1]))
    rates: list[RateSample] = []
    for item in block.get("rates") or []:
        if not isinstance(item, Mapping):
            continue
        t, r = parse_time(item.get("time")), _number(item.get("rate"))
        if t is not None and r is not None:
            rates.append(RateSample(t, r))
    rates.sort(key=lambda r: r.time)
    service = _number(block.get("serviceRate"))
    mix_block = block.get("tokenMix")
    token_mix = None
    if isinstance(mix_block, Mapping):
        mp, mo = _number(mix_block.get("prompt")), _number(mix_block.get("output"))
        token_mix = (mp, mo) if mp is not None and mo is not None else None
    return ArrivalState(
        time=parse_time(block.get("time")),
        counters=tuple(pods),
        rates=tuple(rates),
        service_rate=service if service else None,
        token_mix=token_mix,
    )


def arrivals_to_status(state: ArrivalState) -> dict[str, Any]:
    block: dict[str, Any] = {
        "pods": [_counter_to_status(c) for c in state.counters],
        "rates": [{"time": format_time_ms(r.time), "rate": round(r.rate, 4)} for r in state.rates],
    }
    if state.time is not None:
        block["time"] = format_time_ms(state.time)
    if state.service_rate is not None:
        block["serviceRate"] = round(state.service_rate, 4)
    if state.token_mix is not None:
        block["tokenMix"] = {"prompt": round(state.token_mix[0], 1), "output": round(state.token_mix[1], 1)}
    return block


def _counter_to_status(c: PodCounter) -> dict[str, Any]:
    out: dict[str, Any] = {"pod": c.pod, "completed": c.completed, "inFlight": c.in_flight}
    if c.prompt_tokens is not None:
        out["promptTokens"] = c.prompt_tokens
    if c.generation_tokens is not None:
        out["generationTokens"] = c.generation_tokens
    return out


def history_from_status(autoscaler_status: Mapping[str, Any] | None) -> History:
    """Read back what history_to_status wrote; entries that do not parse are skipped, never guessed."""
    if not autoscaler_status:
        return History()
    recs: list[Recommendation] = []
    for item in autoscaler_status.get("history") or []:
        if not isinstance(item, Mapping):
            continue
        t, r = parse_time(item.get("time")), _int(item.get("replicas"))
        if t is not None and r is not None and r >= 0:
            recs.append(Recommendation(t, r))
    events: list[ScaleEvent] = []
    for item in autoscaler_status.get("scaleEvents") or []:
        if not isinstance(item, Mapping):
            continue
        t, f, to = parse_time(item.get("time")), _int(item.get("fromReplicas")), _int(item.get("toReplicas"))
        if t is not None and f is not None and to is not None:
            events.append(ScaleEvent(t, f, to))
    last = autoscaler_status.get("lastDecision")
    last_queue: tuple[float, int] | None = None
    if isinstance(last, Mapping):
        t = parse_time(last.get("time"))
        f, to = _int(last.get("fromReplicas")), _int(last.get("toReplicas"))
        metrics = last.get("metrics") if isinstance(last.get("metrics"), Mapping) else {}
        q = _int(metrics.get("queueDepth")) if metrics else None
        reporting = _int(metrics.get("reporting")) if metrics else None
        if t is not None and q is not None and reporting:
            last_queue = (t, q)
        # Older writers (or a schema that pruned scaleEvents) still leave the last change here.
        last_scale = parse_time(autoscaler_status.get("lastScaleTime"))
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
        arrivals=arrivals_from_status(autoscaler_status.get("arrivals")),
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
