"""The RFC 3339 UTC timestamps Kubernetes objects carry (status times, Lease MicroTime, Events)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def format_time(t: datetime | float, digits: int = 0) -> str:
    """`t` (a datetime, or seconds since the epoch) as RFC 3339 UTC with `digits` fractional digits:
    0 as Kubernetes writes Time, 3 for the autoscaler's counter times, 6 for a Lease's MicroTime."""
    when = datetime.fromtimestamp(t, tz=UTC) if isinstance(t, int | float) else t
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    if digits == 0:
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")
    if digits not in (3, 6):
        raise ValueError(f"digits must be 0, 3 or 6, got {digits}")
    return when.strftime("%Y-%m-%dT%H:%M:%S.%f")[: 20 + digits] + "Z"


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 string back to a datetime; None for anything else (absent, empty or malformed)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


__all__ = ["format_time", "parse_time"]
