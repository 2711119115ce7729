"""Passive outlier ejection, as Envoy's outlier detection: a pod that fails requests in a row is taken
out of routing for a while, longer each time it is ejected again.

Pure (no I/O, the clock is an argument): the router reports each exchange with a pod as a success or
a failure (a connection refused, reset or timed out, a response deadline missed, a 5xx, a stream
broken or gone silent) and routes around the pods `is_ejected` says are out.

- `consecutive_failures` failures in a row eject the pod (a success in between starts the count over;
  failures reported while it is ejected, from requests sent before, are not counted);
- for base_ejection_s x the number of times it has been ejected, capped at max_ejection_s. The number
  decays: every base_ejection_s the pod spends back in routing takes one off, so a pod that failed
  once a day ago is not punished for it today (Envoy decrements its multiplier the same way);
- at most max_ejection_percent of a model's pods are out at once, at least one when the percentage is
  above zero, and never the last one: a model whose pods all fail keeps one to try, and a failure
  that would pass the share leaves the pod in (its count stays, so the next failure asks again once
  another pod is back). max_ejection_percent 0 turns ejection off.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class OutlierSettings:
    consecutive_failures: int = 3
    base_ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError(f"consecutive failures must be >= 1, got {self.consecutive_failures}")
        if self.base_ejection_s <= 0:
            raise ValueError(f"the base ejection time must be > 0, got {self.base_ejection_s}")
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError(
                f"the longest ejection ({self.max_ejection_s}) must be >= the base ({self.base_ejection_s})"
            )
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError(f"the ejection percentage must be in 0..100, got {self.max_ejection_percent}")


@dataclass(frozen=True)
class Ejection:
    """A pod taken out of routing until `until` (the clock's time), for `seconds`, its `count`-th
    ejection in a row (after decay), after `failures` consecutive failures."""

    pod: str
    until: float
    seconds: float
    count: int
    failures: int


@dataclass
class _Record:
    failures: int = 0  # consecutive, since the last success or ejection
    ejections: int = 0  # the backoff multiplier
    ejected_until: float = 0.0


def max_ejected(pods: int, percent: float) -> int:
    """How many of a model's `pods` may be ejected at once."""
    if percent <= 0 or pods < 2:
        return 0
    return min(pods - 1, max(1, math.floor(pods * percent / 100 + 1e-9)))


class OutlierDetector:
    def __init__(self, settings: OutlierSettings | None = None) -> None:
        self.settings = settings or OutlierSettings()
        self._pods: dict[str, _Record] = {}

    def is_ejected(self, pod: str, now: float) -> bool:
        record = self._pods.get(pod)
        return record is not None and record.ejected_until > now

    def ejected(self, pods: Collection[str], now: float) -> list[str]:
        return [p for p in pods if self.is_ejected(p, now)]

    def success(self, pod: str) -> None:
        record = self._pods.get(pod)
        if record is not None:
            record.failures = 0

    def failure(self, pod: str, now: float, pods: Collection[str]) -> Ejection | None:
        """Count a failure of `pod`, one of the model's `pods`; the ejection it causes, if any."""
        s = self.settings
        record = self._pods.setdefault(pod, _Record())
        if record.ejected_until > now:
            return None  # already out: a request sent before the ejection
        record.failures += 1
        if record.failures < s.consecutive_failures:
            return None
        others_out = len(self.ejected([p for p in pods if p != pod], now))
        if others_out + 1 > max_ejected(len(pods), s.max_ejection_percent):
            return None
        if record.ejections:  # one off for every base period it has been back in routing
            back_for = max(0.0, now - record.ejected_until)
            record.ejections = max(0, record.ejections - math.floor(back_for / s.base_ejection_s))
        record.ejections += 1
        seconds = min(s.max_ejection_s, s.base_ejection_s * record.ejections)
        record.ejected_until = now + seconds
        failures, record.failures = record.failures, 0
        return Ejection(pod, record.ejected_until, seconds, record.ejections, failures)

    def forget(self, pod: str) -> None:
        """`pod` left the model: a new pod of the same name starts clean."""
        self._pods.pop(pod, None)
