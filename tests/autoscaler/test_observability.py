"""The autoscaler's liveness/readiness and Prometheus metrics: the pure health decision, the health
server, and the real registry's text after driving the controller against the in-memory Kube fake."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler.controller import ControllerConfig, ScalingController, SyncObserver
from kvpilot.autoscaler.liveness import LoopHealth, loop_liveness, loop_readiness, stale_after
from kvpilot.autoscaler.metrics import AutoscalerMetrics
from kvpilot.autoscaler.samples import ReplicaSample
from kvpilot.kube.health import Probe, start_health_server
from tests.autoscaler.test_controller import T0, FakeKube, FakeSource, model, pod

# -- the health decision (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(("interval", "limit"), [(1, 60), (15, 60), (20, 60), (30, 90), (120, 360)])
def test_stale_after_is_three_intervals_but_at_least_a_minute(interval: float, limit: float) -> None:
    assert stale_after(interval) == limit


@pytest.mark.parametrize(
    ("now", "last_turn", "ok", "words"),
    [
        (100.0, None, True, "since start, no turn finished"),  # just started
        (159.9, None, True, "59.9s since start"),
        (160.0, None, False, "control loop stale: 60.0s since start, no turn finished (limit 60s)"),
        (500.0, 450.0, True, "50.0s since the last turn"),
        (500.0, 440.0, False, "control loop stale: 60.0s since the last turn (limit 60s)"),
        (10_000.0, 9_000.0, False, "1000.0s since the last turn"),
    ],
)
def test_loop_liveness(now: float, last_turn: float | None, ok: bool, words: str) -> None:
    probe = loop_liveness(now, started=100.0, last_turn=last_turn, interval_s=15.0)
    assert probe.ok is ok
    assert words in probe.detail


def test_loop_liveness_scales_with_a_long_interval() -> None:
    assert loop_liveness(1_089.0, 0.0, 1_000.0, interval_s=30.0).ok  # 89 s < 3 x 30 s
    assert not loop_liveness(1_090.0, 0.0, 1_000.0, interval_s=30.0).ok


def test_loop_readiness_after_the_first_turn() -> None:
    assert not loop_readiness(None).ok
    assert loop_readiness(5.0) == Probe(True, "ok")


def test_loop_health_follows_the_turns() -> None:
    now = [1000.0]
    health = LoopHealth(15.0, clock=lambda: now[0])
    assert health.liveness().ok and not health.readiness().ok
    now[0] += 30
    health.iteration_finished(leader=False)
    assert health.readiness().ok
    assert health.liveness().detail.endswith("(standby)")
    now[0] += 61
    probe = health.liveness()
    assert not probe.ok and "61.0s since the last turn" in probe.detail
    health.iteration_finished(leader=True)
    assert health.liveness().ok and health.liveness().detail.endswith("(leader)")


# -- the health server (kvpilot.kube.health, shared with the operator) -----------------------------------------


def get(url: str, method: str = "GET") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[list[float], LoopHealth, str]]:
    now = [1000.0]
    health = LoopHealth(15.0, clock=lambda: now[0])

    def broken() -> Probe:
        raise RuntimeError("boom")

    server = start_health_server(0, {**health.checks(), "/broken": broken}, host="127.0.0.1")
    try:
        yield now, health, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_health_server_answers_the_probes(served: tuple[list[float], LoopHealth, str]) -> None:
    now, health, base = served
    assert get(f"{base}/healthz")[0] == 200
    status, body = get(f"{base}/readyz")
    assert status == 503 and "first turn" in body
    health.iteration_finished(leader=True)
    assert get(f"{base}/readyz") == (200, "ok\n")
    assert get(f"{base}/livez")[0] == 200
    assert get(f"{base}/healthz", method="HEAD") == (200, "")
    now[0] += 90
    status, body = get(f"{base}/healthz")
    assert status == 503
    assert body == "control loop stale: 90.0s since the last turn (limit 60s) (leader)\n"
    assert get(f"{base}/readyz")[0] == 200  # readiness only says the first turn finished
    assert get(f"{base}/metrics")[0] == 404
    status, body = get(f"{base}/broken")
    assert status == 503 and "RuntimeError: boom" in body


# -- metrics, scraped from the real registry --------------------------------------------------------------


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample, keyed by name{label="value",...} (labels sorted); no _created samples."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


CHAT = '{model="chat",namespace="ml"}'


def controller(
    kube: FakeKube, src: FakeSource, now: list[float], metrics: AutoscalerMetrics, **kw: Any
) -> ScalingController:
    cfg = ControllerConfig(namespace="ml", interval_s=kw.pop("interval_s", 15.0))
    return ScalingController(kube, cfg, clock=lambda: now[0], pod_source=src, observers=[metrics], **kw)


def saturated() -> tuple[FakeKube, FakeSource]:
    kube = FakeKube(model(3), [pod("a"), pod("b"), pod("c")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.91, 0, 10) for n in "abc"}
    return kube, src


def test_every_metric_is_exposed_before_anything_happens() -> None:
    m = AutoscalerMetrics()
    text = scrape(m.registry)
    assert text["kvpilot_autoscaler_leader"] == 0
    assert text["kvpilot_autoscaler_syncs_total"] == 0
    assert text["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] == 0
    assert text["kvpilot_autoscaler_sync_duration_seconds_count"] == 0
    for stage in ("list", "model", "event"):
        assert text[f'kvpilot_autoscaler_sync_errors_total{{stage="{stage}"}}'] == 0
    for direction in ("up", "down"):
        assert text[f'kvpilot_autoscaler_scale_writes_total{{direction="{direction}"}}'] == 0
    assert all(k.startswith("kvpilot_autoscaler_") for k in text)
    assert not any("_replicas{" in k for k in text)  # no model yet, no per-model series


async def test_a_scale_up_shows_in_the_metrics() -> None:
    kube, src = saturated()
    m = AutoscalerMetrics()
    await controller(kube, src, [T0], m).sync_all()
    text = scrape(m.registry)
    assert text["kvpilot_autoscaler_syncs_total"] == 1
    assert text["kvpilot_autoscaler_sync_duration_seconds_count"] == 1
    assert text['kvpilot_autoscaler_sync_duration_seconds_bucket{le="+Inf"}'] == 1
    assert text["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] == T0
    assert text['kvpilot_autoscaler_scale_writes_total{direction="up"}'] == 1
    assert text['kvpilot_autoscaler_scale_writes_total{direction="down"}'] == 0
    assert text[f"kvpilot_autoscaler_desired_replicas{CHAT}"] == 4
    assert text[f"kvpilot_autoscaler_current_replicas{CHAT}"] == 3
    assert text[f"kvpilot_autoscaler_reporting_replicas{CHAT}"] == 3
    assert sum(v for k, v in text.items() if k.startswith("kvpilot_autoscaler_sync_errors_total")) == 0


async def test_a_hold_writes_no_scale_and_counts_reporting_replicas() -> None:
    kube = FakeKube(model(3), [pod("a"), pod("b"), pod("c")])
    src = FakeSource()
    src.samples = {"a": ReplicaSample("a", 0.5, 0, 5)}  # two of three did not answer: hold
    m = AutoscalerMetrics()
    await controller(kube, src, [T0], m).sync_all()
    text = scrape(m.registry)
    assert text[f"kvpilot_autoscaler_desired_replicas{CHAT}"] == 3
    assert text[f"kvpilot_autoscaler_reporting_replicas{CHAT}"] == 1
    assert text['kvpilot_autoscaler_scale_writes_total{direction="up"}'] == 0


async def test_failures_are_counted_by_stage_and_keep_the_last_success() -> None:
    kube, src = saturated()
    now = [T0]
    m = AutoscalerMetrics()
    ctl = controller(kube, src, now, m)
    await ctl.sync_all()

    class Broken(FakeKube):
        async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
            raise RuntimeError("apiserver hiccup")

    now[0] = T0 + 15
    ctl.api = Broken(kube.model, [])
    assert await ctl.sync_all() == []
    text = scrape(m.registry)
    assert text['kvpilot_autoscaler_sync_errors_total{stage="model"}'] == 1
    assert text["kvpilot_autoscaler_syncs_total"] == 2
    assert text["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] == T0
    assert text[f"kvpilot_autoscaler_desired_replicas{CHAT}"] == 4  # a failed sync keeps the last decision

    class NoList(FakeKube):
        async def list_models(self, namespace: str | None) -> list[dict[str, Any]]:
            raise RuntimeError("403 Forbidden")

    ctl.api = NoList(kube.model, [])
    with pytest.raises(RuntimeError):
        await ctl.sync_all()
    text = scrape(m.registry)
    assert text['kvpilot_autoscaler_sync_errors_total{stage="list"}'] == 1
    assert text["kvpilot_autoscaler_syncs_total"] == 3
    assert text["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] == T0


async def test_an_event_failure_is_counted_but_the_sync_succeeded() -> None:
    class NoEvents(FakeKube):
        async def create_event(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("events are forbidden")

    kube, src = saturated()
    m = AutoscalerMetrics()
    await controller(NoEvents(kube.model, kube.pods), src, [T0], m).sync_all()
    text = scrape(m.registry)
    assert text['kvpilot_autoscaler_sync_errors_total{stage="event"}'] == 1
    assert text['kvpilot_autoscaler_scale_writes_total{direction="up"}'] == 1
    assert text["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] == T0


async def test_scale_down_and_a_model_that_stops_autoscaling_loses_its_series() -> None:
    kube = FakeKube(model(4, scaleDownStabilizationSeconds=0), [pod(n) for n in "abcd"])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.05, 0, 1) for n in "abcd"}
    m = AutoscalerMetrics()
    ctl = controller(kube, src, [T0], m)
    await ctl.sync_all()
    text = scrape(m.registry)
    assert text['kvpilot_autoscaler_scale_writes_total{direction="down"}'] == 1
    assert text[f"kvpilot_autoscaler_desired_replicas{CHAT}"] < 4
    del kube.model["spec"]["autoscaling"]
    await ctl.sync_all()
    text = scrape(m.registry)
    assert not any(CHAT in k for k in text), [k for k in text if CHAT in k]
    assert text["kvpilot_autoscaler_syncs_total"] == 2


class Switch:
    def __init__(self, leading: bool) -> None:
        self.is_leader = leading


async def test_run_reports_leadership_and_a_standby_drops_the_model_series() -> None:
    kube, src = saturated()
    m = AutoscalerMetrics()
    elector = Switch(True)
    ctl = controller(kube, src, [T0], m, elector=elector, interval_s=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if scrape(m.registry)["kvpilot_autoscaler_syncs_total"] >= 1:
                break
        text = scrape(m.registry)
        assert text["kvpilot_autoscaler_leader"] == 1
        assert f"kvpilot_autoscaler_desired_replicas{CHAT}" in text
        elector.is_leader = False
        syncs = text["kvpilot_autoscaler_syncs_total"]
        await asyncio.sleep(0.1)
        text = scrape(m.registry)
        assert text["kvpilot_autoscaler_leader"] == 0
        assert not any(CHAT in k for k in text)  # only the leader reports decisions
        assert text["kvpilot_autoscaler_syncs_total"] <= syncs + 1  # a standby does not sync
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)


async def test_a_standby_loop_keeps_the_liveness_probe_green() -> None:
    kube, src = saturated()
    health = LoopHealth(0.01)
    ctl = ScalingController(
        kube, ControllerConfig(interval_s=0.01), pod_source=src, elector=Switch(False), observers=[health]
    )
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 2)
    assert health.readiness().ok and health.liveness().ok
    assert kube.calls == []


async def test_a_broken_observer_never_stops_scaling() -> None:
    class Broken(SyncObserver):
        def model_synced(self, result: Any) -> None:
            raise ValueError("bug in a hook")

    kube, src = saturated()
    ctl = ScalingController(
        kube, ControllerConfig(namespace="ml"), clock=lambda: T0, pod_source=src, observers=[Broken()]
    )
    results = await ctl.sync_all()
    assert results[0].decision.desired == 4 and kube.model["spec"]["replicas"] == 4


def test_run_flags() -> None:
    from kvpilot.cli import build_parser

    argv = ["autoscaler", "run"]
    args = build_parser(argv).parse_args(argv)
    assert (args.health_port, args.metrics_port) == (8081, 8080)
    argv = ["autoscaler", "run", "--health-port", "0", "--metrics-port", "9100"]
    args = build_parser(argv).parse_args(argv)
    assert (args.health_port, args.metrics_port) == (0, 9100)
    with pytest.raises(SystemExit):
        build_parser(["autoscaler", "run"]).parse_args(["autoscaler", "run", "--health-port", "-1"])
