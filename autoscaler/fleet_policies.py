"""The policies the simulator compares, behind one small interface (simulator.FleetPolicy).

- KvpilotPolicy: policy.decide(), the same function the controller calls, with its history.
- StaticPolicy: a fixed fleet (size it with size_static_for_slo: the smallest that meets the SLO).
- MovingAveragePolicy: KubeAI-style: desired = ceil(mean in-flight requests over a window / target).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict
from typing import Any

from kvpilot.autoscaler.policy import History, decide
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.spec import ScalingTargets


class KvpilotPolicy:
    name = "kvpilot"

    def __init__(self, targets: ScalingTargets, initial: int | None = None) -> None:
        self.targets = targets
        self.history = History()
        self._initial = targets.min_replicas if initial is None else initial
        self.last_reason = ""

    def initial_replicas(self) -> int:
        return self._initial

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        d = decide(current, snapshot, self.targets, self.history, now)
        self.history = d.history
        self.last_reason = d.reason
        return d.desired

    def settings(self) -> dict[str, Any]:
        out = asdict(self.targets)
        out["initial_replicas"] = self._initial
        return out


class StaticPolicy:
    name = "static"

    def __init__(self, replicas: int, sizing: str = "given") -> None:
        self.replicas = replicas
        self.sizing = sizing

    def initial_replicas(self) -> int:
        return self.replicas

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        return self.replicas

    def settings(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "sizing": self.sizing}


class MovingAveragePolicy:
    """Request-count autoscaling as KubeAI does it: average the model's in-flight requests (running
    plus queued) over a sliding window, then desired = ceil(average / target requests per replica)."""

    name = "moving-average"

    def __init__(
        self,
        target_requests: float,
        window_s: float = 600.0,
        min_replicas: int = 1,
        max_replicas: int = 100,
        initial: int | None = None,
    ) -> None:
        if target_requests <= 0:
            raise ValueError("target_requests must be > 0")
        self.target_requests = target_requests
        self.window_s = window_s
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self._initial = min_replicas if initial is None else initial
        self._samples: deque[tuple[float, int]] = deque()

    def initial_replicas(self) -> int:
        return self._initial

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        self._samples.append((now, in_flight))
        while self._samples and now - self._samples[0][0] >= self.window_s:
            self._samples.popleft()
        avg = sum(v for _, v in self._samples) / len(self._samples)
        desired = math.ceil(avg / self.target_requests - 1e-9)
        return min(max(desired, self.min_replicas), self.max_replicas)

    def settings(self) -> dict[str, Any]:
        return {
            "target_requests": self.target_requests,
            "window_s": self.window_s,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self._initial,
        }
