"""The SLO planner's token mix read through a real Prometheus (sources.PrometheusSource): per pod, the
prompt- and output-length histograms' sums where the pod exports them (the tokens of the requests it
finished), its token counters where it does not (one `or` per family, as the pod scrape prefers), and
the admitted-prompt histogram's count and sum (the prompts arriving) where it exports that."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from kvpilot.autoscaler.sources import ModelRef, PodTarget, PrometheusSource
from tests.autoscaler.test_pd_prometheus import prometheus
from tests.autoscaler.test_sources import _serve, surge_page

REF = ModelRef("ml", "llama", "llama")


async def serve(text: str) -> tuple[web.AppRunner, int]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return await _serve(app)


async def test_each_pod_reports_finished_tokens_where_it_can(tmp_path: Path) -> None:
    a, port_a = await serve(surge_page(with_histograms=True))
    b, port_b = await serve(surge_page(with_histograms=False))
    try:
        targets = [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"]
        labels = [{"namespace": "ml", "pod": "a"}, {"namespace": "ml", "pod": "b"}]
        with prometheus(targets, tmp_path, labels) as url:
            source = PrometheusSource(url)
            try:
                pods = [PodTarget("a", "10.0.0.1"), PodTarget("b", "10.0.0.2")]
                got: dict[str, tuple[float | None, ...]] = {}
                deadline = time.monotonic() + 30
                while len(got) < 2 or any(v[0] is None for v in got.values()):  # scraped every 200 ms
                    assert time.monotonic() < deadline, f"Prometheus answered {got}"
                    await asyncio.sleep(0.2)
                    snap = await source.collect(REF, pods)
                    got = {
                        s.pod: (
                            s.completed_total,
                            s.prompt_tokens_total,
                            s.generation_tokens_total,
                            s.finished_lengths_total,
                            s.admitted_total,
                            s.admitted_prompt_tokens_total,
                        )
                        for s in snap.samples
                    }
            finally:
                await source.close()
    finally:
        await a.cleanup()
        await b.cleanup()
    # the histograms' sums: 1,000 and 100 a finished request (3 of the 4 finished: one aborted); 12
    # admitted, 9 of them of 3,000
    assert got["a"] == (4.0, 3000.0, 300.0, 3.0, 12.0, 30000.0)
    # the counters, which count the 9 unfinished ones too; no histograms
    assert got["b"] == (4.0, 30000.0, 480.0, None, None, None)
