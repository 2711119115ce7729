"""What one simulation run measured (SimResult), as the simulator's CLI and benchmarks print it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.autoscaler.slo import Slo


@dataclass
class SimResult:
    policy: str
    slo: Slo
    slo_attainment: float
    replica_hours: float
    scale_events: int
    requests: int
    rejected: int
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    prefix_hit_rate: float  # share of the measured requests' prompt tokens found in a prefix cache
    ttft_attainment: float  # share meeting the TTFT target alone
    preemptions: int
    peak_replicas: int
    mean_replicas: float
    window_s: tuple[float, float]
    settings: dict[str, Any]
    # The lowest SLO attainment of any minute (with at least MIN_MINUTE_REQUESTS requests) after the
    # warmup: what "provisioned for the peak" is held to.
    worst_minute_attainment: float = 1.0
    throughput_tokens_s: float = 0.0  # output tokens of requests finished in the window, per second
    last_finish_s: float = 0.0  # when the last measured request finished (a batch's makespan)

    @property
    def slo_ttft_s(self) -> float:
        return self.slo.ttft_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "slo_ttft_s": self.slo.ttft_s,
            "slo_tpot_s": self.slo.tpot_s,
            "slo_ttft_prefill_factor": self.slo.ttft_prefill_factor,
            "slo_attainment": round(self.slo_attainment, 5),
            "ttft_attainment": round(self.ttft_attainment, 5),
            "replica_hours": round(self.replica_hours, 3),
            "scale_events": self.scale_events,
            "requests": self.requests,
            "rejected": self.rejected,
            "ttft_p50_s": round(self.ttft_p50_s, 3),
            "ttft_p95_s": round(self.ttft_p95_s, 3),
            "ttft_p99_s": round(self.ttft_p99_s, 3),
            "tpot_p50_s": round(self.tpot_p50_s, 4),
            "tpot_p99_s": round(self.tpot_p99_s, 4),
            "prefix_hit_rate": round(self.prefix_hit_rate, 4),
            "throughput_tokens_s": round(self.throughput_tokens_s, 1),
            "last_finish_s": round(self.last_finish_s, 3),
            "preemptions": self.preemptions,
            "peak_replicas": self.peak_replicas,
            "mean_replicas": round(self.mean_replicas, 2),
            "worst_minute_attainment": round(self.worst_minute_attainment, 5),
            "window_s": [round(self.window_s[0], 3), round(self.window_s[1], 3)],
            "settings": self.settings,
        }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[idx]
