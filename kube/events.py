"""core/v1 Events about an InferenceModel (the operator's condition changes, the autoscaler's scaling)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvpilot.api.models import API_VERSION, KIND
from kvpilot.kube.times import format_time

MAX_MESSAGE = 1024  # what the API server keeps of an Event's message


def event_manifest(
    involved: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    event_type: str,
    component: str,
    reporting_component: str,
    reporting_instance: str,
    now: datetime | float | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an InferenceModel unless its apiVersion/kind say otherwise), named like
    client-go's recorder does (`<object>.<hex nanoseconds>`), stamped `now` (default: the wall clock)."""
    meta = involved.get("metadata") or {}
    stamp = format_time(time.time() if now is None else now)
    reference = {
        "apiVersion": involved.get("apiVersion") or API_VERSION,
        "kind": involved.get("kind") or KIND,
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{time.time_ns():x}", "namespace": meta.get("namespace")},
        "involvedObject": {k: v for k, v in reference.items() if v is not None},
        "type": event_type,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": component},
        "reportingComponent": reporting_component,
        "reportingInstance": reporting_instance[:128],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


__all__ = ["event_manifest"]
