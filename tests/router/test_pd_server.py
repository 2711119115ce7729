"""P/D orchestration over real HTTP (router/prefill.py, server.py): a disaggregated model's prefill and
decode pods are real aiohttp servers that answer as a `--kv-role prefill` / `decode` runtime does
(tests/router/upstreams.FakePod); tests/router/test_pd_real.py runs real `kvpilot serve` pods."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler.pd_signals import parse_router_pd
from kvpilot.autoscaler.router_source import parse_router_queues
from kvpilot.router.cli import build_router
from kvpilot.router.discovery import StaticSource
from kvpilot.router.pd import PREFILL_SLACK, PdSettings, prefill_body, prompt_tokens
from kvpilot.router.pool import Endpoint
from kvpilot.router.server import POD_HEADER, PRIORITY_HEADER, Router, RouterSettings
from tests.router.test_pd import args
from tests.router.test_server import metric, post, until
from tests.router.upstreams import FakePod, LiveRouter, closed_port_url, start_router

MODEL = "m"
LONG = "Summarise the following report. " + "The quarterly figures rose again. " * 40  # ~350 tokens
SHORT = "Hi"
PD = PdSettings(min_prompt_tokens=100, transfer_timeout_s=5.0)


def roles(prefill: list[FakePod], decode: list[FakePod], capacity: int = 64) -> list[Endpoint]:
    return [Endpoint(p.name, p.url, capacity, "prefill") for p in prefill] + [
        Endpoint(p.name, p.url, capacity, "decode") for p in decode
    ]


@contextlib.asynccontextmanager
async def live(endpoints: list[Endpoint], pd: PdSettings = PD, **settings: Any) -> AsyncIterator[LiveRouter]:
    router = Router(RouterSettings(policy="round-robin", scrape_interval_s=0, **settings))
    router.add_source(StaticSource({MODEL: endpoints}, disaggregation={MODEL: pd}))
    lr = await start_router(router)
    await until(lambda: router.synced)
    try:
        yield lr
    finally:
        await lr.runner.cleanup()


@contextlib.asynccontextmanager
async def fake_pods(*names: str, **options: Any) -> AsyncIterator[list[FakePod]]:
    pods = [await FakePod(name, **options).start() for name in names]
    try:
        yield pods
    finally:
        for p in pods:
            await p.stop()


def paths(lr: LiveRouter) -> dict[str, float]:
    return {
        p: metric(lr, "kvpilot_router_pd_requests_total", model_name=MODEL, path=p)
        for p in ("disaggregated", "direct", "no_prefill", "prefill_failed")
    }


async def stream_text(
    lr: LiveRouter, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[str, str]:
    """A streamed chat through the router: (its text, the pod that served it)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(lr.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers or {}) as r,
    ):
        assert r.status == 200, await r.text()
        text = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["delta"].get("content") or "" for c in event["choices"]]
        return "".join(text), r.headers[POD_HEADER]


async def test_a_long_prompt_runs_on_a_prefill_pod_then_streams_from_a_decode_pod() -> None:
    async with fake_pods("pf") as (pf,), fake_pods("d0") as (d0,), live(roles([pf], [d0])) as lr:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 4,
            "response_format": {"type": "json_object"},  # the grammar starts on the decode side
        }
        text, pod = await stream_text(lr, body)
        assert text == "d0-0 d0-1 d0-2 d0-3 " and pod == "d0"
        # the prefill leg: the client's body answered with one token, asking for a remote decode
        sent = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert pf.bodies == [prefill_body(sent)]
        assert pf.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
        assert "response_format" not in pf.bodies[0] and pf.bodies[0]["max_tokens"] == 1
        # the decode leg: the client's body with the prefill pod's params, its URL filled in
        (decoded,) = d0.bodies
        params = decoded.pop("kv_transfer_params")
        assert decoded == sent
        assert params["transfer_id"] == "pf-1" and params["remote_url"] == pf.url
        assert paths(lr) == {"disaggregated": 1, "direct": 0, "no_prefill": 0, "prefill_failed": 0}
        assert metric(lr, "kvpilot_router_pd_prefill_seconds_count", model_name=MODEL) == 1
        # the SLO's TTFT runs from the client's arrival (the prefill leg included) to the first token
        assert metric(lr, "kvpilot_router_time_to_first_token_seconds_count", model_name=MODEL) == 1
        assert metric(lr, "kvpilot_router_pd_prefill_pods", model_name=MODEL) == 1
        assert metric(lr, "kvpilot_router_ready_pods", model_name=MODEL) == 1  # the decode pods


