"""The fleet router's policies (kvpilot.router.policy) in the fleet simulator, through sim_routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.replica_model import calibration_by_name
from kvpilot.autoscaler.sim_routing import ROUTER_POLICY_NAMES, PolicyRouter, pod_view, route_key
from kvpilot.autoscaler.simulator import ROUTERS, ReplicaView, RequestView, RoundRobin, simulate
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.trace import TraceRequest
from kvpilot.cli import main
from kvpilot.router.policy import KvAware, PrefixAffinity

H100 = calibration_by_name("h100/llama-3.1-8b", startup_s=10.0)


def view(i: int, waiting: int, running: int, free: int = 100_000, seqs: int = 4) -> ReplicaView:
    return ReplicaView(i, waiting, running, seqs, free, 100_000, 0)


def test_every_router_policy_is_a_simulator_router():
    assert ROUTER_POLICY_NAMES == (
        "router:round-robin",
        "router:least-loaded",
        "router:prefix-affinity",
        "router:kv-aware",
    )
    for name in ROUTER_POLICY_NAMES:
        router = ROUTERS[name]()
        assert isinstance(router, PolicyRouter) and router.name == name


def test_route_key_chains_the_trace_blocks():
    a = route_key(RequestView(3 * 512, 100, (7, 8, 9)))
    b = route_key(RequestView(3 * 512, 100, (7, 8, 10)))
    c = route_key(RequestView(3 * 512, 100, (6, 8, 9)))
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert not set(a.blocks) & set(c.blocks)  # a different first block: nothing shared after it
    assert a.footprint == 4  # 1636 tokens of prompt and output in 512-token blocks
    assert route_key(RequestView(100, 10, ())).blocks == ()


def test_pod_view_is_what_the_router_knows():
    p = pod_view(
        ReplicaView(
            3,
            waiting=2,
            running=5,
            max_num_seqs=8,
            free_kv_tokens=25_000,
            kv_capacity_tokens=100_000,
            prefix_hit_tokens=4096,
        )
    )
    assert (p.name, p.in_flight, p.capacity, p.waiting) == ("r3", 7, 8, 2)
    assert p.kv_usage == pytest.approx(0.75) and p.active_blocks == -(-75_000 // 512)
    # free KV below zero (queued prompts larger than the pool) is a full pool, not more than full
    assert pod_view(view(0, 9, 0, free=-5_000)).kv_usage == 1.0


@pytest.mark.parametrize("name", ROUTER_POLICY_NAMES)
def test_no_room_anywhere_holds_the_request(name: str):
    router = ROUTERS[name]()
    req = RequestView(600, 10, (1, 2))
    assert router(req, [view(0, 1, 3), view(1, 0, 4)]) is None  # both at maxNumSeqs
    assert router(req, [view(0, 1, 3), view(1, 0, 3)]) == 1  # the only one with room
    assert router(req, []) is None


def test_least_loaded_and_round_robin_decide_as_the_router_does():
    req = RequestView(600, 10, ())
    ll = PolicyRouter("least-loaded")
    assert ll(req, [view(0, 1, 2), view(1, 0, 1), view(2, 0, 2)]) == 1
    rr = PolicyRouter("round-robin")
    views = [view(0, 0, 0), view(1, 0, 4), view(2, 0, 0)]
    assert [rr(req, views) for _ in range(3)] == [0, 2, 0]  # the full replica 1 is passed over


def test_prefix_affinity_keeps_a_conversation_on_one_replica():
    router = PolicyRouter("prefix-affinity")
    views = [view(i, 0, 1, seqs=64) for i in range(4)]
    turns = [RequestView(512 * n, 10, tuple(range(100, 100 + n))) for n in (1, 2, 3, 4)]
    picks = {router(t, views) for t in turns}
    assert len(picks) == 1
    assert isinstance(router.policy, PrefixAffinity) and router.policy.affinity_blocks == 1
    others = {router(RequestView(512, 10, (h,)), views) for h in range(1000, 1040)}
    assert len(others) == 4  # different conversations spread over the ring


def test_kv_aware_follows_what_it_sent_and_forgets_gone_replicas():
    router = PolicyRouter("kv-aware")
    views = [view(i, 0, 0, seqs=64) for i in range(3)]
    first = router(RequestView(4 * 512, 10, (1, 2, 3, 4)), views)
    assert first is not None
    # the next turn extends the prefix: it goes where the first turn went
    assert router(RequestView(6 * 512, 10, (1, 2, 3, 4, 5, 6)), views) == first
    policy = router.policy
    assert isinstance(policy, KvAware) and policy.max_blocks_per_pod == 100_000 // 512
    key = route_key(RequestView(4 * 512, 10, (1, 2, 3, 4)))
    assert policy.cached_blocks(f"r{first}", key) == 4
    router(RequestView(512, 10, (9,)), [v for v in views if v.replica_id != first])
    assert policy.cached_blocks(f"r{first}", key) == 0


def test_bad_policy_or_option_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        PolicyRouter("random")
    with pytest.raises(ValueError, match="takes no option eps"):
        PolicyRouter("kv-aware", eps=0.5)
    assert PolicyRouter("prefix-affinity", affinity_blocks=2, eps=0.1).options == {
        "affinity_blocks": 2,
        "eps": 0.1,
    }


def conversations(n: int, turns: int, gap: float) -> list[TraceRequest]:
    """n conversations, interleaved: turn t of conversation c resends its history plus 2 blocks."""
    out = []
    for t in range(turns):
        for c in range(n):
            blocks = tuple(c * 1000 + b for b in range(2 * (t + 1) + 6))
            out.append(TraceRequest((t * n + c) * gap, len(blocks) * 512, 20, blocks))
    return out


def test_prefix_aware_policies_find_the_history_round_robin_scatters():
    # 7 conversations on 4 replicas: round-robin sends each turn to another replica than the last
    trace = conversations(7, 5, 0.5)
    sim = {"warmup_s": 0, "slo": Slo(ttft_s=2.0, tpot_s=0.05)}
    rr = simulate(trace, StaticPolicy(4), H100, router=RoundRobin(), **sim)
    assert rr.prefix_hit_rate < 0.2  # only turn 4 comes back to turn 0's replica
    for name in ("router:prefix-affinity", "router:kv-aware"):
        res = simulate(trace, StaticPolicy(4), H100, router=ROUTERS[name](), **sim)
        assert res.settings["router"] == name and res.rejected == 0 and res.requests == 35
        assert res.prefix_hit_rate > 2 * rr.prefix_hit_rate
        # every turn after the first finds its whole history: 2k+6 of 2k+8 blocks for turns k = 1..4
        assert res.prefix_hit_rate == pytest.approx(
            sum(2 * k + 6 for k in range(1, 5)) / sum(2 * k + 8 for k in range(5)), rel=1e-6
        )


def test_router_least_loaded_central_queue_beats_a_service_on_uneven_requests():
    # Alternating long and short prompts: the Service stacks the long ones on one replica.
    trace = [TraceRequest(i * 0.5, 30_000 if i % 2 == 0 else 200, 50) for i in range(200)]
    slo = Slo(ttft_s=1.0, tpot_s=0.05, ttft_prefill_factor=1.0)
    rr = simulate(trace, StaticPolicy(2), H100, warmup_s=0, slo=slo, router=RoundRobin())
    ll = simulate(trace, StaticPolicy(2), H100, warmup_s=0, slo=slo, router=PolicyRouter("least-loaded"))
    assert ll.rejected == 0 and ll.slo_attainment > rr.slo_attainment
    assert ll.ttft_p99_s < rr.ttft_p99_s


def test_cli_runs_a_router_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.t * 1000,
                    "input_length": r.prompt_tokens,
                    "output_length": r.output_tokens,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in conversations(4, 3, 1.0)
        )
    )
    argv = ["autoscaler", "simulate", "--trace", str(trace), "--policy", "static", "--replicas", "2"]
    assert main([*argv, "--router", "router:kv-aware", "--warmup", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["router"] == "router:kv-aware" and out["requests"] == 12
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--router", "router:random"])
    assert exc.value.code == 2 and "--router" in capsys.readouterr().err
