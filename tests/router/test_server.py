"""The router over real HTTP: fake pods are real aiohttp servers with canned answers and SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest

from kvpilot.router.discovery import StaticSource, parse_adapters, parse_endpoints
from kvpilot.router.outlier import OutlierSettings
from kvpilot.router.policy import AdapterAffinity, RouteKey
from kvpilot.router.pool import Endpoint, QueueSettings
from kvpilot.router.server import (
    FALLBACK_HEADER,
    POD_HEADER,
    PRIORITY_HEADER,
    QUEUE_TIMEOUT_HEADER,
    REJECT_HEADER,
    Router,
    RouterSettings,
    parse_load,
)
from tests.router.upstreams import FakePod, LiveRouter, closed_port_url, start_router

MODEL = "m"


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def pods() -> AsyncIterator[list[FakePod]]:
    started = [await FakePod(f"p{i}").start() for i in range(3)]
    yield started
    for p in started:
        await p.stop()


def eps(pods: list[FakePod], capacity: int = 64) -> list[Endpoint]:
    return [Endpoint(p.name, p.url, capacity) for p in pods]


@contextlib.asynccontextmanager
async def live(
    endpoints: dict[str, list[Endpoint]],
    policy: str = "round-robin",
    fallbacks: dict[str, str] | None = None,
    adapters: dict[str, tuple[str, ...]] | None = None,
    router_settings: dict[str, Any] | None = None,
    **queue: Any,
) -> AsyncIterator[LiveRouter]:
    settings = RouterSettings(
        policy=policy,
        queue=QueueSettings(**queue),
        scrape_interval_s=0,
        fallbacks=fallbacks or {},
        adapters=adapters or {},
        **(router_settings or {}),
    )
    router = Router(settings)
    router.add_source(StaticSource(endpoints))
    lr = await start_router(router)
    await until(lambda: router.synced)
    try:
        yield lr
    finally:
        await lr.runner.cleanup()


@pytest.fixture
async def rt(pods: list[FakePod]) -> AsyncIterator[LiveRouter]:
    async with live({MODEL: eps(pods), "other": []}) as lr:
        yield lr


async def post(
    lr: LiveRouter, body: Any, path: str = "/v1/completions", headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with s.post(lr.url + path, data=data, headers=headers) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return r.status, parsed, r.headers


def metric(lr: LiveRouter, name: str, **labels: str) -> float:
    value = lr.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_models_health_ready_metrics(rt: LiveRouter) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(rt.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["m", "other"]
        async with s.get(rt.url + "/health") as r:
            assert r.status == 200
        async with s.get(rt.url + "/ready") as r:
            assert r.status == 200
        async with s.get(rt.url + "/metrics") as r:
            text = await r.text()
    assert 'kvpilot_router_queue_depth{model_name="m"} 0.0' in text
    assert 'kvpilot_router_ready_pods{model_name="m"} 3.0' in text


async def test_bad_requests_never_touch_a_pod(rt: LiveRouter, pods: list[FakePod]) -> None:
    status, body, _ = await post(rt, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    status, body, _ = await post(rt, [1, 2])
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body, _ = await post(rt, {"prompt": "hi"})
    assert status == 400 and body["error"]["param"] == "model"
    status, body, _ = await post(rt, {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "served models: m, other" in body["error"]["message"]
    assert all(not p.bodies for p in pods)
    assert (
        metric(rt, "kvpilot_router_requests_total", model_name="gpt-9", code="404") == 0
    )  # no label per typo


async def test_round_robin_proxies_bodies_unchanged(rt: LiveRouter, pods: list[FakePod]) -> None:
    served = []
    for i in range(6):
        body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 3, "extra": {"nested": [i]}}
        status, answer, headers = await post(rt, body)
        assert status == 200
        served.append(headers[POD_HEADER])
        assert answer["choices"][0]["text"].startswith(headers[POD_HEADER] + "-0 ")  # the pod's own answer
    assert sorted(served) == sorted([p.name for p in pods] * 2)
    assert [b["prompt"] for p in pods for b in p.bodies] == [f"hello {i}" for i in (0, 3, 1, 4, 2, 5)]
    assert pods[0].bodies[0]["extra"] == {"nested": [0]}
    assert metric(rt, "kvpilot_router_requests_total", model_name=MODEL, code="200") == 6


async def test_sse_passes_chunk_by_chunk(pods: list[FakePod]) -> None:
    hold = asyncio.Event()
    pods[0].hold_after_first = hold
    async with live({MODEL: eps(pods[:1])}) as lr:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "x", "stream": True}
            async with s.post(lr.url + "/v1/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
                # the pod is still holding the rest: the first chunk was not buffered behind it
                assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] == "p0-0 "
                assert pods[0].finished == 0
                hold.set()
                rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 4
        assert pods[0].finished == 1


async def test_a_stream_gives_its_pod_back_when_its_done_arrives(pods: list[FakePod]) -> None:
    """An agent sends its next turn the moment it reads [DONE]; the pod that answered must be free
    by then (kv-aware would otherwise count the finished turn's blocks and send the next turn away
    from its cached prefix). Here the pod keeps its stream open after [DONE]: the router has given
    the pod back all the same, once (a later request's hold is not released by the first's end)."""
    done_held, second_held = asyncio.Event(), asyncio.Event()
    pods[0].hold_after_done = done_held
    async with live({MODEL: eps(pods[:1], capacity=1)}) as lr:
        pool = lr.router.pools[MODEL]
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "x", "stream": True}
            async with s.post(lr.url + "/v1/completions", json=body) as first:
                await asyncio.wait_for(first.content.readuntil(b"data: [DONE]\n\n"), 5)
                assert pods[0].finished == 0  # the pod has not ended its stream
                assert pool.in_flight == 0
                pods[0].hold_after_done, pods[0].hold_after_first = None, second_held
                async with s.post(lr.url + "/v1/completions", json=body) as second:
                    # capacity 1: the second request has the pod while the first stream is open
                    await asyncio.wait_for(second.content.readuntil(b"\n\n"), 5)
                    assert pool.in_flight == 1
                    done_held.set()
                    assert await first.read() == b""
                    await until(lambda: pods[0].finished == 1)
                    await asyncio.sleep(0.2)  # the first request's handler has ended
                    assert pool.in_flight == 1  # still the second's
                    second_held.set()
                    assert (await second.read()).endswith(b"data: [DONE]\n\n")
        await until(lambda: pool.in_flight == 0)


async def test_openai_client_streams_through(rt: LiveRouter) -> None:
    client = openai.AsyncOpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "".join(f"p0-{i} " for i in range(4))
    completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert completion.choices[0].text == "".join(f"p1-{i} " for i in range(4))
    with pytest.raises(openai.NotFoundError, match="served models"):
        await client.completions.create(model="nope", prompt="hi")
    await client.close()


async def test_client_disconnect_cancels_the_upstream_request(pods: list[FakePod]) -> None:
    hold = asyncio.Event()
    pods[0].hold_after_first = hold
    async with live({MODEL: eps(pods[:1])}) as lr:
        async with aiohttp.ClientSession() as s:
            r = await s.post(lr.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            await r.content.readuntil(b"\n\n")
            r.close()  # the client goes away mid-stream
        await until(lambda: pods[0].cancelled == 1)
        await until(lambda: lr.router.pools[MODEL].in_flight == 0)
        assert pods[0].finished == 0
        # its 200 status line had gone out: the answer is counted although the handler was cancelled
        await until(lambda: metric(lr, "kvpilot_router_requests_total", model_name=MODEL, code="200") == 1)


async def test_central_queue_holds_fifo_and_hands_over_on_release(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    for p in pods[:2]:
        p.gate = gate
    async with live({MODEL: eps(pods[:2], capacity=1)}) as lr:
        first = [asyncio.create_task(post(lr, {"model": MODEL, "prompt": f"r{i}"})) for i in range(2)]
        await until(lambda: pods[0].active + pods[1].active == 2)
        queued = []
        for i in range(3):  # every pod runs its capacity: these wait in the router, in order
            queued.append(asyncio.create_task(post(lr, {"model": MODEL, "prompt": f"q{i}"})))
            await until(lambda i=i: lr.router.pools[MODEL].queue_depth == i + 1)
        assert metric(lr, "kvpilot_router_queue_depth", model_name=MODEL) == 3
        assert all(len(p.bodies) == 1 for p in pods[:2])  # the pods never saw the queued ones
        gate.set()
        results = await asyncio.gather(*first, *queued)
        assert all(status == 200 for status, _, _ in results)
        order = sorted((b["prompt"] for p in pods[:2] for b in p.bodies[1:]), key=lambda s: s)
        assert order == ["q0", "q1", "q2"]
        assert metric(lr, "kvpilot_router_queue_depth", model_name=MODEL) == 0
        assert metric(lr, "kvpilot_router_queue_time_seconds_count", model_name=MODEL) == 5


async def test_priority_header_orders_the_queue_by_class_then_fifo(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    async with live({MODEL: eps(pods[:1], capacity=1)}) as lr:
        running = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "first"}))
        await until(lambda: pods[0].active == 1)
        queued = []
        for i, prio in enumerate(["low", "normal", "", "HIGH", "high", "low"]):
            headers = {PRIORITY_HEADER: prio} if prio else {}  # no header (or empty): normal
            queued.append(
                asyncio.create_task(
                    post(lr, {"model": MODEL, "prompt": f"{prio or 'none'}-{i}"}, headers=headers)
                )
            )
            await until(lambda i=i: lr.router.pools[MODEL].queue_depth == i + 1)
        status, body, _ = await post(lr, {"model": MODEL, "prompt": "x"}, headers={PRIORITY_HEADER: "urgent"})
        assert (
            status == 400
            and PRIORITY_HEADER in body["error"]["message"]
            and "urgent" in body["error"]["message"]
        )
        gate.set()
        results = await asyncio.gather(running, *queued)
        assert all(status == 200 for status, _, _ in results)
        # high before normal before low; within a class in arrival order
        assert [b["prompt"] for b in pods[0].bodies[1:]] == [
            "HIGH-3",
            "high-4",
            "normal-1",
            "none-2",
            "low-0",
            "low-5",
        ]


async def test_a_higher_class_goes_straight_to_a_free_pod_past_lower_queued_ones(pods: list[FakePod]) -> None:
    async with live({MODEL: eps(pods[:2], capacity=1)}) as lr:
        pool = lr.router.pools[MODEL]
        key = RouteKey()
        busy = pool.try_acquire(key)
        assert busy is not None
        low = asyncio.create_task(pool.acquire(key, priority=2))
        await until(lambda: pool.queue_depth == 0)  # the second pod had room: low went straight there
        other = await low
        assert {busy.name, other.name} == {"p0", "p1"}
        waiting_low = asyncio.create_task(pool.acquire(key, priority=2))
        await until(lambda: pool.queue_depth == 1)
        waiting_high = asyncio.create_task(pool.acquire(key, priority=0))
        await until(lambda: pool.queue_depth == 2)  # ahead of the low one, not past a full fleet
        pool.release(busy, key)
        assert (await waiting_high).name == busy.name and pool.queue_depth == 1
        pool.release(other, key)
        assert (await waiting_low).name == other.name and pool.queue_depth == 0


async def test_overload_is_429_with_retry_after_never_5xx(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    async with live({MODEL: eps(pods[:1], capacity=1)}, max_queue=1, queue_timeout_s=0.3) as lr:
        running = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "a"}))
        await until(lambda: pods[0].active == 1)
        waiting = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "b"}))
        await until(lambda: lr.router.pools[MODEL].queue_depth == 1)
        status, body, headers = await post(lr, {"model": MODEL, "prompt": "c"})
        assert status == 429 and headers["Retry-After"] == "1" and headers[REJECT_HEADER] == "queue_full"
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
        status, body, headers = await waiting  # its deadline passed while the pod stayed busy
        assert status == 429 and body["error"]["code"] == "queue_timeout" and "Retry-After" in headers
        assert headers[REJECT_HEADER] == "queue_timeout"
        gate.set()
        assert (await running)[0] == 200
        assert metric(lr, "kvpilot_router_requests_total", model_name=MODEL, code="429") == 2
        assert len(pods[0].bodies) == 1


async def test_each_class_has_its_own_bound_and_time_to_live_and_a_client_may_ask_less(
    pods: list[FakePod],
) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    queue = {"class_max_queue": {"low": 1}, "class_timeout_s": {"low": 0.3}, "queue_timeout_s": 30}
    async with live({MODEL: eps(pods[:1], capacity=1)}, **queue) as lr:
        pool = lr.router.pools[MODEL]
        low = {PRIORITY_HEADER: "low"}
        running = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "a"}))
        await until(lambda: pods[0].active == 1)
        waiting_low = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "b"}, headers=low))
        await until(lambda: pool.queue_depth == 1)
        status, body, headers = await post(lr, {"model": MODEL, "prompt": "c"}, headers=low)
        assert (
            status == 429
            and headers[REJECT_HEADER] == "queue_full"
            and "low-priority" in body["error"]["message"]
        )
        # a normal request still has room in the queue; this one's client lets it wait 0.2 s only
        short = {QUEUE_TIMEOUT_HEADER: "0.2"}
        status, _, headers = await post(lr, {"model": MODEL, "prompt": "d"}, headers=short)
        assert status == 429 and headers[REJECT_HEADER] == "queue_timeout"
        status, _, headers = await waiting_low  # low's time to live is 0.3 s, normal's 30 s
        assert status == 429 and headers[REJECT_HEADER] == "queue_timeout"
        status, body, _ = await post(lr, {"model": MODEL, "prompt": "e"}, headers={QUEUE_TIMEOUT_HEADER: "x"})
        assert status == 400 and QUEUE_TIMEOUT_HEADER in body["error"]["message"]
        gate.set()
        assert (await running)[0] == 200


async def test_tenants_take_turns_so_a_burst_does_not_starve_the_others(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    queue = {"max_queue_per_tenant": 4}
    settings = {"tenant_header": "Authorization"}
    async with live({MODEL: eps(pods[:1], capacity=1)}, router_settings=settings, **queue) as lr:
        pool = lr.router.pools[MODEL]
        running = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "first"}))
        await until(lambda: pods[0].active == 1)

        def ask(tenant: str, i: int) -> asyncio.Task[Any]:
            headers = {"Authorization": f"Bearer {tenant}"}
            return asyncio.create_task(post(lr, {"model": MODEL, "prompt": f"{tenant}{i}"}, headers=headers))

        burst = [ask("key-a", i) for i in range(4)]
        await until(lambda: pool.queue_depth == 4)
        status, _, headers = await post(
            lr, {"model": MODEL, "prompt": "a-more"}, headers={"Authorization": "Bearer key-a"}
        )
        assert status == 429 and headers[REJECT_HEADER] == "tenant_queue_full"
        others = [ask("key-b", 0), ask("key-c", 0)]
        await until(lambda: pool.queue_depth == 6)
        gate.set()
        await asyncio.gather(running, *burst, *others)
        order = [b["prompt"] for b in pods[0].bodies[1:]]
        # one of a's, then b and c in turn, then the rest of a's burst
        assert order == ["key-a0", "key-b0", "key-c0", "key-a1", "key-a2", "key-a3"]


async def test_refused_and_503_are_retried_on_another_pod(pods: list[FakePod]) -> None:
    pods[1].mode = "503"
    dead = Endpoint("dead", closed_port_url(), 64)
    async with live({MODEL: [dead, *eps(pods[:2])]}) as lr:
        for i in range(4):
            status, _, headers = await post(lr, {"model": MODEL, "prompt": f"r{i}"})
            assert status == 200 and headers[POD_HEADER] == "p0"
        assert metric(lr, "kvpilot_router_upstream_retries_total", model_name=MODEL) >= 2
        pool = lr.router.pools[MODEL]
        assert pool.routable() == [pool.pods["p0"]]  # both faulty pods sit out their unhealthy spell
        assert len(pods[1].bodies) == 1  # the draining pod got one try, not more


async def test_all_pods_failing_is_502_not_a_hang() -> None:
    async with live({MODEL: [Endpoint("dead", closed_port_url(), 4)]}) as lr:
        status, body, _ = await post(lr, {"model": MODEL, "prompt": "x"})
        assert status == 502 and body["error"]["type"] == "upstream_error"


async def test_a_guided_stream_whose_pod_dies_ends_with_an_error_event_and_no_retry(
    pods: list[FakePod],
) -> None:
    pods[0].mode = "die_mid_stream"
    async with live({MODEL: eps(pods[:2])}) as lr:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "x", "stream": True, "guided_regex": "p[0-9]"}
            async with s.post(lr.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers[POD_HEADER] == "p0"
                raw = await r.read()
        events = [json.loads(e[len("data: ") :]) for e in raw.decode().strip().split("\n\n")]
        assert [e["choices"][0]["text"] for e in events[:2]] == ["p0-0 ", "p0-1 "]
        assert events[-1]["error"]["code"] == "upstream_disconnected"
        assert pods[1].bodies == []  # nothing was retried after bytes reached the client
        pool = lr.router.pools[MODEL]
        assert pool.pods["p0"] not in pool.routable()
        assert metric(lr, "kvpilot_router_upstream_failures_total", model_name=MODEL) == 1
        assert metric(lr, "kvpilot_router_stream_migrations_total", model_name=MODEL) == 0
        await until(
            lambda: metric(lr, "kvpilot_router_slo_requests_total", model_name=MODEL, outcome="failed") == 1
        )
        # the next request goes to the healthy pod
        status, _, headers = await post(lr, {"model": MODEL, "prompt": "y"})
        assert status == 200 and headers[POD_HEADER] == "p1"


async def test_scale_from_zero_holds_until_a_pod_is_ready(pods: list[FakePod]) -> None:
    async with live({MODEL: []}, cold_start_timeout_s=10) as lr:
        held = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "wake up"}))
        await until(lambda: metric(lr, "kvpilot_router_queue_depth", model_name=MODEL) == 1)
        await asyncio.sleep(0.2)
        assert not held.done()
        lr.router.update(MODEL, eps(pods[:1]))  # the first replica became Ready
        status, body, headers = await held
        assert status == 200 and headers[POD_HEADER] == "p0" and body["choices"][0]["text"]
        assert metric(lr, "kvpilot_router_queue_depth", model_name=MODEL) == 0


async def test_scale_from_zero_deadline_is_503_naming_no_endpoints(pods: list[FakePod]) -> None:
    async with live({MODEL: []}, cold_start_timeout_s=0.2) as lr:
        status, body, headers = await post(lr, {"model": MODEL, "prompt": "x"})
        assert status == 503 and "no Ready pod" in body["error"]["message"]
        assert headers[REJECT_HEADER] == body["error"]["code"] == "no_endpoints"
        assert body["error"]["type"] == "service_unavailable" and "Retry-After" in headers
        assert metric(lr, "kvpilot_router_rejections_total", model_name=MODEL, reason="no_endpoints") == 1
        assert metric(lr, "kvpilot_router_slo_requests_total", model_name=MODEL, outcome="failed") == 1


async def test_session_header_sticks_to_one_pod(pods: list[FakePod]) -> None:
    async with live({MODEL: eps(pods)}, policy="prefix-affinity") as lr:
        seen = set()
        for turn in range(6):
            body = {"model": MODEL, "prompt": f"turn {turn} " * 30}
            _, _, headers = await post(lr, body, headers={"X-Session-ID": "conversation-1"})
            seen.add(headers[POD_HEADER])
        assert len(seen) == 1


async def test_scrape_reads_pod_load(pods: list[FakePod]) -> None:
    assert parse_load("kvpilot_kv_cache_usage_ratio 0.25\nkvpilot_num_requests_waiting 3\n", MODEL) == (
        0.25,
        3,
    )
    assert parse_load("vllm:kv_cache_usage_perc 0.5\n", MODEL) == (0.5, None)
    assert parse_load("garbage {{{", MODEL) == (None, None)
    router = Router(RouterSettings(scrape_interval_s=0.05))
    router.add_source(StaticSource({MODEL: [*eps(pods[:1]), Endpoint("dead", closed_port_url())]}))
    lr = await start_router(router)
    try:
        pool = router.pools[MODEL]
        await until(lambda: pool.pods["p0"].kv_usage == 0.5 and pool.pods["p0"].waiting == 0)
        assert pool.pods["dead"].kv_usage is None  # unknown, never read as zero
    finally:
        await lr.runner.cleanup()


def test_parse_endpoints_and_flag_errors() -> None:
    got = parse_endpoints(["a=http://h1:8000,http://h2:8000/v1", "b=https://x"], capacity=8)
    assert [e.url for e in got["a"]] == ["http://h1:8000", "http://h2:8000"] and got["a"][0].capacity == 8
    for bad, msg in [
        ("a", "MODEL=URL"),
        ("a=", "MODEL=URL"),
        ("a=ftp://x", "not an http"),
        ("a=http://h,http://h", "twice"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_endpoints([bad])


async def test_overload_spills_to_the_fallback_model_instead_of_429(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    endpoints = {MODEL: eps(pods[:1], capacity=1), "small": eps(pods[1:2], capacity=1)}
    async with live(endpoints, fallbacks={MODEL: "small"}, max_queue=1, queue_timeout_s=5) as lr:
        running = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "a"}))
        await until(lambda: pods[0].active == 1)
        queued = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "b"}))
        await until(lambda: lr.router.pools[MODEL].queue_depth == 1)
        # the queue is full: instead of a 429 the fallback model's idle pod serves it, under its own name
        status, body, headers = await post(lr, {"model": MODEL, "prompt": "c"})
        assert status == 200 and headers[FALLBACK_HEADER] == "small" and headers[POD_HEADER] == "p1"
        assert pods[1].bodies == [{"model": "small", "prompt": "c"}]
        assert metric(lr, "kvpilot_router_fallbacks_total", model_name=MODEL, fallback="small") == 1
        # the fallback busy too (its gate closed): then it is a 429 after all
        pods[1].gate = asyncio.Event()
        spill = asyncio.create_task(post(lr, {"model": MODEL, "prompt": "d"}))
        await until(lambda: pods[1].active == 1)
        status, body, _ = await post(lr, {"model": MODEL, "prompt": "e"})
        assert status == 429 and body["error"]["code"] == "queue_full"
        gate.set()
        pods[1].gate.set()
        assert [r[0] for r in await asyncio.gather(running, queued, spill)] == [200, 200, 200]


async def test_adapter_requests_stick_to_the_pod_holding_the_adapter_until_beyond_the_bound(
    pods: list[FakePod],
) -> None:
    async with live({MODEL: eps(pods), "other": []}, adapters={MODEL: ("sql", "chat")}) as lr:
        async with aiohttp.ClientSession() as s, s.get(lr.url + "/v1/models") as r:
            cards = (await r.json())["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [
            (MODEL, None),
            ("sql", MODEL),
            ("chat", MODEL),
            ("other", None),
        ]
        served: dict[str, list[str]] = {"sql": [], "chat": []}
        for i in range(6):  # one at a time: every pod idle, so round-robin alone would rotate p0 p1 p2
            for adapter in ("sql", "chat"):
                status, answer, headers = await post(lr, {"model": adapter, "prompt": f"q{i}"})
                assert status == 200 and answer["model"] == adapter
                served[adapter].append(headers[POD_HEADER])
        assert served == {"sql": ["p0"] * 6, "chat": ["p1"] * 6}  # each adapter stays where it went first
        assert [b["model"] for b in pods[0].bodies] == ["sql"] * 6  # forwarded as the client sent it
        assert metric(lr, "kvpilot_router_requests_total", model_name=MODEL, code="200") == 12
        # p0 busy with sql requests: the holder keeps them while its load is within
        # ceil(1.25 x average); the next one goes elsewhere, and that pod holds sql from then on
        gate = asyncio.Event()
        pods[0].gate = gate
        held = [asyncio.create_task(post(lr, {"model": "sql", "prompt": "slow"}))]
        await until(lambda: pods[0].active == 1)
        spill = await post(lr, {"model": "sql", "prompt": "spill"})  # 1 + 1 > ceil(1.25 x 2 / 3) = 1
        assert spill[0] == 200 and spill[2][POD_HEADER] != "p0"
        policy = lr.router.pools[MODEL].policy
        assert isinstance(policy, AdapterAffinity) and policy.holds(spill[2][POD_HEADER], "sql")
        gate.set()
        assert (await held[0])[0] == 200 and pods[0].bodies[-1]["prompt"] == "slow"


async def test_unknown_adapter_is_404_listing_models_and_adapters(pods: list[FakePod]) -> None:
    async with live({MODEL: eps(pods)}, adapters={MODEL: ("sql",)}) as lr:
        status, body, _ = await post(lr, {"model": "sqll", "prompt": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "served models: m; LoRA adapters: sql (m)" in body["error"]["message"]
        assert all(not p.bodies for p in pods)


async def test_an_adapter_request_never_spills_to_the_fallback_model(pods: list[FakePod]) -> None:
    gate = asyncio.Event()
    pods[0].gate = gate
    endpoints = {MODEL: eps(pods[:1], capacity=1), "small": eps(pods[1:2], capacity=1)}
    async with live(
        endpoints, fallbacks={MODEL: "small"}, adapters={MODEL: ("sql",)}, max_queue=1, queue_timeout_s=5
    ) as lr:
        running = asyncio.create_task(post(lr, {"model": "sql", "prompt": "a"}))
        await until(lambda: pods[0].active == 1)
        queued = asyncio.create_task(post(lr, {"model": "sql", "prompt": "b"}))
        await until(lambda: lr.router.pools[MODEL].queue_depth == 1)
        status, body, _ = await post(lr, {"model": "sql", "prompt": "c"})  # small has no adapter sql
        assert status == 429 and body["error"]["code"] == "queue_full" and not pods[1].bodies
        gate.set()
        assert [r[0] for r in await asyncio.gather(running, queued)] == [200, 200]


def test_parse_adapters_refuses_unknown_models_and_clashes() -> None:
    assert parse_adapters(["m=a,b", "m=c", "n=d"], ["m", "n"]) == {"m": ("a", "b", "c"), "n": ("d",)}
    for bad, msg in [
        ("m", "MODEL=ADAPTER"),
        ("m=a,,b", "MODEL=ADAPTER"),
        ("x=a", "'x' is not a model of --endpoints"),
        ("m=n", "'n' is a model's name"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_adapters([bad], ["m", "n"])
    with pytest.raises(ValueError, match="'a' is already declared for m"):
        parse_adapters(["m=a", "n=a"], ["m", "n"])


async def test_an_adapter_named_like_a_model_stays_the_model() -> None:
    router = Router(RouterSettings(scrape_interval_s=0))
    router.update("a", [], adapters=("sql", "b"))
    assert router.adapter_parent == {"sql": "a", "b": "a"}
    router.update("b", [])  # model b arrives: the name is b's from now on
    assert router.adapter_parent == {"sql": "a"}
    router.remove_model("b")
    assert router.adapter_parent == {"sql": "a", "b": "a"}


async def test_a_pod_without_the_adapter_yet_is_passed_over_for_that_request(pods: list[FakePod]) -> None:
    pods[0].serves = {MODEL}  # an old pod of a roll: the base model only
    async with live({MODEL: eps(pods)}, adapters={MODEL: ("sql",)}) as lr:
        status, answer, headers = await post(lr, {"model": "sql", "prompt": "q"})
        holder = headers[POD_HEADER]
        assert status == 200 and holder != "p0" and answer["model"] == "sql"
        assert [b["model"] for b in pods[0].bodies] == ["sql"]  # asked first (round-robin), answered 404
        assert metric(lr, "kvpilot_router_upstream_retries_total", model_name=MODEL) == 1
        policy = lr.router.pools[MODEL].policy
        assert isinstance(policy, AdapterAffinity)
        assert not policy.holds("p0", "sql") and policy.holds(holder, "sql")
        for _ in range(3):  # from then on straight to the pod that served it, no more 404 round trips
            assert (await post(lr, {"model": "sql", "prompt": "again"}))[2][POD_HEADER] == holder
        assert len(pods[0].bodies) == 1
        status, _, headers = await post(lr, {"model": MODEL, "prompt": "base"})  # p0 stays healthy
        assert status == 200
        for p in pods:
            p.serves = {MODEL}
        status, body, _ = await post(lr, {"model": "sql", "prompt": "q2"})  # no pod has it: the pod's 404
        assert status == 404 and body["error"]["code"] == "model_not_found"
        # the base model's 404 is the pod's answer as before, never retried
        pods[0].serves = set()
        before = sum(len(p.bodies) for p in pods)
        for _ in range(3):
            await post(lr, {"model": MODEL, "prompt": "x"})
        assert sum(len(p.bodies) for p in pods) == before + 3


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (b"[" * 1000 + b"]" * 1000, None, "nests deeper than 64 levels"),  # RecursionError in json
        (b'{"model": "m", "prompt": ' + b"[" * 80 + b"]" * 80 + b"}", "prompt", "nests deeper than 64"),
        (b"", None, "request body is empty"),
        (b"\xff\xfe{}", None, "not valid UTF-8"),
        (b'{"model": "m", "max_tokens": 1' + b"0" * 5000 + b"}", None, "not acceptable JSON"),
        (b'{"model": "m", "prompt": "\\ud800"}', "prompt", "lone surrogate"),
        (b'"just a string"', None, "must be a JSON object"),
        (b'{"model": ["m"], "prompt": "x"}', "model", "'model' is required and must be a string"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream", "'stream' must be a boolean"),
        (b'{"model": "m", "prompt": "x", "stream": 1}', "stream", "'stream' must be a boolean"),
    ],
)
async def test_malformed_bodies_are_400_in_the_openai_shape_never_500(
    rt: LiveRouter, pods: list[FakePod], raw: bytes, param: str | None, message: str
) -> None:
    status, body, headers = await post(rt, raw)
    assert status == 400, (status, body)
    assert headers["Content-Type"].startswith("application/json")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert message in body["error"]["message"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert all(not p.bodies for p in pods)  # refused at the router: no pod saw it


async def test_an_absurd_max_tokens_is_the_pods_to_refuse_not_a_router_crash(pods: list[FakePod]) -> None:
    """The router reads max_tokens for its KV estimate (kv-aware adds the in-flight estimates up as
    floats): huge ones held on the pods must not break the routing of the next request."""
    gate = asyncio.Event()
    for p in pods[:2]:
        p.gate = gate
    async with live({MODEL: eps(pods[:2])}, policy="kv-aware") as lr:
        held = []
        try:
            for i, value in enumerate((10**4000, 1e308, -(10**30), True)):
                body = {"model": MODEL, "prompt": "x" * 200, "max_tokens": value}
                held.append(asyncio.create_task(post(lr, body)))
                await until(lambda i=i: pods[0].active + pods[1].active == i + 1)
        finally:
            gate.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200] * 4


async def test_aiohttp_errors_are_openai_error_bodies(rt: LiveRouter) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(rt.url + "/v1/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(rt.url + "/v2/completions", json={"model": MODEL}) as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"


# -- deadlines and outlier ejection (the frozen pod itself: tests/router/test_router_process.py) ------

QUICK = {"first_byte_timeout_s": 0.3, "idle_timeout_s": 0.3, "probe_timeout_s": 2.0}  # a generous probe


async def test_a_slow_pod_that_answers_its_probe_is_waited_for_not_retried(pods: list[FakePod]) -> None:
    pods[0].headers_delay_s = 1.2  # four first-byte periods before it answers (a long prefill, say)
    pods[1].chunk_delay_s = 0.5  # and between chunks, past the idle deadline
    async with live({MODEL: eps(pods[:2])}, router_settings=QUICK) as lr:
        status, body, headers = await post(lr, {"model": MODEL, "prompt": "x"})
        assert status == 200 and headers[POD_HEADER] == "p0" and body["choices"][0]["text"].startswith("p0-0")
        status, text, headers = await post(lr, {"model": MODEL, "prompt": "x", "stream": True})
        assert status == 200 and headers[POD_HEADER] == "p1" and text.endswith("data: [DONE]\n\n")
        assert text.count("data: ") == 5 and "error" not in text
        for name in ("kvpilot_router_upstream_retries_total", "kvpilot_router_upstream_failures_total"):
            assert metric(lr, name, model_name=MODEL) == 0
        for phase in ("first_byte", "idle"):
            assert metric(lr, "kvpilot_router_upstream_timeouts_total", model_name=MODEL, phase=phase) == 0
        assert len(pods[0].bodies) == 1 and len(pods[1].bodies) == 1


async def test_the_silence_limit_bounds_the_wait_on_a_live_pod(pods: list[FakePod]) -> None:
    pods[0].gate = asyncio.Event()  # it answers its probes but never the request
    settings = {**QUICK, "silence_limit_s": 0.8}
    try:
        async with live({MODEL: eps(pods[:1])}, router_settings=settings) as lr:
            status, body, _ = await asyncio.wait_for(post(lr, {"model": MODEL, "prompt": "x"}), 20)
            assert status == 504 and body["error"]["code"] == "upstream_timeout"
            assert "silence limit" in body["error"]["message"]
            labels = {"model_name": MODEL, "phase": "first_byte"}
            assert metric(lr, "kvpilot_router_upstream_timeouts_total", **labels) == 1
    finally:
        pods[0].gate.set()


async def test_consecutive_5xx_eject_a_pod_but_never_the_last(pods: list[FakePod]) -> None:
    pods[0].mode = "500"
    outliers = OutlierSettings(consecutive_failures=2, base_ejection_s=60, max_ejection_percent=100)
    async with live({MODEL: eps(pods[:2])}, router_settings={"outliers": outliers}) as lr:
        answers = [await post(lr, {"model": MODEL, "prompt": f"r{i}"}) for i in range(8)]
        # round-robin: p0, p1, p0 (its 2nd 500 in a row: ejected), then p1 only
        assert [a[0] for a in answers] == [500, 200, 500, 200, 200, 200, 200, 200]
        assert len(pods[0].bodies) == 2
        assert metric(lr, "kvpilot_router_pod_ejections_total", model_name=MODEL, pod="p0") == 1
        assert metric(lr, "kvpilot_router_ejected_pods", model_name=MODEL) == 1
        pods[1].mode = "500"  # now the last pod fails too: it stays, there is nothing else to try
        answers = [await post(lr, {"model": MODEL, "prompt": f"s{i}"}) for i in range(4)]
        assert [a[0] for a in answers] == [500] * 4 and len(pods[1].bodies) == 10
        assert metric(lr, "kvpilot_router_pod_ejections_total", model_name=MODEL, pod="p1") == 0
        async with aiohttp.ClientSession() as s, s.get(lr.url + "/metrics") as r:
            text = await r.text()
        assert 'kvpilot_router_ejected_pods{model_name="m"} 1.0' in text
        assert 'kvpilot_router_pod_ejections_total{model_name="m",pod="p0"} 1.0' in text


async def test_the_router_measures_its_pods_and_routes_around_the_slow_one(pods: list[FakePod]) -> None:
    pods[1].chunk_delay_s = 0.05  # p1 streams its tokens slowly
    async with live({MODEL: eps(pods[:2])}, policy="least-loaded") as lr:
        body = {"model": MODEL, "prompt": "x", "stream": True}
        first = [(await post(lr, body))[2][POD_HEADER] for _ in range(2)]  # idle pods in turn: one each
        assert sorted(first) == ["p0", "p1"]
        later = [(await post(lr, body))[2][POD_HEADER] for _ in range(6)]
        assert later == ["p0"] * 6  # both idle, p1 measured slow: p0 every time
        pool = lr.router.pools[MODEL]
        assert pool.pods["p1"].tpot_s is not None and pool.pods["p0"].tpot_s is not None
        assert pool.pods["p1"].tpot_s > pool.pods["p0"].tpot_s
        await until(
            lambda: metric(lr, "kvpilot_router_time_per_output_token_seconds_count", model_name=MODEL) == 8
        )
        async with aiohttp.ClientSession() as s, s.get(lr.url + "/metrics") as r:
            text = await r.text()
        assert 'kvpilot_router_pod_tpot_ewma_seconds{model_name="m",pod="p1"}' in text
        assert 'kvpilot_router_slo_attainment_ratio{model_name="m"}' in text
        assert metric(lr, "kvpilot_router_slo_window_requests", model_name=MODEL) == 8
