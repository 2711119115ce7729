"""Mooncake JSONL traces, trace scaling, the simulated prefix cache, routing and the two-part SLO."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.replica_model import calibration_by_name
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.simulator import (
    LeastLoaded,
    ReplicaView,
    RequestView,
    RoundRobin,
    simulate,
)
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.trace import (
    TraceError,
    TraceRequest,
    load_per_minute,
    load_trace,
    parse_jsonl,
    repeat_period,
    repeat_trace,
    scale_trace,
    shift_mix,
)

H100 = calibration_by_name("h100/llama-3.1-8b", startup_s=10.0)
MOONCAKE_HEAD = Path(__file__).parent / "data" / "mooncake_synthetic_head200.jsonl"


def line(ts: float, n_in: int, n_out: int, hashes: list[int] | None = None) -> str:
    obj: dict[str, object] = {"timestamp": ts, "input_length": n_in, "output_length": n_out}
    if hashes is not None:
        obj["hash_ids"] = hashes
    return json.dumps(obj)


def test_jsonl_reads_mooncake_fields():
    text = "\n".join([line(0, 1000, 5, [1, 2]), "", line(1500, 600, 9, [1, 3])]) + "\n"
    reqs = parse_jsonl(text, "m.jsonl")
    assert reqs == [TraceRequest(0.0, 1000, 5, (1, 2)), TraceRequest(1.5, 600, 9, (1, 3))]
    assert parse_jsonl(line(0, 5, 5))[0].hash_ids == ()  # hash_ids are optional


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (line(0, 5, 5) + "\n{not json", r"m\.jsonl:2: not a JSON object"),
        (line(0, 5, 5) + "\n[1, 2]", r"m\.jsonl:2: expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 5}', r"m\.jsonl:1: missing field\(s\) output_length"),
        (line(-1, 5, 5), r"m\.jsonl:1: timestamp must be a finite number of ms >= 0, got -1"),
        (line(10, 5, 5) + "\n" + line(5, 5, 5), r"m\.jsonl:2: timestamp 5 goes back in time"),
        (line(0, 0, 5), r"m\.jsonl:1: input_length must be >= 1, got 0"),
        (line(0, 5, 2.5), r"m\.jsonl:1: output_length must be an integer, got 2.5"),  # type: ignore[arg-type]
        (line(0, 600, 5, [1, 2, 3]), r"m\.jsonl:1: 3 hash_ids for 600 input tokens"),
        ("", r"m\.jsonl: no requests"),
    ],
)
def test_jsonl_bad_input_names_file_and_line(text: str, message: str):
    with pytest.raises(TraceError, match=message):
        parse_jsonl(text, "m.jsonl")


def test_load_trace_by_extension(tmp_path: Path):
    p = tmp_path / "t.jsonl"
    p.write_text(line(0, 10, 2) + "\n" + line(250, 20, 3) + "\n")
    assert [r.t for r in load_trace(p)] == [0.0, 0.25]
    c = tmp_path / "t.csv"
    c.write_text("t_seconds,prompt_tokens,output_tokens\n0.5,10,2\n")
    assert load_trace(c) == [TraceRequest(0.5, 10, 2)]


def test_scale_and_load_per_minute():
    reqs = [TraceRequest(i * 1.0, 100, 10, (i,)) for i in range(120)]
    stretched = scale_trace(reqs, time_scale=2.0)
    assert len(stretched) == 120 and stretched[-1].t == 238.0
    thick = scale_trace(reqs, rate_scale=2.5)
    assert len(thick) == 300 and thick[-1].t == 119.0
    assert len({r.hash_ids for r in thick}) == 300  # copies are other users' prompts
    thin = scale_trace(reqs, rate_scale=0.5)
    assert len(thin) == 60
    load = load_per_minute(reqs)
    assert load[0] == {
        "minute": 0,
        "requests_per_s": 1.0,
        "prompt_tokens_per_s": 100.0,
        "output_tokens_per_s": 10.0,
    }
    assert len(load) == 2
    with pytest.raises(ValueError):
        scale_trace(reqs, time_scale=0)


def test_repeat_trace_plays_the_trace_again_after_itself():
    reqs = [TraceRequest(10.0 + i * 2.0, 100 + i, 10, (i, i + 1)) for i in range(50)]
    assert repeat_period(reqs) == 100.0  # span 98 s + one mean gap (2 s)
    twice = repeat_trace(reqs, 2)
    assert len(twice) == 100
    assert [r.t for r in twice[50:]] == [r.t + 100.0 for r in reqs]  # the spacing holds across passes
    assert [(r.prompt_tokens, r.output_tokens) for r in twice[50:]] == [
        (r.prompt_tokens, r.output_tokens) for r in reqs
    ]
    first, second = {h for r in twice[:50] for h in r.hash_ids}, {h for r in twice[50:] for h in r.hash_ids}
    assert not first & second  # new users' prompts: nothing cached from the first pass
    assert twice[:50] == reqs and repeat_trace(reqs, 1) == reqs
    with pytest.raises(ValueError):
        repeat_trace(reqs, 0)
    with pytest.raises(ValueError):
        repeat_period([])


def test_shift_mix_makes_the_prompts_heavier_from_a_moment_on_at_the_same_arrivals():
    reqs = [TraceRequest(float(i), 3000 + i, 50, tuple(range(6))) for i in range(10)]
    shifted = shift_mix(reqs, 3.0, at_s=5.0)
    assert [r.t for r in shifted] == [r.t for r in reqs]  # the same arrivals
    assert shifted[5:] == reqs[5:]  # from at_s on, as recorded
    assert [r.prompt_tokens for r in shifted[:5]] == [1000, 1000, 1000, 1001, 1001]
    assert all(r.hash_ids == (0, 1) for r in shifted[:5])  # 1,000 tokens: the first two 512-token blocks
    assert all(r.output_tokens == 50 for r in shifted)
    # The fixed fleet that serves the light half serves the heavy one worse: the load per request rose.
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    light = [TraceRequest(i * 0.1, 500, 50) for i in range(1200)]
    heavy = shift_mix([TraceRequest(i * 0.1, 6000, 50) for i in range(1200)], 12.0, at_s=60.0)
    assert [r.prompt_tokens for r in heavy[:600]] == [r.prompt_tokens for r in light[:600]]
    judged = {
        name: simulate(t, StaticPolicy(1), H100, warmup_s=0.0, slo=slo).slo_attainment
        for name, t in (("light", light), ("heavy", heavy))
    }
    assert judged["heavy"] < judged["light"]
    assert shift_mix(reqs, 1.0, at_s=5.0) == reqs
    with pytest.raises(ValueError, match="factor must be >= 1"):
        shift_mix(reqs, 0.5, at_s=5.0)


def test_a_warm_run_is_judged_on_its_last_pass_only():
    reqs = [TraceRequest(i * 0.5, 256, 16) for i in range(240)]
    period = repeat_period(reqs)
    warm = simulate(
        repeat_trace(reqs, 2), StaticPolicy(2), H100, warmup_s=period, slo=Slo(ttft_s=2.0, tpot_s=0.05)
    )
    cold = simulate(reqs, StaticPolicy(2), H100, warmup_s=0.0, slo=Slo(ttft_s=2.0, tpot_s=0.05))
    assert warm.requests == cold.requests == 240
    assert warm.window_s[0] == pytest.approx(period)
    assert warm.replica_hours == pytest.approx(2 * (warm.window_s[1] - period) / 3600.0)


def conversation(turns: int, gap: float, block_tokens: int = 512) -> list[TraceRequest]:
    """One user: each turn's prompt is the whole history (a growing leading run of block ids)."""
    return [
        TraceRequest(i * gap, (i + 1) * 4 * block_tokens, 20, tuple(range((i + 1) * 4))) for i in range(turns)
    ]


