"""The SLO planner in policy.decide (spec.autoscaling.slo), its state in the status, and its spec."""

from __future__ import annotations

import pytest

from kvpilot.autoscaler.policy import ArrivalState, History, PodCounter, decide, measure_token_mix
from kvpilot.autoscaler.replica_model import UnknownCalibration, calibration_by_name
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.slo import Slo, replica_capacity
from kvpilot.autoscaler.spec import ScalingTargets, SloTargets
from kvpilot.autoscaler.state import arrivals_from_status, arrivals_to_status

NOW = 1_000_000.0
SLO = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 2, "tpotSeconds": 0.05}


def sample(
    pod: str, done: float, prompt: float, output: float, kv: float = 0.2, running: int = 20
) -> ReplicaSample:
    return ReplicaSample(
        pod, kv, 0, running, done, prompt_tokens_total=prompt, generation_tokens_total=output
    )


def previous(
    pods: int, done: float = 1000.0, prompt: float = 1000.0 * 2000, output: float = 1000.0 * 200
) -> History:
    counters = tuple(PodCounter(f"p{i}", done, 20, prompt, output) for i in range(pods))
    return History(arrivals=ArrivalState(time=NOW - 15.0, counters=counters))


def test_token_mix_from_counters():
    prev = previous(2).arrivals
    snap = MetricsSnapshot(
        2,
        (
            sample("p0", 1010, 2_000_000 + 30_000, 200_000 + 1_000),
            sample("p1", 1010, 2_000_000 + 10_000, 200_000 + 3_000),
        ),
    )
    assert measure_token_mix(snap, prev) == (2000.0, 200.0)
    none = MetricsSnapshot(
        2, (ReplicaSample("p0", 0.2, 0, 20, 1010.0), ReplicaSample("p1", 0.2, 0, 20, 1010.0))
    )
    assert measure_token_mix(none, prev) is None  # no token counters


def test_planner_sizes_for_arrivals_at_the_slo_capacity():
    targets = ScalingTargets.from_spec({"minReplicas": 1, "maxReplicas": 50, "slo": SLO}, max_num_seqs=256)
    cap = replica_capacity(calibration_by_name("h100/llama-3.1-8b"), Slo(2, 0.05), 2000, 200, 0.85)
    # 4 replicas each finished 150 requests in 15 s (10/s each, 40/s in all) of 2000 + 200 tokens.
    samples = tuple(sample(f"p{i}", 1150, 2_000_000 + 150 * 2000, 200_000 + 150 * 200) for i in range(4))
    d = decide(4, MetricsSnapshot(4, samples), targets, previous(4), NOW)
    assert d.token_mix == (2000.0, 200.0)
    assert d.slo_capacity == pytest.approx(cap, rel=0.05)
    assert d.slo_recommendation == pytest.approx(40.0 / d.slo_capacity, abs=1.0)
    assert (
        d.desired == d.slo_recommendation and "slo planner" in d.reason
    )  # no earlier recommendation holds it
    # Longer prompts: the same arrival rate needs more replicas.
    long = tuple(sample(f"p{i}", 1150, 2_000_000 + 150 * 12_000, 200_000 + 150 * 200) for i in range(4))
    d2 = decide(4, MetricsSnapshot(4, long), targets, previous(4), NOW)
    assert d2.slo_recommendation is not None and d2.slo_recommendation > (d.slo_recommendation or 0)


def test_planner_scales_down_when_traffic_falls_but_kv_rule_is_a_floor():
    targets = ScalingTargets.from_spec(
        {"minReplicas": 1, "maxReplicas": 50, "slo": SLO, "scaleDownStabilizationSeconds": 0},
        max_num_seqs=256,
    )
    quiet = tuple(
        sample(f"p{i}", 1001, 2_000_000 + 2000, 200_000 + 200, kv=0.05, running=1) for i in range(8)
    )
    d = decide(8, MetricsSnapshot(8, quiet), targets, previous(8), NOW)
    assert d.slo_recommendation in (0, 1) and d.desired == 7  # the scale-down rate limit: -1 per 60 s
    # KV far above target: the reactive rule keeps the fleet (and asks for more).
    full = tuple(
        sample(f"p{i}", 1001, 2_000_000 + 2000, 200_000 + 200, kv=0.99, running=200) for i in range(8)
    )
    d = decide(8, MetricsSnapshot(8, full), targets, previous(8), NOW)
    assert d.desired > 8


def test_missing_metrics_never_scale_down_with_the_planner():
    targets = ScalingTargets.from_spec(
        {"minReplicas": 1, "maxReplicas": 50, "slo": SLO, "scaleDownStabilizationSeconds": 0},
        max_num_seqs=256,
    )
    quiet = tuple(
        sample(f"p{i}", 1001, 2_000_000 + 2000, 200_000 + 200, kv=0.05, running=1) for i in range(4)
    )
    d = decide(8, MetricsSnapshot(8, quiet), targets, previous(8), NOW)  # 4 of 8 ready replicas report
    assert d.desired == 8
    assert decide(8, MetricsSnapshot(8, ()), targets, previous(8), NOW).desired == 8


def test_planner_needs_the_token_mix():
    targets = ScalingTargets.from_spec({"minReplicas": 1, "maxReplicas": 50, "slo": SLO}, max_num_seqs=256)
    samples = tuple(ReplicaSample(f"p{i}", 0.3, 0, 20, 1150.0) for i in range(4))  # no token counters
    d = decide(4, MetricsSnapshot(4, samples), targets, previous(4), NOW)
    assert d.slo_recommendation is None and d.token_mix is None


def test_slo_spec_and_status_round_trip():
    t = SloTargets.from_spec({"calibration": "h200/mixtral-8x7b", "tpotSeconds": 0.1})
    assert (t.ttft_s, t.tpot_s, t.calibration_name) == (2.0, 0.1, "h200/mixtral-8x7b")
    with pytest.raises(UnknownCalibration, match="unknown GPU 'b300'"):
        SloTargets.from_spec({"calibration": "b300/llama-3.1-8b"})
    state = ArrivalState(
        time=NOW, counters=(PodCounter("p0", 5.0, 2, 1000.0, 50.0),), token_mix=(512.5, 64.0)
    )
    back = arrivals_from_status(arrivals_to_status(state))
    assert back.counters == state.counters and back.token_mix == state.token_mix
