"""The control loop against an in-memory Kubernetes fake, and the real client against a fake API server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from aiohttp import web

from kvpilot.autoscaler.controller import ControllerConfig, ScalingController, deletion_costs, pod_is_ready
from kvpilot.autoscaler.kube import DELETION_COST, FIELD_MANAGER, KubernetesApi
from kvpilot.autoscaler.policy import History, Recommendation
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.autoscaler.sources import ModelRef, PodTarget
from kvpilot.autoscaler.state import decision_to_status, history_from_status
from kvpilot.kube.times import format_time

T0 = 1_700_000_000.0


class FakeSource:
    def __init__(self) -> None:
        self.samples: dict[str, ReplicaSample] = {}

    async def collect(self, model: ModelRef, pods: Sequence[PodTarget]) -> MetricsSnapshot:
        return MetricsSnapshot(len(pods), tuple(self.samples[p.name] for p in pods if p.name in self.samples))

    async def close(self) -> None:
        pass


class FakeKube:
    def __init__(self, model: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.model = model
        self.pods = pods
        self.calls: list[tuple[str, Any]] = []

    async def list_models(self, namespace: str | None) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(self.model))]

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert selector == f"kvpilot.dev/model={self.model['metadata']['name']}"
        return self.pods

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self.calls.append(("scale", replicas))
        self.model["spec"]["replicas"] = replicas

    async def patch_roles(self, namespace: str, name: str, prefill: int, decode: int) -> None:
        self.calls.append(("roles", (prefill, decode)))
        roles = self.model["spec"]["disaggregation"]
        roles.setdefault("prefill", {})["replicas"] = prefill
        roles.setdefault("decode", {})["replicas"] = decode

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.calls.append(("status", status))
        merged = self.model.setdefault("status", {})
        for k, v in status.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        self.calls.append(("annotate", (name, dict(annotations))))

    async def create_event(
        self, namespace: str, involved: Any, reason: str, message: str, event_type: str = "Normal"
    ):
        self.calls.append(("event", (reason, message, event_type)))


def pod(name: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {}},
        "status": {
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def model(replicas: int | None = 3, **autoscaling: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": "builtin://smollm2-135m-instruct"},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 10, **autoscaling},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"metadata": {"name": "chat", "namespace": "ml", "uid": "u1"}, "spec": spec, "status": {}}


def make(kube: FakeKube, source: FakeSource, now: list[float]) -> ScalingController:
    return ScalingController(kube, ControllerConfig(namespace="ml"), clock=lambda: now[0], pod_source=source)


def calls(kube: FakeKube, kind: str) -> list[Any]:
    return [c[1] for c in kube.calls if c[0] == kind]


async def test_scale_up_writes_scale_status_and_event():
    kube = FakeKube(model(3), [pod("a"), pod("b"), pod("c")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.91, 0, 10) for n in "abc"}
    results = await make(kube, src, [T0]).sync_all()
    assert results[0].decision.desired == 4
    assert calls(kube, "scale") == [4]
    (reason, message, etype) = calls(kube, "event")[0]
    assert (reason, etype) == ("ScaledUp", "Normal")
    assert message.startswith("kv 0.91 > target 0.70 on 3/3 replicas -> 4")
    status = calls(kube, "status")[0]
    assert status["kvCacheUsage"] == "91%"
    last = status["autoscaler"]["lastDecision"]
    assert (last["fromReplicas"], last["toReplicas"]) == (3, 4)
    assert last["metrics"] == {"kvCacheUsage": 0.91, "queueDepth": 0, "readyReplicas": 3, "reporting": 3}
    assert status["autoscaler"]["lastScaleTime"] == format_time(T0)


async def test_restart_continues_from_status_history():
    """A scale-up recommendation written to status keeps a new controller from scaling down."""
    kube = FakeKube(model(3), [pod("a"), pod("b"), pod("c")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.91, 0, 10) for n in "abc"}
    await make(kube, src, [T0]).sync_all()  # -> 4, recommendation 4 recorded in status
    kube.pods.append(pod("d"))
    src.samples = {n: ReplicaSample(n, 0.05, 0, 1) for n in "abcd"}
    # A brand-new controller (restart) 60 s later: the 300 s down window still holds 4.
    fresh = make(kube, src, [T0 + 60])
    r = (await fresh.sync_all())[0]
    assert r.decision.desired == 4
    assert "scale-down stabilization" in r.decision.reason
    # Past the window (and the rate-limit period): one replica down, least loaded pod marked cheapest.
    src.samples["c"] = ReplicaSample("c", 0.0, 0, 0)
    r = (await make(kube, src, [T0 + 400]).sync_all())[0]
    assert r.decision.desired == 3
    costs = dict(calls(kube, "annotate"))
    assert costs["c"][DELETION_COST] == "0"
    assert int(costs["c"][DELETION_COST]) < int(costs["a"][DELETION_COST])
    assert calls(kube, "scale")[-1] == 3
    assert calls(kube, "event")[-1][0] == "ScaledDown"


async def test_missing_metrics_hold_with_warning_event_once():
    kube = FakeKube(model(3), [pod("a"), pod("b"), pod("c"), pod("z", ready=False)])
    src = FakeSource()  # nobody answers
    now = [T0]
    ctl = make(kube, src, now)
    r = (await ctl.sync_all())[0]
    assert r.decision.desired == 3
    assert calls(kube, "scale") == []
    assert calls(kube, "event") == [("ScalingHeld", r.decision.reason, "Warning")]
    assert calls(kube, "status")[0]["kvCacheUsage"] is None
    now[0] += 15
    await ctl.sync_all()
    assert len(calls(kube, "event")) == 1  # the same hold is not re-announced every sync


async def test_scaling_limited_condition_holds():
    m = model(3)
    m["status"]["conditions"] = [{"type": "ScalingLimited", "status": "True", "reason": "Unschedulable"}]
    kube = FakeKube(m, [pod("a"), pod("b"), pod("c")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.99, 20, 10) for n in "abc"}
    r = (await make(kube, src, [T0]).sync_all())[0]
    assert r.decision.desired == 3
    assert calls(kube, "scale") == []
    assert "ScalingLimited" in calls(kube, "event")[0][1]


async def test_unset_replicas_means_min_and_models_without_autoscaling_are_skipped():
    kube = FakeKube(model(None, minReplicas=2), [pod("a"), pod("b")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.7, 0, 5) for n in "ab"}
    r = (await make(kube, src, [T0]).sync_all())[0]
    assert r.decision.current == 2 and r.decision.desired == 2
    del kube.model["spec"]["autoscaling"]
    assert await make(kube, src, [T0]).sync_all() == []


async def test_prometheus_source_is_chosen_from_the_spec():
    created: list[tuple[str, str | None, str | None]] = []

    def factory(url: str, kvq: str | None, qq: str | None) -> FakeSource:
        created.append((url, kvq, qq))
        return FakeSource()

    m = model(2, metricsSource="prometheus", prometheus={"url": "http://prom:9090", "kvQuery": "kv{}"})
    kube = FakeKube(m, [pod("a"), pod("b")])
    ctl = ScalingController(kube, ControllerConfig(), clock=lambda: T0, prometheus_factory=factory)
    await ctl.sync_all()
    await ctl.sync_all()
    assert created == [("http://prom:9090", "kv{}", None)]


async def test_one_broken_model_does_not_stop_the_loop():
    class Broken(FakeKube):
        async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
            raise RuntimeError("apiserver hiccup")

    assert await make(Broken(model(2), []), FakeSource(), [T0]).sync_all() == []


async def test_run_stops_and_respects_leadership():
    class NotLeader:
        is_leader = False

    kube = FakeKube(model(2), [pod("a"), pod("b")])
    ctl = ScalingController(
        kube, ControllerConfig(interval_s=0.01), pod_source=FakeSource(), elector=NotLeader()
    )
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 2)
    assert kube.calls == []  # a follower never writes


def test_pod_readiness_and_deletion_costs():
    assert pod_is_ready(pod("a"))
    assert not pod_is_ready(pod("a", ready=False))
    terminating = pod("a")
    terminating["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert not pod_is_ready(terminating)
    snap = MetricsSnapshot(3, (ReplicaSample("busy", 0.9, 4, 30), ReplicaSample("idle", 0.0, 0, 0)))
    costs = deletion_costs(["busy", "idle", "silent"], snap)
    assert costs["idle"] < costs["busy"] < costs["silent"]


def test_history_round_trips_through_status():
    from kvpilot.autoscaler.policy import decide
    from kvpilot.autoscaler.spec import ScalingTargets

    h = History(recommendations=(Recommendation(T0 - 60, 9, backlog=True), Recommendation(T0 - 30, 5)))
    d = decide(
        5,
        MetricsSnapshot(5, tuple(ReplicaSample(f"p{i}", 0.99, 9, 9) for i in range(5))),
        ScalingTargets(max_replicas=10),
        h,
        T0,
    )
    block = json.loads(json.dumps(decision_to_status(d, T0, None)))
    back = history_from_status(block)
    assert [(r.time, r.replicas, r.backlog) for r in back.recommendations] == [
        (T0 - 60, 9, True),
        (T0 - 30, 5, False),
        (T0, d.recommendation, False),
    ]
    assert [("backlog" in e) for e in block["history"]] == [True, False, False]  # left out when False
    assert [(e.from_replicas, e.to_replicas) for e in back.events] == [(5, d.desired)]
    assert back.last_queue == (T0, 45)
    # Garbage in status is skipped, never guessed.
    assert history_from_status({"history": [{"time": "yesterday", "replicas": 3}, "x"]}) == History()


def _undeclared(value: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Keys of `value` that the structural schema does not declare (the API server would prune them)."""
    if isinstance(value, list):
        return [
            p for i, v in enumerate(value) for p in _undeclared(v, schema.get("items", {}), f"{path}[{i}]")
        ]
    if not isinstance(value, dict):
        return []
    props = schema.get("properties", {})
    return [f"{path}.{k}" for k in value if k not in props] + [
        p for k, v in value.items() if k in props for p in _undeclared(v, props[k], f"{path}.{k}")
    ]


