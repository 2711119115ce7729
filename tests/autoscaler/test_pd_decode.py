"""The decode role's KV link (pd_decode, pd_link), the TTFT breakdown, the prefill wake on long prompts
served direct (pd_signals), and what they keep in status (pd_state)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.feedback import SloState
from kvpilot.autoscaler.pd_decode import LinkState, PullCounter, TtftState, measure_link
from kvpilot.autoscaler.pd_link import Link, Pull
from kvpilot.autoscaler.pd_policy import PdSnapshot, PdState, PdTargets, decide_pd
from kvpilot.autoscaler.pd_signals import RouterPdCounts, parse_router_pd
from kvpilot.autoscaler.pd_state import pd_decision_to_status, pd_state_from_status
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.sources import parse_metrics_text
from tests.autoscaler.test_controller import T0

SLO = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 2, "tpotSeconds": 0.05}
GB = 1e9


def targets(**autoscaling: object) -> PdTargets:
    spec = {"minReplicas": 1, "maxReplicas": 20, "slo": SLO, **autoscaling}
    return PdTargets.from_spec(spec, {"decode": {"maxReplicas": 10}})


def decode_pods(pulls: list[tuple[float, float, float]], kv: float = 0.05) -> MetricsSnapshot:
    """Decode pods with their pull counters: (seconds sum, pulls, bytes received) each."""
    return MetricsSnapshot(
        len(pulls),
        tuple(
            ReplicaSample(
                f"d{i}",
                kv,
                0,
                2,
                0.0,
                kv_transfer_seconds_total=s,
                kv_transfers_total=n,
                kv_transfer_bytes_total=b,
            )
            for i, (s, n, b) in enumerate(pulls)
        ),
    )


def idle_prefill(n: int = 2) -> MetricsSnapshot:
    return MetricsSnapshot(
        n, tuple(ReplicaSample(f"p{i}", 0.05, 0, 1, 0.0, prompt_tokens_total=0.0) for i in range(n))
    )


# -- the link, as the runtime pulls ------------------------------------------------------------------


def test_concurrent_pulls_share_the_link_and_the_budget_and_deadline_hold():
    link: Link[str] = Link(bytes_s=10 * GB, budget=30 * GB)
    link.advance(0.0)
    assert link.start(Pull("a", 10 * GB, 0.0, 100.0)) and link.start(Pull("b", 10 * GB, 0.0, 100.0))
    # Two pulls at once move at half the link each: both end at 2 s, not one at 1 s and one at 2 s.
    assert link.next_event() == pytest.approx(2.0)
    done, late = link.advance(2.0)
    assert sorted(p.key for p in done) == ["a", "b"] and not late
    assert link.seconds_total == pytest.approx(4.0) and link.pulls_total == 2
    # The budget: a pull that does not fit waits (its time counts), one larger than the budget never runs.
    assert not link.start(Pull("huge", 31 * GB, 2.0, 100.0))
    link.start(Pull("c", 20 * GB, 2.0, 100.0))
    link.start(Pull("d", 20 * GB, 2.0, 3.0))  # waits for c's budget, past its deadline
    done, late = link.advance(3.0)
    assert not done and [p.key for p in late] == ["d"]
    done, _ = link.advance(4.0)
    assert [p.key for p in done] == ["c"] and link.fallbacks == 2


def test_the_link_estimate_is_a_pull_rate_alone_and_the_bytes_moved_when_busy():
    prev = LinkState(time=T0, counters=(PullCounter("d0", 0.0, 0.0, 0.0),))
    # 15 s, 3 pulls of 2 GB that never overlapped, 0.2 s each: 10 GB/s, a little in flight.
    m, link, _ = measure_link(decode_pods([(0.6, 3, 6 * GB)]), prev, T0 + 15)
    assert m is not None and m.pull_s == pytest.approx(0.2)
    assert link == pytest.approx(6 * GB / 0.6 * (1 + 0.6 / 15))
    # A link busy all the time with pulls queued: 150 GB in 15 s, 20 in flight on average.
    _, busy, _ = measure_link(decode_pods([(300.0, 75, 150 * GB)]), prev, T0 + 15)
    assert busy == pytest.approx(150 * GB / 300.0 * 21)  # 10.5 GB/s: near the 10 GB/s it moved
    assert busy is not None and busy >= 150 * GB / 15


def test_decode_grows_on_its_kv_link_when_pulls_outrun_it():
    t = targets(scaleDownStabilizationSeconds=0)
    before = decode_pods([(0.0, 0.0, 0.0)])
    first = decide_pd((2, 1), PdSnapshot(idle_prefill(), before), t, PdState(), T0)
    assert first.desired == (2, 1)
    # 15 s later the one decode pod received 180 GB (12 GB/s) in 60 pulls, ~30 in flight: its
    # 12.4 GB/s link is saturated; KV use and slots are low.
    snap = PdSnapshot(idle_prefill(), decode_pods([(450.0, 60, 180 * GB)]))
    d = decide_pd((2, 1), snap, t, first.state, T0 + 15)
    assert d.decode.signal == "KV link" and d.decode.desired == 2
    assert "KV pulls 12.00 GB/s" in d.reason and "[signal: KV link]" in d.reason
    assert d.decode_decision.desired == 1  # the aggregated policy alone would hold
    assert d.state.link.link_bytes_s == pytest.approx(180 * GB / 450.0 * 31)
    assert d.decode.demand == pytest.approx(12 * GB / (d.state.link.link_bytes_s * 0.6))


# -- the TTFT breakdown ----------------------------------------------------------------------------


def _measured(router: RouterPdCounts, link: LinkState) -> PdState:
    return PdState(
        slo=SloState(time=T0, router_counts=SloCounts(met=1000), source="router"),
        ttft=TtftState(time=T0, router=router),
        link=link,
    )


def test_ttft_misses_from_pulls_queued_at_decode_grow_decode_not_prefill():
    t = targets()
    link = LinkState(time=T0, counters=(PullCounter("d0", 0.0, 0.0, 0.0), PullCounter("d1", 0.0, 0.0, 0.0)))
    state = _measured(RouterPdCounts(0.0, 0.0), link)
    # 100 prefill legs of 0.5 s for 2000-token prompts (0.08 s at the prefill throughput); 100 pulls
    # of 0.25 GB taking 4 s each on links that move one in ~0.3 s: the waits are the pulls'.
    prefill = MetricsSnapshot(
        2,
        tuple(ReplicaSample(f"p{i}", 0.05, 0, 1, 50.0, prompt_tokens_total=50 * 2000.0) for i in range(2)),
    )
    prev_prefill = replace(
        prefill,
        samples=tuple(replace(s, completed_total=0.0, prompt_tokens_total=0.0) for s in prefill.samples),
    )
    first = decide_pd(
        (2, 2),
        PdSnapshot(prev_prefill, decode_pods([(0.0, 0, 0.0), (0.0, 0, 0.0)])),
        t,
        replace(state, ttft=TtftState()),
        T0,
    )
    state = replace(first.state, slo=state.slo, ttft=state.ttft)
    snap = PdSnapshot(
        prefill,
        decode_pods([(200.0, 50, 12.5 * GB), (200.0, 50, 12.5 * GB)], kv=0.3),
        router_slo=SloCounts(met=1150, missed_ttft=50),
        router_pd=RouterPdCounts(prefill_seconds=50.0, prefill_legs=100.0),
    )  # fmt: skip
    d = decide_pd((2, 2), snap, t, state, T0 + 15)
    share = d.state.ttft.decode_share
    assert share is not None and share > 0.8
    assert d.state.ttft.transfer_wait_s is not None and d.state.ttft.transfer_wait_s > 3.0
    assert d.decode.desired > 2
    assert d.prefill.desired <= 2 and d.prefill.signal != "measured attainment"
    assert "TTFT misses" in d.reason and "decode's" in d.reason
    # The same misses with no breakdown measured (no router P/D counters): the prefill role's, as before.
    alone = decide_pd((2, 2), replace(snap, router_pd=None), t, replace(state, ttft=TtftState()), T0 + 15)
    assert alone.state.ttft.decode_share is None
    assert alone.prefill.desired == 3 and alone.prefill.signal == "measured attainment"


# -- prefill from zero while decode runs -------------------------------------------------------------


def test_prefill_wakes_from_zero_on_long_prompts_served_direct():
    t = targets(minReplicas=0)
    decode = MetricsSnapshot(1, (ReplicaSample("d0", 0.2, 0, 3, 10.0),))
    base = PdSnapshot(MetricsSnapshot(0), decode, router_queue=0, router_pd=RouterPdCounts(no_prefill=4.0))
    first = decide_pd((0, 1), base, t, PdState(), T0)
    assert first.prefill.desired == 0  # the first reading is a baseline
    # Short prompts only since (the router's no_prefill counter did not move): prefill stays at zero.
    same = decide_pd((0, 1), base, t, first.state, T0 + 15)
    assert same.prefill.desired == 0 and same.prefill.signal == "idle"
    grew = decide_pd((0, 1), replace(base, router_pd=RouterPdCounts(no_prefill=7.0)), t, same.state, T0 + 30)
    assert grew.prefill.desired == 1 and grew.prefill.signal == "long prompts direct"
    assert "3 long prompts served by decode pods" in grew.reason


def test_router_pd_counters_parse_from_a_router_page():
    reg = CollectorRegistry()
    paths = Counter("kvpilot_router_pd_requests", "", ["model_name", "path"], registry=reg)
    legs = Histogram("kvpilot_router_pd_prefill_seconds", "", ["model_name"], registry=reg)
    paths.labels("chat", "direct").inc(5)
    paths.labels("chat", "no_prefill").inc(2)
    paths.labels("chat", "disaggregated").inc(3)
    for s in (0.5, 1.0, 1.5):
        legs.labels("chat").observe(s)
    got = parse_router_pd(generate_latest(reg).decode())
    assert got == {"chat": RouterPdCounts(prefill_seconds=3.0, prefill_legs=3.0, no_prefill=2.0)}


def test_a_decode_pods_pull_counters_parse_from_its_page():
    reg = CollectorRegistry()
    Counter("kvpilot_kv_transfer_bytes", "", ["model_name", "direction"], registry=reg).labels(
        "m", "received"
    ).inc(9e9)
    Counter("kvpilot_kv_transfer_bytes", "", ["model_name", "direction"], registry=CollectorRegistry())
    h = Histogram("kvpilot_kv_transfer_seconds", "", ["model_name"], registry=reg)
    h.labels("m").observe(0.25)
    h.labels("m").observe(0.75)
    page = generate_latest(reg).decode()
    page += (
        'kvpilot_kv_cache_usage_ratio{model_name="m"} 0.1\nkvpilot_num_requests_waiting{model_name="m"} 0\n'
    )
    s = parse_metrics_text(page, "d0", "m")
    assert s is not None
    assert (s.kv_transfer_seconds_total, s.kv_transfers_total, s.kv_transfer_bytes_total) == (1.0, 2.0, 9e9)


def test_status_round_trip_keeps_the_link_estimate_and_the_ttft_breakdown():
    t = targets()
    state = replace(
        PdState(),
        link=LinkState(time=T0 - 15, counters=(PullCounter("d0", 0.0, 0.0, 0.0),), link_bytes_s=12 * GB),
        ttft=TtftState(time=T0 - 15, router=RouterPdCounts(10.0, 20.0, 1.0), decode_share=0.4),
    )
    snap = PdSnapshot(
        idle_prefill(), decode_pods([(30.0, 20, 40 * GB)]), router_pd=RouterPdCounts(20.0, 40.0, 1.0)
    )
    d = decide_pd((2, 1), snap, t, state, T0)
    block = pd_decision_to_status(d, t, T0, None)
    back = pd_state_from_status(block)
    assert back.link.counters == d.state.link.counters
    assert back.link.link_bytes_s == pytest.approx(d.state.link.link_bytes_s, rel=1e-6)  # type: ignore[arg-type]
    assert [r.replicas for r in back.link.recommendations] == [
        r.replicas for r in d.state.link.recommendations
    ]
    assert len(back.link.rates) == 1
    assert back.ttft.router == RouterPdCounts(20.0, 40.0, 1.0)
    assert back.ttft.decode_share == pytest.approx(d.state.ttft.decode_share or 0.0, abs=1e-4)
    assert block["disaggregation"]["decode"]["linkBytesPerSecond"] > 0
