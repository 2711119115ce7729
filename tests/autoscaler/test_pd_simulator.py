"""The P/D fleet simulator (autoscaler/pd_simulator.py) on the Mooncake head: long prompts, short outputs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.pd_policy import PdKvpilotPolicy, PdSnapshot, PdTargets
from kvpilot.autoscaler.pd_simulator import PdFleetSimulator, PdStaticPolicy, pulled_tokens, simulate_pd
from kvpilot.autoscaler.replica_model import calibration_by_name
from kvpilot.autoscaler.sim_result import SimResult
from kvpilot.autoscaler.simulator import simulate
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.spec import ScalingTargets, SloTargets
from kvpilot.autoscaler.trace import TraceRequest, load_trace

TRACE = load_trace(Path(__file__).parent / "data" / "mooncake_synthetic_head200.jsonl")
CAL = calibration_by_name("h100/llama-3.1-8b")
SLO = Slo(ttft_s=2.0, tpot_s=0.05, ttft_prefill_factor=2.0)


def tpot_missed_share(r: SimResult) -> float:
    """Requests that met the TTFT target but missed TPOT."""
    return r.ttft_attainment - r.slo_attainment


def test_pd_removes_the_tpot_misses_of_long_prompt_traffic():
    # Four replicas either way: aggregated, short decodes share steps with 8k-token prefill chunks.
    aggregated = simulate(TRACE, StaticPolicy(4), CAL, slo=SLO, warmup_s=0)
    pd = simulate_pd(TRACE, PdStaticPolicy(3, 1), CAL, slo=SLO, warmup_s=0)
    assert tpot_missed_share(aggregated) > 0.1
    assert tpot_missed_share(pd) == 0.0
    assert pd.tpot_p99_s < SLO.tpot_s < aggregated.tpot_p99_s
    assert pd.slo_attainment > aggregated.slo_attainment
    info = pd.settings["disaggregation"]
    short = sum(1 for r in TRACE if r.prompt_tokens < 512)
    assert info["direct"] == short and info["transfers"] == len(TRACE) - short
    assert pd.settings["role_replica_hours"]["prefill"] == pytest.approx(3 * pd.replica_hours / 4, abs=1e-4)


def test_transfer_time_is_bytes_over_the_link():
    one = [TraceRequest(0.0, 16_001, 4)]
    fast = simulate_pd(one, PdStaticPolicy(1, 1), CAL, slo=SLO, warmup_s=0)
    slow_cal = replace(CAL, kv_link_bytes_s=CAL.kv_link_bytes_s / 4)
    slow = simulate_pd(one, PdStaticPolicy(1, 1), slow_cal, slo=SLO, warmup_s=0)
    pulled = pulled_tokens(16_001, CAL.block_size)
    assert pulled == 16_000
    seconds = pulled * CAL.kv_bytes_per_token / CAL.kv_link_bytes_s
    assert fast.settings["disaggregation"]["transfer_gb"] == pytest.approx(
        pulled * CAL.kv_bytes_per_token / 1e9, rel=1e-3
    )
    # TTFT (arrival -> the decode replica's first token) grows by the extra transfer time exactly.
    assert slow.ttft_p50_s - fast.ttft_p50_s == pytest.approx(3 * seconds, rel=1e-3)


def test_a_prompt_below_the_threshold_runs_on_a_decode_replica():
    trace = [TraceRequest(0.0, 400, 8), TraceRequest(1.0, 600, 8)]
    sim = PdFleetSimulator(trace, PdStaticPolicy(1, 1), CAL, slo=SLO, warmup_s=0, min_prompt_tokens=512)
    r = sim.run()
    assert r.settings["disaggregation"]["direct"] == 1 and r.settings["disaggregation"]["transfers"] == 1
    prefill = [rep for rep in sim.replicas if rep.role == "prefill"]
    assert [rep.completed for rep in prefill] == [1]


def test_the_pd_autoscaler_wakes_both_roles_from_zero():
    targets = PdTargets(
        ScalingTargets(min_replicas=0, max_replicas=8, max_num_seqs=CAL.max_num_seqs, slo=SloTargets(CAL)),
        prefill_min=0, prefill_max=8, decode_min=0, decode_max=8,
    )  # fmt: skip
    policy = PdKvpilotPolicy(targets, initial=(0, 0))
    cal = replace(CAL, startup_s=10.0)
    r = simulate_pd(TRACE[:60], policy, cal, slo=SLO, warmup_s=0)
    assert r.rejected == 0
    assert r.peak_replicas >= 2
    assert "scale from zero" in policy.last_reason or r.scale_events >= 1
    assert r.settings["role_replica_hours"]["prefill"] > 0 and r.settings["role_replica_hours"]["decode"] > 0


def _auto(prefill_min: int, decode_min: int) -> PdKvpilotPolicy:
    targets = PdTargets(
        ScalingTargets(min_replicas=0, max_replicas=8, max_num_seqs=CAL.max_num_seqs, slo=SloTargets(CAL)),
        prefill_min=prefill_min, prefill_max=8, decode_min=decode_min, decode_max=8,
    )  # fmt: skip
    return PdKvpilotPolicy(targets, initial=(prefill_min, max(1, decode_min)))


def test_long_prompts_served_direct_are_counted_and_wake_prefill_from_zero():
    long = sum(1 for r in TRACE[:60] if r.prompt_tokens >= 512)
    sim = PdFleetSimulator(TRACE[:60], PdStaticPolicy(0, 1), CAL, slo=SLO, warmup_s=0)
    r = sim.run()
    assert r.settings["disaggregation"]["direct_no_prefill"] == long > 0
    assert sim.pd_snapshot(TRACE[59].t).router_pd.no_prefill == long  # type: ignore[union-attr]
    # The autoscaler with prefill at zero and decode running: the router never holds a request (the
    # decode pod takes them), the long prompts served direct wake prefill.
    cal = replace(CAL, startup_s=10.0)
    woke = simulate_pd(TRACE, _auto(0, 1), cal, slo=SLO, warmup_s=0)
    assert woke.settings["role_replica_hours"]["prefill"] > 0
    assert woke.settings["disaggregation"]["transfers"] > 0


def test_a_slow_link_grows_decode_on_its_pulls_and_its_ttft_misses():
    cal = replace(CAL, startup_s=10.0, kv_link_bytes_s=2e9)  # 2 GB/s: a 16k-token prompt takes 1 s
    policy = _auto(3, 1)
    signals: list[str] = []
    decide = policy.decide

    def spy(now: float, current: tuple[int, int], snapshot: PdSnapshot) -> tuple[int, int]:
        got = decide(now, current, snapshot)
        assert snapshot.decode.samples and snapshot.decode.samples[0].kv_transfers_total is not None
        signals.append(policy.last_reason)
        return got

    policy.decide = spy  # type: ignore[method-assign]
    r = simulate_pd(TRACE, policy, cal, slo=SLO, warmup_s=0)
    # The pulls alone ask for more decode replicas, and the TTFT misses are the decode role's: the
    # requests wait in pulls, not in the prefill leg (the queue and arrivals signals may ask first).
    assert max(rec.replicas for rec in policy.state.link.recommendations) >= 2
    assert any("TTFT misses decode's" in s for s in signals)
    assert r.settings["role_replica_hours"]["decode"] > r.replica_hours * 0.2
    b = r.settings["disaggregation"]["ttft_breakdown"]
    assert b["requests"] > 0 and b["transfer_s"] > 0.5


def test_the_cpu_calibrations_kv_bytes_are_smollm2s_geometry():
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"
    for name in ("smollm2-cpu.json", "smollm2-cpu-roofline.json"):
        cal = Calibration.from_file(root / name)
        # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V, 2-byte KV; the pool the calibration
        # measured (256 MiB, --kv-cache-memory's default there) holds exactly its blocks.
        assert cal.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
        block = cal.kv_bytes_per_token * cal.block_size
        assert cal.num_kv_blocks == int(256 * 2**20 // block)


def test_the_pd_policy_sees_the_startup_measured_over_both_roles():
    """As pd_controller reads it (creation -> Ready over the model's pods): the pods there at the
    start report the calibration's startup from the first sync, before any pod was started."""
    cal = replace(CAL, startup_s=40.0)
    seen: list[float | None] = []

    class Recorder(PdStaticPolicy):
        def decide(self, now: float, current: tuple[int, int], snapshot: PdSnapshot) -> tuple[int, int]:
            seen.append(snapshot.startup_s)
            return super().decide(now, current, snapshot)

    simulate_pd(TRACE[:40], Recorder(2, 1), cal, slo=SLO, warmup_s=0)
    assert seen and set(seen) == {40.0}