async def test_short_prompts_and_unfit_requests_go_straight_to_a_decode_pod() -> None:
    async with fake_pods("pf") as (pf,), fake_pods("d0") as (d0,), live(roles([pf], [d0])) as lr:
        status, _, _ = await post(lr, {"model": MODEL, "prompt": SHORT, "max_tokens": 2})
        assert status == 200
        status, _, _ = await post(lr, {"model": MODEL, "prompt": [LONG, LONG], "max_tokens": 2})
        assert status == 200
        assert pf.bodies == [] and all("kv_transfer_params" not in b for b in d0.bodies)
        assert paths(lr) == {"disaggregated": 0, "direct": 2, "no_prefill": 0, "prefill_failed": 0}


async def test_a_model_without_a_routable_prefill_pod_is_served_by_its_decode_pods() -> None:
    async with fake_pods("d0") as (d0,), live(roles([], [d0])) as lr:
        status, answer, _ = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
        assert status == 200 and answer["choices"][0]["text"]
        status, _, _ = await post(lr, {"model": MODEL, "prompt": SHORT, "max_tokens": 2})
        assert status == 200
        # the long prompt is counted apart (the prefill role's wake-up), the short one as ever
        assert paths(lr) == {"disaggregated": 0, "direct": 1, "no_prefill": 1, "prefill_failed": 0}


async def test_held_requests_are_reported_by_the_pool_they_will_need() -> None:
    """The central queue sits in front of the decode pool: a held long prompt still needs a prefill
    pod, a held short one only a decode pod (kvpilot_router_pd_queued; the autoscaler's split)."""
    gate = asyncio.Event()
    async with (
        fake_pods("pf") as (pf,),
        fake_pods("d0", gate=gate) as (d0,),
        live(roles([pf], [d0], capacity=1)) as lr,
    ):

        async def held() -> tuple[float, float | None, float | None]:
            """(queue depth, held for prefill, held direct) from the router's /metrics page, the
            prefill share as the autoscaler reads it (pd_signals.parse_router_pd)."""
            async with aiohttp.ClientSession() as s, s.get(lr.url + "/metrics") as r:
                text = await r.text()
            direct = [
                x.value
                for f in text_string_to_metric_families(text)
                for x in f.samples
                if x.name == "kvpilot_router_pd_queued" and x.labels["path"] == "direct"
            ]
            return (
                parse_router_queues(text)[MODEL],
                parse_router_pd(text)[MODEL].held_prefill,
                direct[0] if direct else None,
            )

        assert await held() == (0, 0.0, 0.0)  # reported from the start: 0, not "the router does not say"
        first = asyncio.create_task(post(lr, {"model": MODEL, "prompt": SHORT, "max_tokens": 2}))
        await until(lambda: d0.active == 1)
        queued = [
            asyncio.create_task(post(lr, {"model": MODEL, "prompt": p, "max_tokens": 2}))
            for p in (SHORT, SHORT, LONG)
        ]
        await until(lambda: lr.router.pools[MODEL].queue_depth == 3)
        assert await held() == (3, 1.0, 2.0)
        gate.set()
        assert [status for status, _, _ in await asyncio.gather(first, *queued)] == [200] * 4
        assert await held() == (0, 0.0, 0.0)
        assert paths(lr) == {"disaggregated": 1, "direct": 3, "no_prefill": 0, "prefill_failed": 0}
        assert len(pf.bodies) == 1


async def test_a_failed_prefill_falls_back_to_the_whole_request_on_a_decode_pod() -> None:
    """Refused, a 500, an answer without transfer params, no prefill pod with room within the transfer
    timeout: each time the decode pod gets the client's own request (no kv_transfer_params) and the
    client its answer."""
    dead = Endpoint("dead", closed_port_url(), 64, "prefill")
    async with (
        fake_pods("d0") as (d0,),
        fake_pods("broken", mode="500") as (broken,),
        fake_pods("old", kv_params=False) as (old,),
        fake_pods("busy", gate=asyncio.Event()) as (busy,),  # holds its one slot
    ):
        cases = [[dead], roles([broken], []), roles([old], []), roles([busy], [], capacity=1)]
        for prefill in cases:
            pd = PdSettings(min_prompt_tokens=100, transfer_timeout_s=0.5)
            async with live([*prefill, *roles([], [d0])], pd) as lr:
                held = None
                if prefill[0].name == "busy":  # another request's prefill holds busy's one slot
                    held = asyncio.create_task(post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2}))
                    await until(lambda: busy.active == 1)
                status, answer, headers = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
                assert status == 200 and headers[POD_HEADER] == "d0" and answer["choices"][0]["text"]
                assert "kv_transfer_params" not in d0.bodies[-1]
                assert paths(lr) == {"disaggregated": 0, "direct": 0, "no_prefill": 0, "prefill_failed": 1}
                if held is not None:
                    held.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await held
        assert len(d0.bodies) == 4


