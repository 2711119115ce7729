"""Scaling targets: the InferenceModel's `spec.autoscaling` block plus the policy's tuning knobs.

The spec fields and their defaults come from the shared InferenceModel API (`kvpilot.api.models`,
docs/crd-contract.md); the knobs (tolerance, rate limits, burst
mode) are the autoscaler's own defaults, settable from the command line and the simulator.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from kvpilot.api.models import (
    DEFAULT_ATTAINMENT_TARGET,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_SCALE_DOWN_STABILIZATION_S,
    DEFAULT_SCALE_UP_STABILIZATION_S,
    DEFAULT_TARGET_KV_CACHE_UTILIZATION,
    DEFAULT_TARGET_QUEUE_DEPTH,
    DEFAULT_TPOT_S,
    DEFAULT_TTFT_PREFILL_FACTOR,
    DEFAULT_TTFT_S,
)
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.slo import OutputCdf, Slo

MetricsSourceName = Literal["pods", "prometheus"]


@dataclass(frozen=True)
class ScalingRule:
    """At most max(pods, percent% of the replicas at the start of the period) per period_s.

    Same shape as an HPA behavior policy with selectPolicy: Max.
    """

    pods: int
    percent: float
    period_s: float


@dataclass(frozen=True)
class Behavior:
    """Policy knobs that are not in the CRD. Defaults were tuned on benchmarks/traces (docs/autoscaler.md)."""

    tolerance: float = 0.1
    scale_up: ScalingRule = ScalingRule(pods=4, percent=100.0, period_s=15.0)
    scale_down: ScalingRule = ScalingRule(pods=1, percent=0.0, period_s=60.0)
    # ... or this share of the surplus over the size the recommendations ask (policy.scale_down_limit),
    # whichever is more: far above the size asked (a backlog's replicas once it drained) the fleet
    # comes down in a few periods, near it one replica a period as scale_down says. 0: scale_down alone.
    scale_down_surplus_share: float = 0.5
    # Burst mode: skip the up window and jump further when the fleet is saturated and queueing.
    burst_kv_threshold: float = 0.95
    # ... or when the queue grows by at least this many requests per ready replica per second.
    burst_queue_growth_per_replica_s: float = 0.2
    burst_scale_up: ScalingRule = ScalingRule(pods=8, percent=200.0, period_s=15.0)
    # How the queue turns into replicas (see policy.py): "absorb" (default: all waiting requests, at
    # the rate a replica absorbs them), "least-loaded" (only what the least-loaded replica's queue
    # says about the arrival share: cheaper, but it leaves the backlog on round-robin-routed replicas
    # where it is) or the plain HPA "average".
    queue_recommendation: Literal["absorb", "least-loaded", "average"] = "absorb"
    # Extra headroom factor on the recommendation in burst mode (1.5 = ask for 50% more).
    burst_factor: float = 1.5
    # Below target the utilization recommendation is n * (u / target) ** exponent. 1 is the HPA's
    # proportional rule; 0.5 (default) takes utilization to grow as the square of per-replica load,
    # as KV use of a decode-bound replica does between ~30% and ~90% of its capacity: the proportional
    # rule removed twice the replicas it should and then scaled back up (docs/autoscaler.md).
    scale_down_exponent: float = 0.5
    # Arrival-rate recommendation (policy.measure_arrivals / forecast_arrivals): replicas for the
    # arrival rate forecast arrival_lead_s ahead (the latest rate plus a rising least-squares trend
    # over the last arrival_trend_window_s, never more than arrival_max_growth x the latest rate),
    # at the rate one replica sustains at the utilization target, times arrival_headroom. The
    # arrival rate is completions (a per-pod counter) plus the change in waiting + running between
    # syncs. Combined as the max with the other recommendations; without the counter it is absent.
    # On by default: in the simulator it raised SLO attainment on all three traces at both startup
    # times, with fewer replica-hours on two of them (docs/autoscaler.md, Results).
    arrival_rate: bool = True
    arrival_lead_s: float = 60.0
    arrival_trend_window_s: float = 180.0
    arrival_headroom: float = 1.0
    arrival_max_growth: float = 2.0
    # Below the target, the rate one replica sustains at the target is taken as its completion rate
    # now x (target / utilization) ** this (1: utilization proportional to load; 0.5: as
    # scale_down_exponent, quadratic).
    arrival_service_exponent: float = 0.5

    # The closed loop on measured SLO attainment (feedback.py; with spec.autoscaling.slo): the window
    # the attainment is measured over, the fewest requests it judges on, the growth per budget of
    # shortfall and at most, the share of the miss budget kept free before scaling down, and how fast
    # the measured capacity bounds move per sync (probe up with headroom, down below target).
    slo_feedback: bool = True
    attainment_window_s: float = 120.0
    attainment_min_requests: float = 20.0
    feedback_gain: float = 0.1
    feedback_max_step: float = 0.5
    attainment_headroom: float = 0.5
    capacity_relax: float = 0.03
    # Surge headroom (surge.py): after the arrival rate shifted level (by surge_shift_ratio or more
    # within one reaction, beyond noise) in the last surge_window_s, keep the replicas that serve the
    # surge_quantile of that window's per-minute rates. Off: follow the measured rate only.
    surge_headroom: bool = True
    surge_window_s: float = 1800.0
    surge_shift_ratio: float = 3.0
    surge_quantile: float = 0.7
    # Redundancy (redundancy.py): while the forecast load needs at least redundancy_load of one
    # replica, at least redundancy_replicas replicas (1: off).
    redundancy_replicas: int = 2
    redundancy_load: float = 0.5

    def __post_init__(self) -> None:
        if self.attainment_window_s <= 0 or self.attainment_min_requests < 1:
            raise ValueError("attainment_window_s must be > 0 and attainment_min_requests >= 1")
        if not (self.feedback_gain > 0 and 0 < self.feedback_max_step <= 4):
            raise ValueError("feedback_gain must be > 0 and feedback_max_step in (0, 4]")
        if not (0 <= self.attainment_headroom < 1 and 0 <= self.capacity_relax <= 1):
            raise ValueError("attainment_headroom must be in [0, 1) and capacity_relax in [0, 1]")
        if self.surge_window_s <= 0 or self.surge_shift_ratio <= 1 or not 0 < self.surge_quantile <= 1:
            raise ValueError("surge_window_s must be > 0, surge_shift_ratio > 1, surge_quantile in (0, 1]")
        if self.arrival_lead_s < 0 or self.arrival_trend_window_s < 0:
            raise ValueError("arrival_lead_s and arrival_trend_window_s must be >= 0")
        if not 0 <= self.scale_down_surplus_share <= 1:
            raise ValueError("scale_down_surplus_share must be in [0, 1]")
        if self.redundancy_replicas < 1 or self.redundancy_load < 0:
            raise ValueError("redundancy_replicas must be >= 1 and redundancy_load >= 0")
        if self.arrival_headroom <= 0 or self.arrival_max_growth < 1:
            raise ValueError("arrival_headroom must be > 0 and arrival_max_growth >= 1")


@functools.lru_cache(maxsize=4096)
def _capacity(
    cal: Calibration,
    slo: Slo,
    prompt: float,
    output: float,
    utilization: float,
    tail_budget: float | None,
    output_cdf: OutputCdf | None,
) -> float:
    from kvpilot.autoscaler.slo import replica_capacity

    return replica_capacity(cal, slo, prompt, output, utilization, tail_budget, output_cdf)


@dataclass(frozen=True)
class SloTargets:
    """spec.autoscaling.slo: size the fleet for the observed arrival rate and token mix at what one
    replica serves within the SLO (slo.replica_capacity on the replica model `calibration`)."""

    calibration: Calibration
    calibration_name: str = ""
    ttft_s: float = DEFAULT_TTFT_S
    tpot_s: float = DEFAULT_TPOT_S
    ttft_prefill_factor: float = DEFAULT_TTFT_PREFILL_FACTOR
    # Share of requests that must meet the SLO (spec.autoscaling.slo.attainmentTarget): what the
    # closed loop holds the measured attainment to.
    attainment_target: float = DEFAULT_ATTAINMENT_TARGET
    # Steps are held to tpot_s x utilization: the rest absorbs bursts between syncs.
    utilization: float = 0.85
    # The share of requests the TPOT tail of short outputs may cost (slo.tpot_tail_share, e.g.
    # slo.DEFAULT_TPOT_TAIL_BUDGET); None (default): the mean step only. Off by default: on the Mooncake
    # trace it buys attainment for more replica-hours than a static fleet would (docs/autoscaler.md).
    tpot_tail_budget: float | None = None
    # The workload's output lengths, ((tokens, P(output <= tokens)), ...), when known (from logs or a
    # trace). None: measured from the replicas' output-length histogram once MIN_OUTPUT_CDF_REQUESTS
    # generations finished (policy.decide), else geometric with the observed mean output
    # (slo.output_share_at_most). A configured one wins over the measurement.
    output_cdf: OutputCdf | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError("slo utilization must be in (0, 1]")
        if self.tpot_tail_budget is not None and not 0.0 < self.tpot_tail_budget < 1.0:
            raise ValueError("slo tpot_tail_budget must be in (0, 1)")
        if self.output_cdf is not None:
            from kvpilot.autoscaler.slo import output_share_at_most

            output_share_at_most(1.0, self.output_cdf)  # validates it
        Slo(self.ttft_s, self.tpot_s, self.ttft_prefill_factor)  # validates the targets
        if not 0.5 <= self.attainment_target < 1.0:
            raise ValueError("slo attainment_target must be in [0.5, 1)")

    @property
    def slo(self) -> Slo:
        return Slo(self.ttft_s, self.tpot_s, self.ttft_prefill_factor)

    def capacity(self, mean_prompt: float, mean_output: float) -> float:
        """Requests/s one replica serves at this token mix within the SLO (memoized on the mix,
        rounded to 2 significant figures)."""

        def r2(x: float) -> float:
            return float(f"{max(1.0, x):.2g}")

        return _capacity(
            self.calibration,
            self.slo,
            r2(mean_prompt),
            r2(mean_output),
            self.utilization,
            self.tpot_tail_budget,
            self.output_cdf,
        )

    @classmethod
    def from_spec(cls, block: Mapping[str, Any]) -> SloTargets:
        """spec.autoscaling.slo: {calibration: GPU/MODEL[/DTYPE][/tpN], ttftSeconds, tpotSeconds,
        ttftPrefillFactor, attainmentTarget, tpotTailBudget}. An unknown calibration name raises ValueError listing the known ones."""
        from kvpilot.autoscaler.replica_model import calibration_by_name

        name = str(block.get("calibration", ""))
        budget = block.get("tpotTailBudget")
        return cls(
            calibration=calibration_by_name(name),
            calibration_name=name,
            ttft_s=float(block.get("ttftSeconds", DEFAULT_TTFT_S)),
            tpot_s=float(block.get("tpotSeconds", DEFAULT_TPOT_S)),
            ttft_prefill_factor=float(block.get("ttftPrefillFactor", DEFAULT_TTFT_PREFILL_FACTOR)),
            attainment_target=float(block.get("attainmentTarget", DEFAULT_ATTAINMENT_TARGET)),
            tpot_tail_budget=None if budget is None else float(budget),
        )


@dataclass(frozen=True)
class ScalingTargets:
    """Everything the pure policy needs to know about what the user asked for."""

    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = 1
    target_kv_cache_utilization: float = DEFAULT_TARGET_KV_CACHE_UTILIZATION
    target_queue_depth: float = DEFAULT_TARGET_QUEUE_DEPTH
    scale_up_stabilization_s: float = float(DEFAULT_SCALE_UP_STABILIZATION_S)
    scale_down_stabilization_s: float = float(DEFAULT_SCALE_DOWN_STABILIZATION_S)
    behavior: Behavior = Behavior()
    # Batch slots per replica (the runtime's max_num_seqs), when known: running / max_num_seqs counts
    # as utilization alongside KV use, so a replica whose batch is full is not read as idle.
    max_num_seqs: int | None = None
    # SLO planner (spec.autoscaling.slo): replicas for the forecast arrival rate at the replica's
    # capacity within the SLO, in place of the completion-rate service estimate; the KV and queue
    # rules stay as a floor.
    slo: SloTargets | None = None
    # Declared replica startup (pod created -> Ready; spec.autoscaling.startupSeconds), seconds, used
    # until one is measured from the pods (MetricsSnapshot.startup_s); None: unknown, the policy does
    # not plan for it.
    startup_s: float | None = None

    def __post_init__(self) -> None:
        if self.startup_s is not None and not (self.startup_s >= 0 and math.isfinite(self.startup_s)):
            raise ValueError("startup_s must be a finite number >= 0")
        if self.min_replicas < 0:
            raise ValueError("minReplicas must be >= 0")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError("maxReplicas must be >= 1 and >= minReplicas")
        if not 0.0 < self.target_kv_cache_utilization <= 1.0:
            raise ValueError("targetKVCacheUtilization must be in (0, 1]")
        if self.target_queue_depth <= 0:
            raise ValueError("targetQueueDepth must be > 0")
        if self.scale_up_stabilization_s < 0 or self.scale_down_stabilization_s < 0:
            raise ValueError("stabilization windows must be >= 0 seconds")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @property
    def history_horizon_s(self) -> float:
        """How far back the policy ever looks: the longest window or rate-limit period."""
        b = self.behavior
        return max(
            self.scale_up_stabilization_s,
            self.scale_down_stabilization_s,
            b.scale_up.period_s,
            b.scale_down.period_s,
            b.burst_scale_up.period_s,
        )

    @classmethod
    def from_spec(
        cls,
        autoscaling: Mapping[str, Any],
        behavior: Behavior | None = None,
        max_num_seqs: int | None = None,
    ) -> ScalingTargets:
        """Build from the CR's `spec.autoscaling` (camelCase keys, CRD defaults applied here too)."""
        min_r = int(autoscaling.get("minReplicas", DEFAULT_MIN_REPLICAS))
        slo_block = autoscaling.get("slo")
        return cls(
            min_replicas=min_r,
            max_replicas=int(autoscaling.get("maxReplicas", max(1, min_r))),
            target_kv_cache_utilization=float(
                autoscaling.get("targetKVCacheUtilization", DEFAULT_TARGET_KV_CACHE_UTILIZATION)
            ),
            target_queue_depth=float(autoscaling.get("targetQueueDepth", DEFAULT_TARGET_QUEUE_DEPTH)),
            scale_up_stabilization_s=float(
                autoscaling.get("scaleUpStabilizationSeconds", DEFAULT_SCALE_UP_STABILIZATION_S)
            ),
            scale_down_stabilization_s=float(
                autoscaling.get("scaleDownStabilizationSeconds", DEFAULT_SCALE_DOWN_STABILIZATION_S)
            ),
            behavior=behavior or Behavior(),
            max_num_seqs=max_num_seqs,
            slo=SloTargets.from_spec(slo_block) if slo_block else None,
            startup_s=None
            if autoscaling.get("startupSeconds") is None
            else float(autoscaling["startupSeconds"]),
        )

    def with_overrides(self, **changes: Any) -> ScalingTargets:
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"unknown scaling target(s): {', '.join(sorted(unknown))}")
        return replace(self, **changes)
