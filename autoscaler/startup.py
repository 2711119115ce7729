"""Startup-aware sizing: what a replica's startup time (pod created -> Ready) changes in the policy.

Pure functions; policy.decide() calls them when the startup time is known (measured from the model's
pods, else declared in ScalingTargets.startup_s: spec.autoscaling.startupSeconds), and behaves as
before when it is not.

- measured_startup_s: the median startup of the pods seen (creation -> Ready), from the pod objects
  the controller lists (pod_startup_seconds) or the simulator's replicas.
- forecast_lead_s: the arrival-rate forecast looks at least one startup ahead (a replica asked for
  now serves the load of then).
- backlog_replicas: the replicas that serve the forecast rate and drain the backlog expected when the
  replicas asked for now are Ready (the queue now, plus what the Ready replicas leave unserved for
  one startup) within one startup more. It replaces the queue rule's "absorb" count, which assumes a
  new replica absorbs its share at once; with a 60 s startup that rule asked again at every sync for
  the backlog that grew while the last pods started (flash_crowd x8: 16 replicas where 7 serve the
  peak, docs/autoscaler.md).
- scale_down_hold_s: the scale-down window is at least a few startups (a replica released for a dip
  shorter than that comes back too late).
- startup_rise_limit: at a long startup a scale-down leaves the smaller fleet room for the arrival
  rate to rise by STARTUP_RATE_RISE (a replica it would need then is a startup away).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from kvpilot.autoscaler.slo import replicas_needed
from kvpilot.kube.times import parse_time

# The queue rule plans over the startup only when a startup spans at least two syncs (15 s each): a
# replica that is Ready by the next sync absorbs its share at once, as the reactive rule assumes (at
# 10 s startup the startup-aware rule cost 2-3 points on flash_crowd x8 for no fewer replica-hours).
STARTUP_AWARE_MIN_S = 30.0
# The backlog is sized to drain within this many startups after the new replicas are Ready.
DRAIN_STARTUPS = 0.5
# At a startup of STARTUP_AWARE_MIN_S or more, a scale-down keeps room for the arrival rate to rise by this
# share over the larger of the forecast and the latest rate: a smaller fleet sized at the rate it
# serves now misses for a whole startup when the rate steps up (the battery's conversation traces
# step by a log-normal factor of sigma 0.15 every 5 minutes; fresh seed 67 at 60 s: 3 replicas at 97%
# of their capacity, then +34% within 7 minutes: 97.73% where a fixed 4 attain 99.22%).
STARTUP_RATE_RISE = 0.2
# The scale-down window is at least this many startups.
HOLD_STARTUPS = 4.0
# Pods measured for the startup estimate: the most recent ones (by creation time).
STARTUP_SAMPLE_PODS = 20


def measured_startup_s(durations: Iterable[float]) -> float | None:
    """The median of the pods' startup times (seconds), None when none is known."""
    values = [d for d in durations if d >= 0 and math.isfinite(d)]
    return statistics.median(values) if values else None


def pod_startup_seconds(pods: Sequence[Mapping[str, Any]]) -> list[float]:
    """Creation -> Ready of each Ready pod (metadata.creationTimestamp to the Ready condition's
    lastTransitionTime), the most recent STARTUP_SAMPLE_PODS by creation. A pod whose Ready flipped
    later (a restart) reads longer; the median absorbs a few."""
    out: list[tuple[datetime, float]] = []
    for pod in pods:
        created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
        if created is None:
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "True":
                ready = parse_time(c.get("lastTransitionTime"))
                if ready is not None and ready >= created:
                    out.append((created, (ready - created).total_seconds()))
    out.sort(key=lambda x: x[0])
    return [d for _, d in out[-STARTUP_SAMPLE_PODS:]]


def forecast_lead_s(base_lead_s: float, startup_s: float | None) -> float:
    """How far ahead the arrival rate is forecast: at least one startup."""
    return base_lead_s if startup_s is None else max(base_lead_s, startup_s)


def scale_down_hold_s(window_s: float, startup_s: float | None) -> float:
    """The scale-down window: at least HOLD_STARTUPS startups."""
    return window_s if startup_s is None else max(window_s, HOLD_STARTUPS * startup_s)


def startup_rise_limit(
    desired: int, current: int, rate: float | None, per_replica: float, startup_s: float | None
) -> tuple[int, str | None]:
    """A scale-down from `current` to `desired` replicas at a startup of STARTUP_AWARE_MIN_S or more,
    stopped at the size that carries `rate` x (1 + STARTUP_RATE_RISE) at `per_replica` requests/s each:
    (the size, the reason's note; None when the size stands). Sizes up and holds, short startups and
    an unknown rate or capacity pass unchanged."""
    if (
        desired >= current
        or rate is None
        or per_replica <= 0.0
        or startup_s is None
        or startup_s < STARTUP_AWARE_MIN_S
    ):
        return desired, None
    risen = rate * (1.0 + STARTUP_RATE_RISE)
    need = min(current, replicas_needed(risen, per_replica))
    if need <= desired:
        return desired, None
    return need, (
        f"scale-down to {need}, not {desired}: a {startup_s:g}s startup keeps room for "
        f"{risen:.2f}/s (+{STARTUP_RATE_RISE:.0%}) at {per_replica:.2f}/s per replica"
    )


def backlog_replicas(
    waiting: float,
    forecast_rate: float,
    per_replica_rate: float,
    ready: int,
    startup_s: float,
    drain_s: float | None = None,
) -> int:
    """Replicas that serve `forecast_rate` and drain the backlog expected when a replica asked for now
    is Ready within `drain_s` (default: one startup) after that.

    Backlog then = waiting now + what the Ready replicas leave unserved for one startup,
    max(0, forecast - ready x per_replica_rate) x startup_s. 0 when there is nothing to serve;
    per_replica_rate must be > 0."""
    if per_replica_rate <= 0:
        raise ValueError("per_replica_rate must be > 0")
    drain = max(1.0, DRAIN_STARTUPS * startup_s if drain_s is None else drain_s)
    backlog = max(0.0, waiting) + max(0.0, forecast_rate - ready * per_replica_rate) * max(0.0, startup_s)
    need = (max(0.0, forecast_rate) + backlog / drain) / per_replica_rate
    return math.ceil(need - 1e-9)