async def test_a_prefill_leg_runs_as_long_as_its_pools_speed_says_then_is_given_up_and_cancelled() -> None:
    """A prompt's prefill takes what it takes: a leg longer than the transfer timeout still hands its
    KV over. Once the pool's speed is measured, a leg far slower than it (here: a pod that stopped
    answering but not its health probes) is given up, the request runs whole on a decode pod, and the
    prefill pod's connection is closed (a runtime then aborts the prompt)."""
    pd = PdSettings(min_prompt_tokens=100, transfer_timeout_s=0.2)
    async with (
        fake_pods("pf", headers_delay_s=0.5) as (pf,),
        fake_pods("d0") as (d0,),
        live(roles([pf], [d0]), pd, first_byte_timeout_s=0.1) as lr,
    ):
        for _ in range(2):
            status, _, headers = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
            assert status == 200 and headers[POD_HEADER] == "d0"
            assert "kv_transfer_params" in d0.bodies[-1]  # 0.5 s > the 0.2 s transfer timeout
        assert paths(lr) == {"disaggregated": 2, "direct": 0, "no_prefill": 0, "prefill_failed": 0}
        tokens = prompt_tokens({"prompt": LONG}, chat=False)  # as the router estimates it
        speed = metric(lr, "kvpilot_router_pd_prefill_tokens_per_second", model_name=MODEL)
        assert 0 < speed <= tokens / 0.5  # each prompt took >= 0.5 s
        pf.gate = asyncio.Event()  # from now on pf holds every prompt
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _, headers = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
        took = loop.time() - started
        assert status == 200 and headers[POD_HEADER] == "d0"
        assert "kv_transfer_params" not in d0.bodies[-1]
        assert paths(lr)["prefill_failed"] == 1
        # given up after its budget (0.2 s + 4 x the ~0.5 s measured), long before the silence limit
        budget = 0.2 + PREFILL_SLACK * tokens / speed
        assert budget - 0.1 <= took < budget + 10
        await until(lambda: pf.cancelled == 1)  # the abandoned prefill's connection closed


async def test_a_refused_prefill_pod_is_retried_on_another_before_falling_back() -> None:
    dead = Endpoint("a-dead", closed_port_url(), 64, "prefill")  # first in the round-robin order
    async with fake_pods("pf") as (pf,), fake_pods("d0") as (d0,), live([dead, *roles([pf], [d0])]) as lr:
        status, _, _ = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
        assert status == 200 and d0.bodies[-1]["kv_transfer_params"]["remote_url"] == pf.url
        assert paths(lr) == {"disaggregated": 1, "direct": 0, "no_prefill": 0, "prefill_failed": 0}


async def test_a_failing_prefill_pod_is_ejected_and_its_peer_takes_the_prompts() -> None:
    async with (
        fake_pods("a-broken", mode="500") as (broken,),
        fake_pods("b-good") as (good,),
        fake_pods("d0") as (d0,),
        live(roles([broken, good], [d0])) as lr,
    ):
        for _ in range(8):  # round-robin: broken, good, broken, good, broken (ejected), good, good, good
            status, _, _ = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
            assert status == 200
        assert metric(lr, "kvpilot_router_pod_ejections_total", model_name=MODEL, pod="a-broken") == 1
        assert metric(lr, "kvpilot_router_ejected_pods", model_name=MODEL) == 1
        assert paths(lr) == {"disaggregated": 5, "direct": 0, "no_prefill": 0, "prefill_failed": 3}
        assert len(broken.bodies) == 3 and len(good.bodies) == 5