def test_what_the_autoscaler_writes_is_the_crd_status_schema():
    """Every field of status.autoscaler that the controller writes is declared by the shared model's
    CRD schema with a type that accepts it: nothing relies on preserve-unknown-fields any more."""
    import jsonschema

    from kvpilot.api.crd import build_crd
    from kvpilot.autoscaler.policy import ArrivalState, PodCounter, RateSample, decide
    from kvpilot.autoscaler.spec import ScalingTargets

    snapshot = MetricsSnapshot(
        3, tuple(ReplicaSample(f"p{i}", 0.99, 9, 9, completed_total=40.0 + i) for i in range(3))
    )
    arrivals = ArrivalState(
        T0 - 15, (PodCounter("p0", 30.0, 4, 100.0, 50.0),), (RateSample(T0 - 15, 1.5),), 2.0
    )
    d = decide(3, snapshot, ScalingTargets(max_replicas=10), History(arrivals=arrivals), T0)
    block = json.loads(json.dumps(decision_to_status(d, T0, None)))
    block["decidedBy"], block["heldKind"] = "autoscaler-0_1", "stabilization"
    assert block["scaleEvents"] and block["arrivals"]["pods"] and block["arrivals"]["rates"]
    crd = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema = crd["properties"]["status"]["properties"]["autoscaler"]
    assert _undeclared(block, schema) == []
    jsonschema.Draft4Validator(schema).validate(block)


