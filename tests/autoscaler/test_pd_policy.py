"""The P/D policy (pd_policy.decide_pd, pd_prefill), its status (pd_state) and its kube shell (pd_controller)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.controller import ControllerConfig, ScalingController
from kvpilot.autoscaler.feedback import SloState
from kvpilot.autoscaler.kube import roles_patch
from kvpilot.autoscaler.pd_policy import (
    MIN_RATIO_SAMPLES,
    PdSnapshot,
    PdState,
    PdTargets,
    decide_pd,
    learn_ratio,
)
from kvpilot.autoscaler.pd_prefill import stabilize
from kvpilot.autoscaler.pd_state import pd_decision_to_status, pd_state_from_status
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.sources import ModelRef, PodTarget
from kvpilot.autoscaler.spec import Behavior, ScalingTargets
from tests.autoscaler.test_controller import T0, FakeKube, FakeSource, calls

SLO = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 2, "tpotSeconds": 0.05}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 20, "slo": SLO}


def targets(**autoscaling: object) -> PdTargets:
    return PdTargets.from_spec({**AUTOSCALING, **autoscaling}, {"decode": {"maxReplicas": 10}})


def prefill_pods(n: int, tokens: float, done: float, waiting: int = 0, running: int = 1) -> MetricsSnapshot:
    return MetricsSnapshot(
        n,
        tuple(
            ReplicaSample(f"p{i}", 0.05, waiting, running, done, prompt_tokens_total=tokens) for i in range(n)
        ),
    )


def decode_pods(n: int, kv: float, done: float = 0.0) -> MetricsSnapshot:
    return MetricsSnapshot(n, tuple(ReplicaSample(f"d{i}", kv, 0, 8, done) for i in range(n)))


def test_from_spec_takes_role_bounds_over_the_models():
    t = targets()
    assert (t.prefill_min, t.prefill_max, t.decode_min, t.decode_max) == (1, 20, 1, 10)
    assert t.role_targets("decode").max_replicas == 10 and t.role_targets("decode").slo is None
    # a role's spare is its own minReplicas: the aggregated policy's redundancy rule is off per role
    assert t.base.behavior.redundancy_replicas == 2
    assert t.role_targets("decode").behavior.redundancy_replicas == 1


def test_both_roles_wake_from_zero_on_a_held_request():
    t = targets(minReplicas=0)
    snap = PdSnapshot(MetricsSnapshot(0), MetricsSnapshot(0), router_queue=2)
    d = decide_pd((0, 0), snap, t, PdState(), T0)
    assert d.desired == (1, 1)
    assert "[signal: scale from zero]" in d.reason.split("; decode")[0]
    assert d.decode.signal == "scale from zero"
    # Nothing held: both stay at zero.
    idle = decide_pd((0, 0), replace(snap, router_queue=0), t, PdState(), T0)
    assert idle.desired == (0, 0)


def test_prefill_scales_on_its_token_rate_and_decode_on_kv_in_one_decision():
    t = targets(scaleDownStabilizationSeconds=0)
    state = PdState()
    # First sync: counters only (no rate yet).
    first = decide_pd((2, 2), PdSnapshot(prefill_pods(2, 0, 0), decode_pods(2, 0.7)), t, state, T0)
    assert first.desired == (2, 2)
    # 15 s later each prefill replica finished 600k prompt tokens: 80k tokens/s arriving, at the
    # model's throughput (the calibration's idle prefill rate) x 0.7 that is more than 2 replicas.
    snap = PdSnapshot(prefill_pods(2, 600_000, 40), decode_pods(2, 0.98))
    d = decide_pd((2, 2), snap, t, first.state, T0 + 15)
    assert d.prefill.desired > 2 and d.prefill.signal == "token rate"
    assert d.decode.desired > 2 and d.decode.signal == "utilization"
    assert d.reason.startswith("prefill 2 -> ") and "; decode 2 -> " in d.reason
    assert d.prefill_decision.token_rate == 80_000


def test_the_ratio_is_learned_from_both_roles_demand_and_brings_decode_along():
    ratio, n = None, 0
    for _ in range(MIN_RATIO_SAMPLES):
        ratio, n = learn_ratio(ratio, n, prefill_demand=3.0, decode_demand_=1.5)
    assert (ratio, n) == (2.0, MIN_RATIO_SAMPLES)
    assert learn_ratio(ratio, n, 0.1, 1.5) == (ratio, n)  # an idle role says nothing
    # With the ratio learned, a prefill role that grows asks for decode replicas in the same decision,
    # before the decode pods see the load.
    t = targets(scaleDownStabilizationSeconds=0)
    state = replace(PdState(), ratio=0.5, ratio_samples=MIN_RATIO_SAMPLES)
    first = decide_pd((2, 2), PdSnapshot(prefill_pods(2, 0, 0), decode_pods(2, 0.6)), t, state, T0)
    d = decide_pd(
        (2, 2), PdSnapshot(prefill_pods(2, 600_000, 40), decode_pods(2, 0.6)), t, first.state, T0 + 15
    )
    assert d.prefill.desired > 2
    assert d.decode.signal == "P:D ratio"
    assert d.decode.desired >= d.prefill_decision.demand / d.state.ratio - 1e-9  # type: ignore[operator]
    # Without coupling, decode holds on its own signal.
    alone = decide_pd(
        (2, 2),
        PdSnapshot(prefill_pods(2, 600_000, 40), decode_pods(2, 0.6)),
        replace(t, ratio_coupling=False),
        first.state,
        T0 + 15,
    )
    assert alone.decode.desired == 2


def _measured_before() -> PdState:
    """The router's counter read at T0: 1000 requests met."""
    return PdState(slo=SloState(time=T0, router_counts=SloCounts(met=1000), source="router"))