async def test_admission_is_against_the_decode_pods_room_and_keeps_priorities() -> None:
    """One decode slot: a request waits in the central queue before its prefill runs, and the queue
    hands the slot over by priority class."""
    gate = asyncio.Event()
    async with (
        fake_pods("pf") as (pf,),
        fake_pods("d0", gate=gate) as (d0,),
        live(roles([pf], [d0], capacity=1)) as lr,
    ):
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 2}
        first = asyncio.create_task(post(lr, {**body, "user": "first"}))
        await until(lambda: d0.active == 1)
        low = asyncio.create_task(post(lr, {**body, "user": "low"}, headers={PRIORITY_HEADER: "low"}))
        await until(lambda: lr.router.pools[MODEL].queue_depth == 1)
        high = asyncio.create_task(post(lr, {**body, "user": "high"}, headers={PRIORITY_HEADER: "high"}))
        await until(lambda: lr.router.pools[MODEL].queue_depth == 2)
        assert [b["user"] for b in pf.bodies] == ["first"]  # the queued ones have not run their prompts
        gate.set()
        results = await asyncio.gather(first, low, high)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert [b["user"] for b in pf.bodies] == ["first", "high", "low"]
        assert [b["user"] for b in d0.bodies] == ["first", "high", "low"]
        assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in d0.bodies)


async def test_a_decode_pod_that_dies_mid_stream_continues_on_another_as_a_plain_request() -> None:
    async with (
        fake_pods("pf") as (pf,),
        fake_pods("d0", mode="die_mid_stream") as (d0,),
        fake_pods("d1") as (d1,),
        live(roles([pf], [d0, d1])) as lr,
    ):
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(lr.url + "/v1/completions", json=body) as r:
            raw = await r.text()
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in raw.splitlines()
            if line.startswith("data: {") and json.loads(line[6:]).get("choices")
        )
        # (a fake pod streams its 4 chunks whatever max_tokens says)
        assert text == "d0-0 d0-1 d1-0 d1-1 d1-2 d1-3 " and raw.rstrip().endswith("data: [DONE]")
        assert d0.bodies[0]["kv_transfer_params"]["remote_url"] == pf.url
        (continued,) = d1.bodies
        assert "kv_transfer_params" not in continued and continued["prompt"] == LONG + "d0-0 d0-1 "
        assert continued["max_tokens"] == 2
        assert metric(lr, "kvpilot_router_stream_migrations_total", model_name=MODEL) == 1


async def test_a_refused_decode_pod_is_retried_with_the_same_transfer() -> None:
    dead = Endpoint("a-dead", closed_port_url(), 64, "decode")
    async with fake_pods("pf") as (pf,), fake_pods("d1") as (d1,), live([dead, *roles([pf], [d1])]) as lr:
        status, _, headers = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
        assert status == 200 and headers[POD_HEADER] == "d1"
        assert len(pf.bodies) == 1  # one prefill, whichever decode pod takes the transfer
        assert d1.bodies[0]["kv_transfer_params"]["transfer_id"] == "pf-1"
        assert metric(lr, "kvpilot_router_upstream_retries_total", model_name=MODEL) == 1


async def test_a_lora_adapter_runs_on_both_roles() -> None:
    async with fake_pods("pf") as (pf,), fake_pods("d0") as (d0,):
        router = Router(RouterSettings(scrape_interval_s=0, adapters={MODEL: ("sql",)}))
        router.add_source(StaticSource({MODEL: roles([pf], [d0])}, disaggregation={MODEL: PD}))
        lr = await start_router(router)
        try:
            await until(lambda: router.synced)
            status, _, _ = await post(lr, {"model": "sql", "prompt": LONG, "max_tokens": 2})
            assert status == 200
            assert pf.bodies[0]["model"] == "sql" and d0.bodies[0]["model"] == "sql"
            assert paths(lr) == {"disaggregated": 1, "direct": 0, "no_prefill": 0, "prefill_failed": 0}
        finally:
            await lr.runner.cleanup()


async def test_the_cli_flags_make_a_static_model_disaggregated() -> None:
    async with fake_pods("pf") as (pf,), fake_pods("d0") as (d0,):
        router = build_router(
            args(
                "--endpoints", f"{MODEL}={d0.url}", "--prefill-endpoints", f"{MODEL}={pf.url}",
                "--pd-min-prompt-tokens", "50", "--pd-transfer-timeout", "3", "--scrape-interval", "0",
            )
        )  # fmt: skip
        lr = await start_router(router)
        try:
            await until(lambda: router.synced)
            assert router._pd_of[MODEL] == PdSettings(50, 3.0)
            status, _, _ = await post(lr, {"model": MODEL, "prompt": "x" * 200, "max_tokens": 2})
            assert status == 200 and pf.bodies and d0.bodies[0]["kv_transfer_params"]["remote_url"] == pf.url
        finally:
            await lr.runner.cleanup()