def test_the_written_status_block_is_pinned_and_declared_by_the_crd():
    """decision_to_status builds the shared model and dumps it by alias: this exact JSON (key order,
    whole numbers, second and millisecond times, absent values left out) is what a sync patches."""
    import jsonschema

    from kvpilot.api.crd import build_crd
    from kvpilot.autoscaler.controller import hold_kind
    from kvpilot.autoscaler.policy import ArrivalState, PodCounter, RateSample, ScaleEvent, decide
    from kvpilot.autoscaler.spec import ScalingTargets

    snapshot = MetricsSnapshot(
        4, tuple(ReplicaSample(f"p{i}", 0.1, 0, 1, 40.0 + i, None, 1000.0 + i, 500.0) for i in range(2))
    )
    arrivals = ArrivalState(
        T0 - 15.25,
        (PodCounter("p0", 30.0, 4, 900.0, 450.0), PodCounter("p1", 31.0, 2, 950.0, 480.0)),
        (RateSample(T0 - 15.25, 1.5),),
        2.0,
        (120.04, 33.3),
    )
    h = History((Recommendation(T0 - 30, 4),), (ScaleEvent(T0 - 120, 2, 4),), arrivals=arrivals)
    d = decide(4, snapshot, ScalingTargets(max_replicas=10), h, T0)
    kind = hold_kind(d)
    assert kind == "not-reporting"
    previous = {"lastScaleTime": "2023-11-14T22:11:20Z", "heldKind": "stabilization"}
    block = decision_to_status(d, T0 + 0.9, previous, "autoscaler-0_1", kind)
    expected = {
        "lastDecision": {
            "time": "2023-11-14T22:13:20Z",
            "fromReplicas": 4,
            "toReplicas": 4,
            "reason": d.reason,
            "metrics": {"kvCacheUsage": 0.1, "queueDepth": 0, "readyReplicas": 4, "reporting": 2},
        },
        "history": [
            {"time": "2023-11-14T22:12:50Z", "replicas": 4},
            {"time": "2023-11-14T22:13:20Z", "replicas": 4},
        ],
        "scaleEvents": [{"time": "2023-11-14T22:11:20Z", "fromReplicas": 2, "toReplicas": 4}],
        "lastScaleTime": "2023-11-14T22:11:20Z",
        # the redundancy floor applied (1.8/s forecast, 0.9 of one replica's 2.0/s): held from now on
        "redundancy": {"time": "2023-11-14T22:13:20Z", "replicas": 2, "rate": 1.79918, "perReplica": 2.0},
        "arrivals": {
            "time": "2023-11-14T22:13:20.000Z",
            "pods": [
                {
                    "pod": "p0",
                    "completed": 40.0,
                    "inFlight": 1,
                    "promptTokens": 1000.0,
                    "generationTokens": 500.0,
                },
                {
                    "pod": "p1",
                    "completed": 41.0,
                    "inFlight": 1,
                    "promptTokens": 1001.0,
                    "generationTokens": 500.0,
                },
            ],
            "rates": [
                {"time": "2023-11-14T22:13:04.750Z", "rate": 1.5},
                {"time": "2023-11-14T22:13:20.000Z", "rate": 2.0984},
            ],
            "serviceRate": 2.0,
            "tokenMix": {"prompt": 120.0, "output": 33.3},
            # the surge headroom's first level: the two rates' mean, by the seconds each counts
            "levels": [{"time": "2023-11-14T22:13:20.000Z", "rate": 1.7992}],
        },
        "decidedBy": "autoscaler-0_1",
        "heldKind": "not-reporting",
    }
    assert d.reason.endswith("-> 4 (hold) [signal: replicas not reporting]")
    assert json.dumps(block) == json.dumps(expected)  # the text, so 0 vs 0.0 and key order count too
    crd = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema = crd["properties"]["status"]["properties"]["autoscaler"]
    assert _undeclared(block, schema) == []
    jsonschema.Draft4Validator(schema).validate(block)
    # Reading it back gives the same memory.
    back = history_from_status(block)
    assert back.arrivals.counters[1] == PodCounter("p1", 41.0, 1, 1001.0, 500.0)
    assert [(e.time, e.from_replicas, e.to_replicas) for e in back.events] == [(T0 - 120, 2, 4)]
    assert back.redundancy is not None and back.redundancy[0] == T0 and back.redundancy[1].replicas == 2

    # Nothing reporting: the KV usage is written as null (the merge patch clears the previous one),
    # no decidedBy or heldKind without an identity or a noteworthy hold, and no lastScaleTime yet.
    idle = decide(1, MetricsSnapshot(1, ()), ScalingTargets(max_replicas=10), History(), T0)
    empty = decision_to_status(idle, T0, None)
    assert empty["lastDecision"]["metrics"] == {
        "kvCacheUsage": None,
        "queueDepth": 0,
        "readyReplicas": 1,
        "reporting": 0,
    }
    assert "decidedBy" not in empty and "heldKind" not in empty and "lastScaleTime" not in empty
    # a null in a merge patch deletes the key: the API server stores (and validates) the block without it
    stored = {
        **empty,
        "lastDecision": {
            **empty["lastDecision"],
            "metrics": {"queueDepth": 0, "readyReplicas": 1, "reporting": 0},
        },
    }
    assert _undeclared(stored, schema) == []
    jsonschema.Draft4Validator(schema).validate(stored)