def test_ttft_misses_grow_prefill_and_tpot_misses_grow_decode():
    t = targets()
    base = PdSnapshot(prefill_pods(2, 0, 0), decode_pods(2, 0.5))
    state = _measured_before()
    ttft = decide_pd((2, 2), replace(base, router_slo=SloCounts(met=1150, missed_ttft=50)), t, state, T0 + 15)
    assert ttft.prefill.desired == 3 and ttft.prefill.signal == "measured attainment"
    assert ttft.decode.desired == 2
    assert ttft.state.prefill_fresh_since is not None and ttft.state.decode_fresh_since is None
    tpot = decide_pd((2, 2), replace(base, router_slo=SloCounts(met=1150, missed_tpot=50)), t, state, T0 + 15)
    assert tpot.decode.desired == 3 and tpot.decode.signal == "measured attainment"
    assert tpot.prefill.desired == 2
    assert tpot.attainment == 0.75


def test_a_queue_on_the_prefill_pods_is_a_backlog_for_the_loop():
    """Requests waiting on the prefill pods past the queue target are a backlog, as on the decode pods
    or at the router: their misses say the fleet was short for a while (the queue rules answer that),
    not that the replica's capacity is lower. Counted only on decode, a cold start's prefill queue cut
    the learnt prefill capacity to a fifth of its throughput and held 11-12 prefill replicas where 5
    serve (Mooncake synthetic, 10 s startup: 157% of the aggregated fixed fleet's replica-hours)."""
    t = targets()
    counts = SloCounts(met=1150, missed_ttft=50)
    for waiting, backlog in ((10, True), (4, False)):
        snap = PdSnapshot(prefill_pods(2, 0, 0, waiting=waiting), decode_pods(2, 0.5), router_slo=counts)
        d = decide_pd((2, 2), snap, t, _measured_before(), T0 + 15)
        assert (d.state.slo.last_backlog == T0 + 15) is backlog, waiting


