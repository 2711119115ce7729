"""Redundancy (autoscaler/redundancy.py): a busy model is not served by one replica."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import KvpilotPolicy
from kvpilot.autoscaler.policy import ArrivalState, History, PodCounter, RateSample, decide
from kvpilot.autoscaler.redundancy import Redundancy, redundancy
from kvpilot.autoscaler.replica_model import calibration_by_name
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.sim_result import SimResult
from kvpilot.autoscaler.simulator import ROUTERS, FleetSimulator
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.spec import Behavior, ScalingTargets, SloTargets
from kvpilot.autoscaler.state import decision_to_status, history_from_status
from kvpilot.autoscaler.trace import TraceRequest, shift_mix

NOW = 1_000_000.0


@pytest.mark.parametrize(
    ("rate", "per_replica", "replicas", "max_replicas", "want"),
    [
        (3.0, 5.0, 2, 10, 2),  # 0.6 of one replica: two
        (2.5, 5.0, 2, 10, 2),  # exactly the threshold
        (2.4, 5.0, 2, 10, None),  # below it: what the other signals ask
        (0.0, 5.0, 2, 10, None),  # idle (scale to zero stays possible)
        (None, 5.0, 2, 10, None),  # no rate measured
        (3.0, None, 2, 10, None),  # no per-replica rate
        (3.0, 5.0, 1, 10, None),  # the rule off
        (3.0, 5.0, 3, 10, 3),
        (3.0, 5.0, 2, 1, 1),  # never past maxReplicas
    ],
)
def test_redundancy_applies_from_a_share_of_one_replica(
    rate: float | None, per_replica: float | None, replicas: int, max_replicas: int, want: int | None
):
    r = redundancy(rate, per_replica, replicas, 0.5, max_replicas)
    assert (None if r is None else r.replicas) == want


def _one_replica(rate: float, pods: str = "a") -> tuple[MetricsSnapshot, History]:
    """`pods` serving `rate` requests/s in all, each sustaining 5/s (the measured service rate)."""
    each = rate * 15.0 / len(pods)
    snap = MetricsSnapshot(
        ready_replicas=len(pods), samples=tuple(ReplicaSample(p, 0.1, 0, 1, each) for p in pods)
    )
    rates = tuple(RateSample(NOW - 60 + 15 * i, rate) for i in range(4))
    counters = tuple(PodCounter(p, 0.0, 1) for p in pods)
    return snap, History(arrivals=ArrivalState(NOW - 15, counters, rates, service_rate=5.0))


def test_decide_keeps_a_second_replica_for_a_busy_model_and_names_the_signal():
    t = ScalingTargets(min_replicas=1, max_replicas=10, scale_down_stabilization_s=0.0)
    snap, history = _one_replica(3.0)
    d = decide(1, snap, t, history, NOW)
    assert d.desired == 2 and d.signal == "redundancy", d.reason
    assert (
        "; redundancy: 2 replicas while serving 3.00/s (0.60 of one replica's 5.00/s): held at 2, not 1"
        in d.reason
    )
    # two replicas at the same load: a scale-down to one is what the other signals ask; not taken
    snap2, history2 = _one_replica(3.0, "ab")
    d2 = decide(2, snap2, t, history2, NOW)
    assert d2.desired == 2 and d2.signal == "redundancy", d2.reason
    # a quiet model, the rule off, or maxReplicas 1: one replica
    quiet, qh = _one_replica(1.0)
    assert decide(1, quiet, t, qh, NOW).desired == 1
    off = ScalingTargets(
        min_replicas=1,
        max_replicas=10,
        scale_down_stabilization_s=0.0,
        behavior=Behavior(redundancy_replicas=1),
    )
    assert decide(1, snap, off, history, NOW).desired == 1
    one = ScalingTargets(min_replicas=1, max_replicas=1, scale_down_stabilization_s=0.0)
    assert decide(1, snap, one, history, NOW).desired == 1


def test_the_floor_is_held_through_the_scale_down_window_not_dropped_at_the_next_sync():
    """Two replicas at 2.4/s, below the floor's 2.5/s: the floor that applied 60 s ago is held (the
    scale-down window is 120 s) and named; one that applied 150 s ago, or never, is not."""
    t = ScalingTargets(min_replicas=1, max_replicas=10, scale_down_stabilization_s=120.0)
    snap, history = _one_replica(2.4, "ab")
    assert decide(2, snap, t, history, NOW).desired == 1
    floor = Redundancy(2, 2.6, 5.0)
    d = decide(2, snap, t, replace(history, redundancy=(NOW - 60.0, floor)), NOW)
    assert d.desired == 2 and d.signal == "redundancy", d.reason
    assert (
        "redundancy: 2 replicas, held for the scale-down window (120s): the load needed them 60s ago"
        in d.reason
    )
    assert d.history.redundancy == (NOW - 60.0, floor)  # held, not renewed
    assert decide(2, snap, t, replace(history, redundancy=(NOW - 150.0, floor)), NOW).desired == 1


def test_a_load_falling_through_the_floor_does_not_flap():
    """3/s on one replica (the floor starts a second), then 2.4/s for five minutes: the fleet stays at
    two until a scale-down window after the last sync whose load needed them, then goes to one, once.
    The history goes through the status between syncs, as the controller keeps it."""
    t = ScalingTargets(min_replicas=1, max_replicas=10, scale_down_stabilization_s=120.0)
    snap, history = _one_replica(3.0)
    d = decide(1, snap, t, history, NOW)
    assert d.desired == 2 and d.signal == "redundancy", d.reason
    hist = history_from_status(json.loads(json.dumps(decision_to_status(d, NOW, None))))
    assert d.history.redundancy is not None and hist.redundancy == d.history.redundancy
    current, done = 2, {"a": 45.0, "b": 0.0}
    sizes: list[tuple[float, int, str]] = [(0.0, 2, d.reason)]
    for k in range(1, 21):
        done = {p: c + 2.4 * 15.0 / 2 for p, c in done.items()}
        step = MetricsSnapshot(
            ready_replicas=current,
            samples=tuple(ReplicaSample(p, 0.1, 0, 1, c) for p, c in list(done.items())[:current]),
        )
        d = decide(current, step, t, hist, NOW + 15.0 * k)
        sizes.append((15.0 * k, d.desired, d.reason))
        current = d.desired
        hist = history_from_status(json.loads(json.dumps(decision_to_status(d, NOW + 15.0 * k, None))))
    ns = [n for _, n, _ in sizes]
    assert ns[-1] == 1 and ns == sorted(ns, reverse=True), sizes  # 2 ... 2, 1 ... 1: one step down
    last_needed = max(at for at, _, reason in sizes if "replicas while serving" in reason)
    first_one = min(at for at, n, _ in sizes if n == 1)
    assert first_one - last_needed > 120.0, sizes
    assert any("held for the scale-down window" in reason for _, n, reason in sizes if n == 2)


def test_behavior_rejects_a_redundancy_it_cannot_apply():
    with pytest.raises(ValueError, match="redundancy_replicas"):
        Behavior(redundancy_replicas=0)
    with pytest.raises(ValueError, match="redundancy_load"):
        Behavior(redundancy_load=-0.1)


def _simulate(
    trace: list[TraceRequest], cal: Calibration, replicas: int
) -> tuple[SimResult, list[tuple[float, int, str]]]:
    """The closed-loop policy on `trace` with Behavior(redundancy_replicas=replicas): the result and
    every decision (time, fleet size, reason)."""
    targets = ScalingTargets(
        min_replicas=1,
        max_replicas=30,
        max_num_seqs=cal.max_num_seqs,
        slo=SloTargets(cal, "h100/llama-3.1-8b"),
        behavior=Behavior(redundancy_replicas=replicas),
    )
    policy = KvpilotPolicy(targets)
    decisions: list[tuple[float, int, str]] = []
    decide_ = policy.decide

    def logged(now: float, current: int, *args: Any) -> int:
        d = decide_(now, current, *args)
        decisions.append((now, current, policy.last_reason))
        return d

    policy.decide = logged  # type: ignore[method-assign]
    sim = FleetSimulator(trace, policy, cal, slo=Slo(), router=ROUTERS["router:kv-aware"](), warmup_s=0.0)
    return sim.run(), decisions


def test_the_simulated_fleet_meets_a_heavier_mix_on_two_replicas_not_one():
    """20 minutes of 3 requests/s whose prompts triple at half time (4k -> 12k tokens, the same
    rate): one replica serves the light half at ~0.55 of its modelled capacity. Alone, it meets the
    shift with a queue for a sync and a startup; with the redundancy floor a second replica is
    already there (the simulated router judges every request with api/slo.judge)."""
    cal = replace(calibration_by_name("h100/llama-3.1-8b"), startup_s=10)
    rng, t, trace = random.Random(7), 0.0, []
    while t < 1200.0:
        t += rng.expovariate(3.0)
        trace.append(TraceRequest(t, int(12000 * rng.uniform(0.5, 1.5)), int(rng.uniform(100, 300))))
    trace = shift_mix(trace, 3.0, 600.0)
    alone, alone_log = _simulate(trace, cal, 1)
    floor, floor_log = _simulate(trace, cal, 2)
    # one replica served the light half; at the shift its worst minute lost nearly half its requests
    # (0.56, 97.3% over the run: the backlog is sized for the prompts admitted, arrivals.backlog_mix)
    assert {n for at, n, _ in alone_log if 540.0 < at < 600.0} == {1}
    assert alone.worst_minute_attainment < 0.6 and alone.slo_attainment < 0.98
    # two, held by the floor (the other signals asked for one), and the run meets its target
    held = [(n, reason) for at, n, reason in floor_log if 540.0 < at < 600.0]
    assert {n for n, _ in held} == {2} and all("[signal: redundancy]" in r for _, r in held)
    assert floor.worst_minute_attainment > 0.8 and floor.slo_attainment >= 0.99