# -- the real kubernetes client against a fake API server -------------------------------------------------


async def test_kubernetes_api_sends_merge_patches_under_our_field_manager():
    seen: list[tuple[str, str, str, dict[str, str], Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.text()
        seen.append(
            (
                request.method,
                request.path,
                request.headers.get("Content-Type", ""),
                dict(request.query),
                json.loads(body) if body else None,
            )
        )
        if request.method == "GET" and request.path.endswith("/pods"):
            return web.json_response({"kind": "PodList", "items": [pod("a")]})
        if request.method == "GET":
            return web.json_response({"items": [model(2)]})
        return web.json_response({"kind": "Status", "metadata": {}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        from kubernetes import client

        cfg = client.Configuration(host=f"http://127.0.0.1:{port}")
        api = KubernetesApi(client.ApiClient(cfg))
        assert (await api.list_models("ml"))[0]["metadata"]["name"] == "chat"
        assert (await api.list_models(None))[0]["metadata"]["name"] == "chat"
        assert (await api.list_pods("ml", "kvpilot.dev/model=chat"))[0]["metadata"]["name"] == "a"
        await api.patch_scale("ml", "chat", 5)
        await api.patch_status("ml", "chat", {"kvCacheUsage": "42%"})
        await api.annotate_pod("ml", "a", {DELETION_COST: "7"})
        await api.create_event("ml", model(2), "ScaledUp", "kv 0.91 > target 0.70 -> 4")
    finally:
        await runner.cleanup()
    by_path = {(m, p): (ct, q, b) for m, p, ct, q, b in seen}
    assert ("GET", "/apis/kvpilot.dev/v1alpha1/namespaces/ml/inferencemodels") in by_path
    assert ("GET", "/apis/kvpilot.dev/v1alpha1/inferencemodels") in by_path
    assert by_path[("GET", "/api/v1/namespaces/ml/pods")][1]["labelSelector"] == "kvpilot.dev/model=chat"
    scale = by_path[("PATCH", "/apis/kvpilot.dev/v1alpha1/namespaces/ml/inferencemodels/chat/scale")]
    assert scale == (
        "application/merge-patch+json",
        {"fieldManager": FIELD_MANAGER},
        {"spec": {"replicas": 5}},
    )
    status = by_path[("PATCH", "/apis/kvpilot.dev/v1alpha1/namespaces/ml/inferencemodels/chat/status")]
    assert status[0] == "application/merge-patch+json" and status[2] == {"status": {"kvCacheUsage": "42%"}}
    annotate = by_path[("PATCH", "/api/v1/namespaces/ml/pods/a")]
    assert annotate[0] == "application/merge-patch+json"
    assert annotate[2] == {"metadata": {"annotations": {DELETION_COST: "7"}}}
    event = by_path[("POST", "/api/v1/namespaces/ml/events")][2]
    assert event["reason"] == "ScaledUp" and event["involvedObject"]["kind"] == "InferenceModel"
    assert event["source"]["component"] == FIELD_MANAGER


@pytest.mark.parametrize("value", [None, {}, {"history": None}])
def test_empty_status_is_empty_history(value: Any):
    assert history_from_status(value) == History()


def test_batch_slots_come_from_the_spec_and_oom_overrides():
    from kvpilot.autoscaler.controller import runtime_max_num_seqs

    assert runtime_max_num_seqs({}, {}) == 64
    assert runtime_max_num_seqs({"runtime": {"maxNumSeqs": 8}}, {}) == 8
    lowered = {"oomAdaptation": {"overrides": {"maxNumSeqs": 4}}}
    assert runtime_max_num_seqs({"runtime": {"maxNumSeqs": 8}}, lowered) == 4


async def test_restart_continues_the_arrival_rate_from_status():
    """The per-pod counters are in status.autoscaler.arrivals: a new controller differences against them."""
    kube = FakeKube(model(2), [pod("a"), pod("b")])
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.5, 0, 10, completed_total=100.0) for n in "ab"}
    r = (await make(kube, src, [T0]).sync_all())[0]
    assert r.decision.arrival_rate is None  # nothing to difference yet
    block = calls(kube, "status")[-1]["autoscaler"]
    assert block["arrivals"]["pods"] == [
        {"pod": "a", "completed": 100.0, "inFlight": 10},
        {"pod": "b", "completed": 100.0, "inFlight": 10},
    ]
    src.samples = {n: ReplicaSample(n, 0.5, 1, 10, completed_total=130.0) for n in "ab"}
    r = (await make(kube, src, [T0 + 15.5]).sync_all())[0]
    assert r.decision.arrival_rate == pytest.approx(2 * 31 / 15.5)  # millisecond times in status


def test_arrival_state_round_trips_and_skips_garbage():
    from kvpilot.autoscaler.policy import ArrivalState, PodCounter, RateSample
    from kvpilot.autoscaler.state import arrivals_from_status, arrivals_to_status

    state = ArrivalState(
        T0 + 0.25,
        (PodCounter("a", 12.0, 3), PodCounter("b", None, 0)),
        (RateSample(T0 - 15.5, 2.5), RateSample(T0 + 0.25, 3.0)),
        4.5,
        router_queue=17,
    )
    assert arrivals_from_status(json.loads(json.dumps(arrivals_to_status(state)))) == state
    assert arrivals_to_status(state)["routerQueue"] == 17
    garbage = {
        "time": "soon",
        "pods": [
            {"pod": "a", "completed": "x", "inFlight": 1},
            {"pod": 3},
            {"pod": "b", "inFlight": -1},
            "z",
        ],
        "rates": [{"time": "never", "rate": 1}, {"time": format_time(T0), "rate": float("nan")}],
        "serviceRate": -1,
    }
    assert arrivals_from_status(garbage) == ArrivalState()
    assert arrivals_from_status("nope") == ArrivalState()


def test_status_numbers_read_back_as_json_carries_them():
    """A whole float is the integer it spells (JSON does not tell 3 from 3.0); a bool or a string is
    not a number; each entry stands or falls alone."""
    from kvpilot.autoscaler.policy import PodCounter, ScaleEvent
    from kvpilot.autoscaler.state import arrivals_from_status

    pods = [
        {"pod": "a", "inFlight": 2.0, "completed": 7},
        {"pod": "b", "inFlight": True},
        {"pod": "c", "inFlight": "3"},
        {"pod": "d", "inFlight": 2.5},
    ]
    assert arrivals_from_status({"pods": pods}).counters == (PodCounter("a", 7.0, 2),)
    when = format_time(T0)
    back = history_from_status(
        {
            "history": [{"time": when, "replicas": 3.0}, {"time": when, "replicas": False}],
            "scaleEvents": [{"time": when, "fromReplicas": 2, "toReplicas": 4.0}, {"time": when}],
        }
    )
    assert back.recommendations == (Recommendation(T0, 3),)
    assert back.events == (ScaleEvent(T0, 2, 4),)


async def test_a_request_held_by_a_real_router_scales_a_model_from_zero():
    import aiohttp

    from kvpilot.autoscaler.router_source import parse_router_queue
    from kvpilot.router.pool import QueueSettings
    from kvpilot.router.server import Router, RouterSettings

    router = Router(RouterSettings(queue=QueueSettings(cold_start_timeout_s=30), scrape_interval_s=0))
    router.update("chat", [])  # the model is served by the router but has no Ready pod
    runner = web.AppRunner(router.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    kube = FakeKube(model(0, minReplicas=0), [])
    now = [T0]
    controller = ScalingController(
        kube,
        ControllerConfig(namespace="ml", router_urls=(url,)),
        clock=lambda: now[0],
        pod_source=FakeSource(),
    )
    try:
        results = await controller.sync_all()
        assert results[0].decision.desired == 0 and calls(kube, "scale") == []  # nothing held: stays at zero
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(
                session.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi"})
            )
            for _ in range(200):
                if router.pools["chat"].queue_depth == 1:
                    break
                await asyncio.sleep(0.01)
            now[0] += 15
            results = await controller.sync_all()
            assert results[0].decision.desired == 1, (
                router.pools["chat"].queue_depth,
                results[0].decision.reason,
            )
            assert calls(kube, "scale") == [1]
            assert "scale from zero: 1 requests held by the router" in results[0].decision.reason
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held
    finally:
        await controller.close()
        await runner.cleanup()
    assert parse_router_queue('kvpilot_router_queue_depth{model_name="chat"} 2.0\n', "chat") == 2
    assert parse_router_queue('kvpilot_router_queue_depth{model_name="other"} 2.0\n', "chat") is None


async def test_a_growing_router_queue_syncs_before_the_interval():
    import aiohttp

    from kvpilot.router.pool import QueueSettings
    from kvpilot.router.server import Router, RouterSettings

    router = Router(RouterSettings(queue=QueueSettings(cold_start_timeout_s=60), scrape_interval_s=0))
    router.update("chat", [])
    runner = web.AppRunner(router.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    kube = FakeKube(model(0, minReplicas=0), [])
    # a 10-minute interval: only the router poll (every 0.05 s here) can explain a prompt scale-up
    config = ControllerConfig(namespace="ml", interval_s=600, router_urls=(url,), router_poll_s=0.05)
    controller = ScalingController(kube, config, pod_source=FakeSource())
    stop = asyncio.Event()
    loop_task = asyncio.create_task(controller.run(stop))
    try:
        for _ in range(500):
            if calls(kube, "status"):
                break
            await asyncio.sleep(0.01)
        assert calls(kube, "status") and calls(kube, "scale") == []  # first sync: nothing held, stays at 0
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(
                session.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi"})
            )
            for _ in range(1000):
                if calls(kube, "scale"):
                    break
                await asyncio.sleep(0.01)
            assert calls(kube, "scale") == [1]
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held
    finally:
        stop.set()
        await loop_task
        await controller.close()
        await runner.cleanup()


async def test_startup_is_measured_from_the_pods():
    """Creation -> Ready of the model's Ready pods is the startup the policy plans with (a 120 s startup
    holds a scale-down for 4 x 120 s instead of the 300 s window)."""
    pods = [pod(n) for n in "abc"]
    for i, p in enumerate(pods):
        p["metadata"]["creationTimestamp"] = f"2026-01-01T00:0{i}:00Z"
        p["status"]["conditions"][0]["lastTransitionTime"] = f"2026-01-01T00:0{i + 2}:00Z"
    kube = FakeKube(model(3), pods)
    src = FakeSource()
    src.samples = {n: ReplicaSample(n, 0.91, 0, 10) for n in "abc"}
    r = (await make(kube, src, [T0]).sync_all())[0]
    assert r.decision.startup_s == 120.0
    kube.pods.append(pod("d"))  # no timestamps: not measured, the others still are
    src.samples = {n: ReplicaSample(n, 0.05, 0, 1) for n in "abcd"}
    r = (await make(kube, src, [T0 + 400]).sync_all())[0]
    assert r.decision.desired == 4
    assert "scale-down stabilization (480s)" in r.decision.reason
