"""The SLO planner in policy.decide (spec.autoscaling.slo), its state in the status, and its spec."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.feedback import SloState
from kvpilot.autoscaler.policy import (
    MIN_MIX_REQUESTS,
    TOKEN_MIX_WINDOW_REQUESTS,
    ArrivalState,
    History,
    PodCounter,
    decide,
    measure_token_mix,
    smooth_token_mix,
)
from kvpilot.autoscaler.replica_model import UnknownCalibration, calibration_by_name
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.slo import (
    DEFAULT_TPOT_TAIL_BUDGET,
    Slo,
    output_share_at_most,
    replica_capacity,
    tpot_tail_share,
)
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
    pods: int,
    done: float = 1000.0,
    prompt: float = 1000.0 * 2000,
    output: float = 1000.0 * 200,
    mix: tuple[float, float] | None = None,
) -> History:
    """The state after a sync; with `mix`, a token mix established over the last requests."""
    counters = tuple(PodCounter(f"p{i}", done, 20, prompt, output) for i in range(pods))
    established = TOKEN_MIX_WINDOW_REQUESTS if mix else 0.0
    return History(
        arrivals=ArrivalState(time=NOW - 15.0, counters=counters, token_mix=mix, mix_requests=established)
    )


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
    history = previous(8, mix=(2000.0, 200.0))
    # Without a measured attainment, scale-down waits: missing metrics are never perfect attainment.
    d = decide(8, MetricsSnapshot(8, quiet), targets, history, NOW)
    assert d.slo_recommendation in (0, 1) and d.desired == 8
    assert "scale-down held: attainment unknown" in d.reason and d.signal == "attainment unknown"
    # The routers judged 400 requests since the last sync, all within the SLO: headroom.
    history = replace(history, slo=SloState(time=NOW - 15.0, router_counts=SloCounts(met=1000)))
    d = decide(8, MetricsSnapshot(8, quiet, router_slo=SloCounts(met=1400)), targets, history, NOW)
    # the scale-down rate limit: half the surplus over the size asked (3: KV use) per 60 s, at least 1
    assert d.slo_recommendation in (0, 1) and d.recommendation == 3 and d.desired == 6
    assert d.attainment == 1.0 and d.attainment_source == "router"
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


# The TPOT tail rule: short outputs miss TPOT when a prefill burst lands among their few decode steps.
H100_8B = "h100/llama-3.1-8b"
# Mooncake-like output lengths: a fifth of the requests generate <= 8 tokens (the synthetic trace's CDF).
SHORT_HEAVY = ((2, 0.06), (4, 0.13), (8, 0.21), (16, 0.31), (32, 0.40), (64, 0.49), (256, 0.76), (1024, 0.99))
LONG_ONLY = ((512, 0.0), (1024, 1.0))  # every request generates 512-1024 tokens


def test_output_share_from_a_cdf_or_the_mean():
    share = output_share_at_most(149.0, SHORT_HEAVY)
    assert share(0) == 0.0 and share(1) == pytest.approx(0.03)  # linear from (0, 0) to (2, 0.06)
    assert share(8) == pytest.approx(0.21) and share(12) == pytest.approx(0.26)
    assert share(5000) == pytest.approx(0.99)  # past the last point: held
    geometric = output_share_at_most(149.0, None)
    assert geometric(8) == pytest.approx(1.0 - (1.0 - 1.0 / 149.0) ** 8)
    for bad in (((8, 0.5), (4, 0.6)), ((4, 0.5), (8, 0.4)), ((4, 1.5),)):
        with pytest.raises(ValueError, match="output CDF"):
            output_share_at_most(149.0, bad)


def test_tpot_tail_share_grows_with_prefill_steps_and_short_outputs():
    short = output_share_at_most(149.0, SHORT_HEAVY)
    # A prefill step within the target never makes a request miss on its own.
    assert tpot_tail_share(0.2, 2.0, 0.04, 0.01, 0.05, short) == 0.0
    shares = [tpot_tail_share(q, 2.0, 0.3, 0.012, 0.05, short) for q in (0.001, 0.005, 0.02, 0.1)]
    assert 0.0 < shares[0] < shares[1] < shares[2] < shares[3] < 1.0
    # The same prefill steps hurt a short-heavy mix far more than one of long outputs only.
    long = output_share_at_most(768.0, LONG_ONLY)
    assert tpot_tail_share(0.02, 2.0, 0.3, 0.012, 0.05, long) < 1e-6 < shares[2]
    # Longer prefill steps (or a tighter target) miss more requests.
    assert tpot_tail_share(0.02, 2.0, 0.6, 0.012, 0.05, short) > shares[2]
    assert tpot_tail_share(0.02, 2.0, 0.3, 0.012, 0.03, short) > shares[2]


def test_capacity_within_the_tpot_tail_budget():
    cal, slo = calibration_by_name(H100_8B), Slo(2.0, 0.05, 2.0)
    mean_step_only = replica_capacity(cal, slo, 15_000, 149, 0.85)
    geometric = replica_capacity(cal, slo, 15_000, 149, 0.85, DEFAULT_TPOT_TAIL_BUDGET)
    short_heavy = replica_capacity(cal, slo, 15_000, 149, 0.85, DEFAULT_TPOT_TAIL_BUDGET, SHORT_HEAVY)
    looser = replica_capacity(cal, slo, 15_000, 149, 0.85, 4 * DEFAULT_TPOT_TAIL_BUDGET, SHORT_HEAVY)
    assert 0.0 < short_heavy < looser and short_heavy < geometric <= mean_step_only
    # Short prompts (one small chunk, a prefill step within the TPOT target): the rule costs nothing.
    assert replica_capacity(cal, slo, 600, 200, 0.85, DEFAULT_TPOT_TAIL_BUDGET, SHORT_HEAVY) == pytest.approx(
        replica_capacity(cal, slo, 600, 200, 0.85)
    )


def test_planner_sizes_for_the_tpot_tail_of_short_outputs():
    base = {"minReplicas": 1, "maxReplicas": 50, "slo": SLO}
    mean_only = ScalingTargets.from_spec(base, max_num_seqs=256)
    assert mean_only.slo is not None and mean_only.slo.tpot_tail_budget is None  # off by default
    tail_on = replace(mean_only, slo=replace(mean_only.slo, tpot_tail_budget=DEFAULT_TPOT_TAIL_BUDGET))
    assert tail_on.slo is not None
    told = replace(tail_on, slo=replace(tail_on.slo, output_cdf=SHORT_HEAVY))
    # 4 replicas each finished 15 requests in 15 s (4 req/s in all) of 15,000 + 149 tokens.
    samples = tuple(
        sample(f"p{i}", 1015, 2_000_000 + 15 * 15_000, 200_000 + 15 * 149, kv=0.3) for i in range(4)
    )
    snap = MetricsSnapshot(4, samples)
    needs = {
        name: decide(4, snap, t, previous(4, mix=(15_000.0, 149.0)), NOW).slo_recommendation
        for name, t in (("mean", mean_only), ("geometric", tail_on), ("cdf", told))
    }
    assert None not in needs.values()
    assert needs["mean"] <= needs["geometric"] < needs["cdf"]  # type: ignore[operator]
    # decide() stays pure: the same inputs give the same decision.
    before = previous(4, mix=(15_000.0, 149.0))
    assert decide(4, snap, told, before, NOW) == decide(4, snap, told, before, NOW)
    with pytest.raises(ValueError, match="tpot_tail_budget"):
        replace(tail_on.slo, tpot_tail_budget=1.5)
    with pytest.raises(ValueError, match="output CDF"):
        replace(tail_on.slo, output_cdf=((8, 0.5), (4, 0.6)))


def test_token_mix_is_a_running_mean_over_requests_not_syncs():
    assert smooth_token_mix(None, (10.0, 150_000.0, 1_500.0)) == (15_000.0, 150.0)
    # A sync with a few long prompts barely moves an established mix; thousands of them replace it.
    few = smooth_token_mix((15_000.0, 150.0), (10.0, 10 * 60_000.0, 10 * 20.0))
    many = smooth_token_mix((15_000.0, 150.0), (4_000.0, 4_000 * 60_000.0, 4_000 * 20.0))
    w = 10.0 / (10.0 + TOKEN_MIX_WINDOW_REQUESTS)
    assert few == pytest.approx((15_000 + w * 45_000, 150 - w * 130))
    assert few[0] < 18_000 < 55_000 < many[0] < 60_000


def test_the_prompt_side_follows_the_prompts_admitted():
    """Where replicas count the prompts they admit, the mix's prompt side follows those (known when a
    request arrives); the output side can only follow the requests finished."""
    w = 100.0 / (100.0 + TOKEN_MIX_WINDOW_REQUESTS)
    # 10 finished of 15,000 + 150 tokens; 100 admitted of 45,000 (the mix tripled on arrival)
    mixed = smooth_token_mix((15_000.0, 150.0), (10.0, 150_000.0, 1_500.0), (100.0, 100 * 45_000.0))
    assert mixed == pytest.approx((15_000 + w * 30_000, 150.0))
    # none finished this sync: the prompt side moves, the output side waits
    early = smooth_token_mix((15_000.0, 150.0), None, (100.0, 100 * 45_000.0))
    assert early == pytest.approx((15_000 + w * 30_000, 150.0))
    # admissions counted and none came: the finished prompts are not mixed in (they are older news)
    assert smooth_token_mix((15_000.0, 150.0), (10.0, 10 * 60_000.0, 1_500.0), (0.0, 0.0)) == (
        15_000.0,
        150.0,
    )
    # no replica counts admissions (vLLM): the finished requests' prompts, as before
    w10 = 10.0 / (10.0 + TOKEN_MIX_WINDOW_REQUESTS)
    vllm = smooth_token_mix((15_000.0, 150.0), (10.0, 10 * 30_000.0, 1_500.0), None)
    assert vllm == pytest.approx((15_000 + w10 * 15_000, 150.0))
    # nothing finished yet: no mix (an output length is needed), whatever was admitted
    assert smooth_token_mix(None, None, (100.0, 100 * 45_000.0)) is None
    assert smooth_token_mix(None, (4.0, 4 * 900.0, 40.0), (0.0, 0.0)) == (900.0, 10.0)


def test_decide_reads_the_admitted_prompts_per_replica():
    """Through decide(): two replicas counted their admissions since the last sync, and one that
    restarted (its counter went down) is left out of them."""
    targets = ScalingTargets.from_spec({"minReplicas": 1, "maxReplicas": 50, "slo": SLO}, max_num_seqs=256)
    before = previous(3, mix=(2000.0, 200.0))
    before = replace(
        before,
        arrivals=replace(
            before.arrivals,
            counters=tuple(
                replace(c, admitted=500.0, admitted_prompt_tokens=500 * 2000.0)
                for c in before.arrivals.counters
            ),
        ),
    )
    finished = (1010, 2_000_000 + 10 * 2000, 200_000 + 10 * 200)  # 10 more finished, of the old mix
    samples = (
        replace(
            sample("p0", *finished),
            admitted_total=550.0,
            admitted_prompt_tokens_total=500 * 2000.0 + 50 * 8000,
        ),
        replace(
            sample("p1", *finished),
            admitted_total=550.0,
            admitted_prompt_tokens_total=500 * 2000.0 + 50 * 8000,
        ),
        replace(
            sample("p2", *finished), admitted_total=3.0, admitted_prompt_tokens_total=3 * 90_000.0
        ),  # restarted
    )
    d = decide(3, MetricsSnapshot(3, samples), targets, before, NOW)
    w = 100.0 / (100.0 + TOKEN_MIX_WINDOW_REQUESTS)
    assert d.token_mix == pytest.approx((2000.0 + w * 6000.0, 200.0))
    # the requests judged (finished) are still of the old mix: kept beside it for the closed loop
    assert d.history.arrivals.judged_prompt == pytest.approx(2000.0)
    counters = {c.pod: c for c in d.history.arrivals.counters}
    assert (counters["p2"].admitted, counters["p2"].admitted_prompt_tokens) == (3.0, 270_000.0)
    back = arrivals_from_status(arrivals_to_status(d.history.arrivals))
    assert back.counters == d.history.arrivals.counters  # remembered across a restart of the autoscaler


def test_planner_waits_for_enough_finished_requests():
    """The first requests to finish after a cold start are the short ones: the planner does not size
    from a mix until MIN_MIX_REQUESTS finished."""
    assert MIN_MIX_REQUESTS > 40.0
    targets = ScalingTargets.from_spec({"minReplicas": 1, "maxReplicas": 50, "slo": SLO}, max_num_seqs=256)
    # 4 replicas finished 10 requests each (40 < MIN_MIX_REQUESTS) of 23,000 + 11 tokens.
    few = tuple(sample(f"p{i}", 1010, 2_000_000 + 10 * 23_000, 200_000 + 10 * 11) for i in range(4))
    d = decide(4, MetricsSnapshot(4, few), targets, previous(4), NOW)
    assert d.slo_recommendation is None and d.token_mix == (23_000.0, 11.0)
    assert d.history.arrivals.mix_requests == 40.0
    # Next sync: 160 more (200 in all): now it sizes.
    more = tuple(sample(f"p{i}", 1050, 2_230_000 + 40 * 2000, 200_110 + 40 * 200) for i in range(4))
    d2 = decide(4, MetricsSnapshot(4, more), targets, d.history, NOW + 15.0)
    assert d2.slo_recommendation is not None and d2.history.arrivals.mix_requests == 200.0
    assert MIN_MIX_REQUESTS <= 200.0
    # A mix read back from the status counts as established.
    back = arrivals_from_status(arrivals_to_status(d2.history.arrivals))
    assert back.mix_requests >= MIN_MIX_REQUESTS


# -- the TPOT tail rule's inputs: spec.autoscaling.slo.tpotTailBudget and the output-length histogram --


def test_output_cdf_from_buckets() -> None:
    from kvpilot.autoscaler.slo import output_cdf_from_buckets

    inf = float("inf")
    buckets = ((1.0, 10.0), (2.0, 50.0), (4.0, 100.0), (8.0, 150.0), (16.0, 200.0), (inf, 400.0))
    assert output_cdf_from_buckets(buckets) == ((1, 0.025), (2, 0.125), (4, 0.25), (8, 0.375), (16, 0.5))
    # Summed over replicas: the same le adds up; too few requests: nothing measured yet.
    assert output_cdf_from_buckets((*buckets, (2.0, 50.0), (inf, 100.0)))[1] == (2, 0.2)  # type: ignore[index]
    assert output_cdf_from_buckets(((4.0, 50.0), (inf, 199.0))) is None
    assert output_cdf_from_buckets(((4.0, 50.0), (inf, 100.0)), min_requests=100) == ((4, 0.5),)
    assert output_cdf_from_buckets(()) is None
    # A sub-token bound and a counter that went down between buckets are tolerated (never decreasing).
    assert output_cdf_from_buckets(((0.5, 0.0), (1.0, 120.0), (2.0, 110.0), (inf, 400.0))) == (
        (1, 0.3),
        (2, 0.3),
    )
    output_share_at_most(1.0, output_cdf_from_buckets(buckets))  # a valid CDF for the tail rule


def test_tail_budget_from_the_spec() -> None:
    assert SloTargets.from_spec(SLO).tpot_tail_budget is None
    assert SloTargets.from_spec({**SLO, "tpotTailBudget": 0.005}).tpot_tail_budget == 0.005
    with pytest.raises(ValueError, match="tpot_tail_budget"):
        SloTargets.from_spec({**SLO, "tpotTailBudget": 1.5})


def _tail_case(buckets: tuple[tuple[float, float], ...] | None) -> tuple[MetricsSnapshot, History]:
    """Mooncake-like mix (15k-token prompts, 150-token outputs) established, 4 req/s arriving."""
    samples = tuple(
        ReplicaSample(
            f"p{i}",
            0.3,
            0,
            8,
            1000.0 + 30,
            prompt_tokens_total=1.5e7 + 30 * 15000,
            generation_tokens_total=150000.0 + 30 * 150,
            output_tokens_buckets=buckets,
        )
        for i in range(2)
    )
    counters = tuple(PodCounter(f"p{i}", 1000.0, 8, 1.5e7, 150000.0) for i in range(2))
    arrivals = ArrivalState(
        time=NOW - 15.0,
        counters=counters,
        token_mix=(15000.0, 150.0),
        mix_requests=MIN_MIX_REQUESTS,
        service_rate=1.0,
    )
    return MetricsSnapshot(2, samples), History(arrivals=arrivals)


def test_tail_rule_reads_output_lengths_from_the_replicas_histograms() -> None:
    """With tpotTailBudget set, the capacity uses the output-length distribution the replicas export
    (summed over them); without a histogram it is geometric at the mean; a configured one wins."""
    inf = float("inf")
    # Bimodal, as Mooncake's: a third of the outputs are <= 8 tokens (a geometric guess at mean 150: 5%).
    per_replica = (
        (2.0, 60.0),
        (4.0, 90.0),
        (8.0, 100.0),
        (64.0, 120.0),
        (128.0, 150.0),
        (256.0, 280.0),
        (inf, 300.0),
    )
    slo = replace(SloTargets.from_spec(SLO), tpot_tail_budget=DEFAULT_TPOT_TAIL_BUDGET)
    targets = ScalingTargets(min_replicas=1, max_replicas=100, slo=slo)

    snap, hist = _tail_case(per_replica)
    measured = decide(2, snap, targets, hist, NOW)
    assert "TPOT tail within 0.5% (measured output lengths)" in measured.reason
    cdf = ((2, 0.2), (4, 0.3), (8, 0.333), (64, 0.4), (128, 0.5), (256, 0.933))
    told = decide(2, snap, replace(targets, slo=replace(slo, output_cdf=cdf)), hist, NOW)
    assert "(configured output lengths)" in told.reason
    assert measured.slo_capacity == told.slo_capacity  # the same distribution, read from the metrics

    snap0, hist0 = _tail_case(None)
    guessed = decide(2, snap0, targets, hist0, NOW)
    assert "(geometric output lengths)" in guessed.reason
    assert measured.slo_capacity is not None and guessed.slo_capacity is not None
    # Short outputs miss TPOT when a prefill lands among their few steps: the measured share of them
    # (a third) leaves a replica less capacity than the geometric guess does.
    assert measured.slo_capacity < guessed.slo_capacity
    assert measured.slo_recommendation is not None and guessed.slo_recommendation is not None
    assert measured.slo_recommendation > guessed.slo_recommendation

    off = decide(
        2,
        snap,
        ScalingTargets(min_replicas=1, max_replicas=100, slo=replace(slo, tpot_tail_budget=None)),
        hist,
        NOW,
    )
    assert "TPOT tail" not in off.reason  # opt-in: without the budget the histogram is not used
