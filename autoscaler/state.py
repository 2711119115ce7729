"""The policy's memory in the InferenceModel's status, so a restarted autoscaler continues where it stopped.

status.autoscaler (written by field manager kvpilot-autoscaler with a merge patch):
  lastDecision: {time, fromReplicas, toReplicas, reason, metrics: {kvCacheUsage, queueDepth, readyReplicas,
                 reporting}}
  history: [{time, replicas}]            recommendations inside the longest stabilization window
  scaleEvents: [{time, fromReplicas, toReplicas}]   scale changes inside the longest rate-limit period
  lastScaleTime
Times are RFC 3339 UTC strings. Everything here is pure: dicts in, dataclasses out, and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpilot.autoscaler.policy import Decision, History, Recommendation, ScaleEvent

MAX_REASON = 1024  # the CRD's maxLength for lastDecision.reason


def format_time(t: float) -> str:
    """RFC 3339 with second precision (what Kubernetes itself writes)."""
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    return History(recommendations=tuple(recs), events=tuple(events), last_queue=last_queue)


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
    if decision.desired != decision.current:
        block["lastScaleTime"] = format_time(now)
    elif previous and previous.get("lastScaleTime"):
        block["lastScaleTime"] = previous["lastScaleTime"]
    return block