def test_prefix_cache_skips_the_repeated_history():
    trace = conversation(6, 5.0)
    res = simulate(trace, StaticPolicy(1), H100, warmup_s=0)
    # Turn i+1 finds the 4(i+1) blocks of turn i: hits 4+8+...+20 of 4+8+...+24 blocks.
    assert res.prefix_hit_rate == pytest.approx(sum(range(4, 24, 4)) / sum(range(4, 28, 4)), rel=1e-6)
    cold = simulate(
        [TraceRequest(r.t, r.prompt_tokens, r.output_tokens) for r in trace],
        StaticPolicy(1),
        H100,
        warmup_s=0,
    )
    assert cold.prefix_hit_rate == 0.0
    assert res.ttft_p99_s < cold.ttft_p99_s


def test_prefix_cache_is_lru_within_the_pool():
    # A pool of 4 x 512 tokens holds 4 blocks: a second user's 4 blocks evict the first user's.
    tiny = calibration_by_name("h100/llama-3.1-8b")
    from dataclasses import replace

    tiny = replace(tiny, num_kv_blocks=4 * 512 // 16)
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    trace = [
        TraceRequest(0.0, 2048 - 30, 10, a),
        TraceRequest(5.0, 2048 - 30, 10, b),
        TraceRequest(10.0, 2048 - 30, 10, a),
    ]
    res = simulate(trace, StaticPolicy(1), tiny, warmup_s=0)
    assert res.prefix_hit_rate == 0.0
    trace[1] = TraceRequest(5.0, 2048 - 30, 10, a)
    assert simulate(trace, StaticPolicy(1), tiny, warmup_s=0).prefix_hit_rate > 0.6


def test_long_contexts_slow_decoding():
    # Six sequences of 60k context read 47 GB of KV per step, three times the 16 GB of weights.
    def tpot(prompt: int) -> float:
        trace = [TraceRequest(0.0, prompt, 100) for _ in range(6)]
        return simulate(trace, StaticPolicy(1), H100, warmup_s=0).tpot_p50_s

    assert tpot(60_000) > 2.5 * tpot(200)


def view(i: int, waiting: int, running: int, free: int = 10_000) -> ReplicaView:
    return ReplicaView(i, waiting, running, 4, free, 10_000, 0)


def test_routers():
    req = RequestView(100, 10, ())
    rr = RoundRobin()
    views = [view(0, 0, 0), view(1, 5, 4)]
    assert [rr(req, views) for _ in range(3)] == [0, 1, 0]
    ll = LeastLoaded()
    assert ll(req, [view(0, 1, 2), view(1, 0, 1), view(2, 0, 0, free=50)]) == 1  # 2 lacks KV
    assert ll(req, [view(0, 0, 4), view(1, 2, 2)]) is None  # no free slot anywhere: hold


def test_central_queue_beats_round_robin_on_uneven_requests():
    # Alternating long and short requests: round-robin stacks the long ones on one replica.
    trace = [TraceRequest(i * 0.5, 30_000 if i % 2 == 0 else 200, 50) for i in range(200)]
    slo = Slo(ttft_s=1.0, tpot_s=0.05, ttft_prefill_factor=1.0)
    rr = simulate(trace, StaticPolicy(2), H100, warmup_s=0, slo=slo, router=RoundRobin())
    ll = simulate(trace, StaticPolicy(2), H100, warmup_s=0, slo=slo, router=LeastLoaded())
    assert rr.settings["router"] == "round-robin" and ll.settings["router"] == "least-loaded"
    assert ll.requests == rr.requests == 200 and ll.rejected == 0
    # Round-robin sends every long prompt to replica 0, which falls behind without end (half miss);
    # the central queue gives each request to whichever replica has room.
    assert rr.slo_attainment == 0.5 and rr.ttft_p99_s > 10.0
    assert ll.slo_attainment == 1.0


def test_slo_counts_tpot_and_rejections():
    trace = [TraceRequest(i * 0.01, 1000, 200) for i in range(300)]
    loose = simulate(trace, StaticPolicy(1), H100, warmup_s=0, slo=Slo(ttft_s=60, tpot_s=1.0))
    tight = simulate(trace, StaticPolicy(1), H100, warmup_s=0, slo=Slo(ttft_s=60, tpot_s=0.009))
    assert loose.slo_attainment == 1.0
    assert tight.ttft_attainment == 1.0 and tight.slo_attainment < 0.5  # TPOT alone fails them
    too_big = simulate([TraceRequest(0.0, 10_000_000, 5)], StaticPolicy(1), H100, warmup_s=0)
    assert too_big.rejected == 1 and too_big.slo_attainment == 0.0


def test_mooncake_synthetic_trace_replays():
    """A slice of the public Mooncake trace (tests/autoscaler/data, see its README) replays with a
    prefix hit rate: its conversations repeat their history."""
    trace = load_trace(MOONCAKE_HEAD)
    assert len(trace) == 200
    res = simulate(trace, StaticPolicy(4), H100, warmup_s=0, router=LeastLoaded())
    assert res.requests == 200 and 0.0 < res.prefix_hit_rate < 1.0
    assert not math.isnan(res.tpot_p50_s)


class _Recorder(StaticPolicy):
    """A fixed fleet that keeps every snapshot the simulator shows it."""

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self.seen: list[tuple[float, MetricsSnapshot]] = []

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        self.seen.append((now, snapshot))
        return super().decide(now, current, snapshot, in_flight)


def test_replicas_count_prompts_as_they_are_admitted():
    """The simulated replicas count the requests routed to them and their prompts on arrival, as the
    runtime's admitted-prompt histogram does: admitted = finished + in flight at every sync (a
    preempted request is not counted again), and over a mix shift on a saturated replica the admitted
    prompts show the heavier mix while the finished ones still show the lighter."""
    light = [TraceRequest(i * 0.05, 2_000, 200) for i in range(600)]
    trace = shift_mix(light + [TraceRequest(30.0 + i * 0.05, 2_000, 200) for i in range(600)], 3.0, 30.0)
    rec = _Recorder(1)
    result = simulate(trace, rec, H100, warmup_s=0, router=RoundRobin(), sync_interval_s=5.0)
    assert result.preemptions > 0  # requeued requests, which are not admitted again
    for _, snap in rec.seen:
        (s,) = snap.samples
        assert s.admitted_total == (s.completed_total or 0) + s.num_running + s.num_waiting
        assert (s.admitted_prompt_tokens_total or 0) >= (s.prompt_tokens_total or 0)
    mixes = []
    for (_, a), (t, b) in zip(rec.seen, rec.seen[1:], strict=False):
        (x,), (y,) = a.samples, b.samples
        if t > 30.0 and y.completed_total != x.completed_total:
            admitted = (y.admitted_prompt_tokens_total - x.admitted_prompt_tokens_total) / (
                y.admitted_total - x.admitted_total
            )
            finished = (y.prompt_tokens_total - x.prompt_tokens_total) / (
                y.completed_total - x.completed_total
            )
            mixes.append((admitted, finished))
    assert mixes and mixes[0][0] > 1.5 * mixes[0][1]  # the first sync after the shift


def test_the_central_queue_is_reported_as_the_routers():
    """What the router holds is reported as a router reports it (MetricsSnapshot.router_queue, which
    production reads from kvpilot_router_queue_depth), not as the pods' waiting requests: at every
    sync the pods' in flight plus the router's queue is every request that arrived and did not finish,
    and a burst on one full replica shows in router_queue."""
    trace = [TraceRequest(i * 0.01, 4_000, 300) for i in range(1500)]
    rec = _Recorder(1)
    simulate(trace, rec, H100, warmup_s=0, router=LeastLoaded(), sync_interval_s=5.0)
    assert max(snap.router_queue or 0 for _, snap in rec.seen) > 100
    for now, snap in rec.seen:
        (s,) = snap.samples
        arrived = sum(r.t <= now for r in trace)
        assert (s.completed_total or 0) + s.num_running + s.num_waiting + (snap.router_queue or 0) == arrived
