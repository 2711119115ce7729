"""The router's held requests split by the pool they need (kvpilot_router_pd_queued): read from real
router /metrics pages (router_source.RouterQueueSource, pd_signals.parse_router_pd) and used by the
P/D policy: only the prefill-bound ones are prefill backlog, all of them decode's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from aiohttp import web
from prometheus_client import generate_latest

from kvpilot.autoscaler.pd_policy import PdSnapshot, PdState, PdTargets, decide_pd
from kvpilot.autoscaler.pd_signals import RouterPdCounts, held_for_prefill, parse_router_pd
from kvpilot.autoscaler.router_source import RouterQueueSource
from kvpilot.autoscaler.samples import MetricsSnapshot, ReplicaSample
from kvpilot.router.metrics import RouterMetrics
from tests.autoscaler.test_controller import T0

AUTOSCALING = {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 2}  # the e2e test's


def targets(**autoscaling: object) -> PdTargets:
    return PdTargets.from_spec({**AUTOSCALING, **autoscaling}, {})


def router_page(depth: int, held: dict[str, int] | None) -> str:
    """A `kvpilot router` /metrics page (its own metrics) holding `depth` requests of model "chat";
    `held`: its kvpilot_router_pd_queued by path (None: a router from before the gauge)."""
    m = RouterMetrics()
    m.queue_depth.labels("chat").set(depth)
    m.queue_depth.labels("other").set(3)  # an aggregated model
    for path, n in (held or {}).items():
        m.pd_queued.labels("chat", path).set(n)
    return generate_latest(m.registry).decode()


@asynccontextmanager
async def routers(*pages: str) -> AsyncIterator[list[str]]:
    runners = []
    urls = []
    for page in pages:

        async def metrics(_: web.Request, text: str = page) -> web.Response:
            return web.Response(text=text)

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        yield urls
    finally:
        for r in runners:
            await r.cleanup()


def test_the_prefill_share_parses_from_a_router_page() -> None:
    got = parse_router_pd(router_page(5, {"prefill": 2, "direct": 3}))
    assert got == {"chat": RouterPdCounts(held_prefill=2.0)}
    assert parse_router_pd(router_page(5, None)) == {}  # an older router says nothing
    assert held_for_prefill(5, got["chat"]) == 2
    assert held_for_prefill(5, RouterPdCounts()) == 5  # not said: all it holds
    assert held_for_prefill(None, None) == 0


async def test_every_router_is_counted_an_older_one_with_its_whole_queue() -> None:
    pages = (router_page(5, {"prefill": 2, "direct": 3}), router_page(4, None))
    async with routers(*pages) as urls:
        source = RouterQueueSource(urls)
        try:
            assert await source.depths() == {"chat": 9, "other": 6}
            assert source.last_pd is not None
            # 2 from the router that says, 4 (all it holds) from the one that does not
            assert source.last_pd["chat"].held_prefill == 6.0
        finally:
            await source.close()
    async with routers(router_page(5, {"prefill": 0, "direct": 5})) as urls:
        source = RouterQueueSource(urls)
        try:
            await source.depths()
            assert source.last_pd is not None and source.last_pd["chat"].held_prefill == 0.0
        finally:
            await source.close()


def _idle_prefill() -> MetricsSnapshot:
    return MetricsSnapshot(1, (ReplicaSample("p0", 0.0, 0, 0, 0.0, prompt_tokens_total=0.0),))


def _busy_decode() -> MetricsSnapshot:
    return MetricsSnapshot(1, (ReplicaSample("d0", 0.5, 0, 4, 0.0),))


def test_short_prompts_held_in_front_of_decode_grow_decode_alone() -> None:
    """The e2e's (1, 1) -> (2, 2) on decode-only load: 10 short prompts held by the router."""
    snap = PdSnapshot(_idle_prefill(), _busy_decode(), router_queue=10)
    said = decide_pd(
        (1, 1), replace(snap, router_pd=RouterPdCounts(held_prefill=0.0)), targets(), PdState(), T0
    )
    assert said.desired == (1, 2)
    assert said.prefill.signal == "queue" and "queue 0 waiting" in said.prefill.text
    # An older router (no split): its whole queue is prefill backlog too, as before.
    older = decide_pd((1, 1), replace(snap, router_pd=RouterPdCounts()), targets(), PdState(), T0)
    assert older.desired == (2, 2) and "queue 10 waiting" in older.prefill.text
    # Long prompts held: prefill's backlog as well.
    long = decide_pd(
        (1, 1), replace(snap, router_pd=RouterPdCounts(held_prefill=10.0)), targets(), PdState(), T0
    )
    assert long.desired == (2, 2)


def test_from_zero_a_held_request_wakes_the_roles_it_needs() -> None:
    t = targets(minReplicas=0)
    zero = PdSnapshot(MetricsSnapshot(0), MetricsSnapshot(0), router_queue=2)
    short = decide_pd((0, 0), replace(zero, router_pd=RouterPdCounts(held_prefill=0.0)), t, PdState(), T0)
    assert short.desired == (0, 1)
    one_long = decide_pd((0, 0), replace(zero, router_pd=RouterPdCounts(held_prefill=1.0)), t, PdState(), T0)
    assert one_long.desired == (1, 1) and one_long.prefill.signal == "scale from zero"
    # the decode role up, the prefill role at zero: short prompts held do not wake it
    at_decode = decide_pd((0, 1), replace(zero, router_pd=RouterPdCounts(held_prefill=0.0)), t, PdState(), T0)
    assert at_decode.prefill.desired == 0