def test_status_round_trip_keeps_the_ratio_and_the_prefill_estimate():
    t = targets()
    state = replace(PdState(), ratio=0.5, ratio_samples=4)
    first = decide_pd((2, 2), PdSnapshot(prefill_pods(2, 0, 0), decode_pods(2, 0.6)), t, state, T0)
    d = decide_pd(
        (2, 2),
        PdSnapshot(prefill_pods(2, 600_000, 40, waiting=2, running=2), decode_pods(2, 0.6)),
        t,
        first.state,
        T0 + 15,
    )
    block = pd_decision_to_status(d, t, T0 + 15, None)
    assert block["disaggregation"]["prefill"]["toReplicas"] == d.prefill.desired
    assert block["lastDecision"]["toReplicas"] == sum(d.desired)
    back = pd_state_from_status(block)
    assert back.ratio == round(d.state.ratio, 4)  # type: ignore[arg-type]
    assert back.ratio_samples == d.state.ratio_samples
    assert [c.prompt_tokens for c in back.prefill.counters] == [600_000, 600_000]
    assert [r.replicas for r in back.prefill.recommendations] == [
        r.replicas for r in d.state.prefill.recommendations
    ]
    assert back.prefill.mean_prompt == d.state.prefill.mean_prompt
    assert back.slo.source == d.state.slo.source


def test_roles_patch_writes_both_roles_in_one_merge_patch():
    assert roles_patch(2, 5) == {
        "spec": {"disaggregation": {"prefill": {"replicas": 2}, "decode": {"replicas": 5}}}
    }


def _pod(name: str, role: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, "annotations": {}, "labels": {"kvpilot.dev/kv-role": role}},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_the_controller_splits_pods_by_role_and_patches_both_roles_once():
    obj = {
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1"},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 10},
            "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
        },
        "status": {},
    }
    kube = FakeKube(obj, [_pod("p0", "prefill"), _pod("d0", "decode"), _pod("d1", "decode")])
    seen: list[list[str]] = []
    src = FakeSource()
    collect = src.collect

    async def spy(model: ModelRef, pods: Sequence[PodTarget]) -> MetricsSnapshot:
        seen.append(sorted(p.name for p in pods))
        return await collect(model, pods)

    src.collect = spy  # type: ignore[method-assign]
    src.samples = {
        "p0": ReplicaSample("p0", 0.1, 30, 2, 0.0, prompt_tokens_total=0.0),
        "d0": ReplicaSample("d0", 0.95, 0, 8),
        "d1": ReplicaSample("d1", 0.95, 0, 8),
    }
    ctl = ScalingController(kube, ControllerConfig(namespace="ml"), clock=lambda: T0, pod_source=src)
    (result,) = await ctl.sync_all()
    assert seen == [["p0"], ["d0", "d1"]]
    (sizes,) = calls(kube, "roles")
    assert sizes[0] > 1 and sizes[1] > 2  # prefill on its queue, decode on its KV use
    assert calls(kube, "scale") == []
    status = calls(kube, "status")[0]["autoscaler"]
    assert status["disaggregation"]["prefill"]["signal"] == "queue"
    assert status["disaggregation"]["decode"]["signal"] == "utilization"
    assert result.decision.desired == sum(sizes)
    # The next sync reads its state back from the status it wrote.
    (again,) = await ScalingController(
        kube, ControllerConfig(namespace="ml"), clock=lambda: T0 + 15, pod_source=src
    ).sync_all()
    assert again.decision.reason.startswith("prefill ")
    assert kube.model["status"]["autoscaler"]["disaggregation"]["prefill"]["pods"][0]["pod"] == "p0"


def test_a_role_surplus_comes_down_in_proportion_as_the_aggregated_policy_does() -> None:
    """Both P/D roles step down through pd_prefill.stabilize: half the surplus over the size asked
    per period (Behavior.scale_down_surplus_share), where it was one replica a minute."""
    role = ScalingTargets(max_replicas=40)
    desired, _, _, notes = stabilize(11, 40, (), (), T0, role, startup=None)
    assert desired == 26
    assert notes == ["scale-down limited to 26 (max -1 or 0% per 60s or 50% of the surplus)"]
    one_a_minute = replace(role, behavior=Behavior(scale_down_surplus_share=0.0))
    desired, _, _, notes = stabilize(11, 40, (), (), T0, one_a_minute, startup=None)
    assert (desired, notes) == (39, ["scale-down limited to 39 (max -1 or 0% per 60s)"])
    desired, _, _, notes = stabilize(11, 12, (), (), T0, role, startup=None)  # near the size: one a minute
    assert (desired, notes) == (11, [])
