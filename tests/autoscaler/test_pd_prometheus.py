"""The routers' P/D series read through a real Prometheus (pd_signals.ROUTER_PD_QUERIES,
sources.PrometheusSource.router_pd): the autoscaler's source when it has no router URL. Two real
routers (one with a prefill pod, one whose model has none routable) are scraped by a real Prometheus
server; what the source reads equals what the routers' own pages say, summed over both."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import yaml

from kvpilot.autoscaler.pd_signals import RouterPdCounts, parse_router_pd
from kvpilot.autoscaler.sources import ModelRef, PrometheusSource
from kvpilot.net import free_port
from tests.needs import require_tool
from tests.router.test_pd_server import LONG, MODEL, fake_pods, live, roles
from tests.router.test_server import post
from tests.router.upstreams import LiveRouter

REF = ModelRef("ml", MODEL, MODEL)


@contextlib.contextmanager
def prometheus(targets: list[str], tmp: Path, labels: list[dict[str, str]] | None = None) -> Iterator[str]:
    """A real Prometheus server scraping `targets` (host:port) every 200 ms, each target's series with
    its `labels` (as a Kubernetes service discovery would add namespace and pod); its base URL."""
    binary = require_tool("prometheus", "run `bash scripts/tools.sh` (Debian package prometheus)")
    statics: list[dict[str, object]] = (
        [{"targets": targets}]
        if labels is None
        else [{"targets": [t], "labels": lab} for t, lab in zip(targets, labels, strict=True)]
    )
    config = {
        "global": {"scrape_interval": "200ms", "scrape_timeout": "150ms"},
        "scrape_configs": [{"job_name": "kvpilot-router", "static_configs": statics}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def page(lr: LiveRouter) -> str:
    async with aiohttp.ClientSession() as s, s.get(lr.url + "/metrics") as r:
        return await r.text()


@contextlib.asynccontextmanager
async def two_routers() -> AsyncIterator[tuple[LiveRouter, LiveRouter]]:
    async with (
        fake_pods("pf") as (pf,),
        fake_pods("d0", "d1") as (d0, d1),
        live(roles([pf], [d0])) as with_prefill,
        live(roles([], [d1])) as without_prefill,
    ):
        yield with_prefill, without_prefill


async def test_the_routers_pd_series_read_through_prometheus(tmp_path: Path) -> None:
    async with two_routers() as (a, b):
        with prometheus([a.url.removeprefix("http://"), b.url.removeprefix("http://")], tmp_path) as url:
            source = PrometheusSource(url)
            try:
                for lr in (a, a, b):  # two prefill legs on a; one long prompt without a prefill pod on b
                    status, _, _ = await post(lr, {"model": MODEL, "prompt": LONG, "max_tokens": 2})
                    assert status == 200
                pages = parse_router_pd(await page(a))[MODEL] + parse_router_pd(await page(b))[MODEL]
                assert (pages.prefill_legs, pages.no_prefill, pages.held_prefill) == (2, 1, 0)
                got: RouterPdCounts | None = None
                deadline = time.monotonic() + 30
                while got != pages:  # Prometheus scrapes every 200 ms
                    assert time.monotonic() < deadline, f"Prometheus answered {got}, the pages say {pages}"
                    await asyncio.sleep(0.2)
                    got = await source.router_pd(REF)
                assert got is not None and got.prefill_seconds > 0
                # a model no router serves: nothing found, not zeros
                assert await source.router_pd(ModelRef("ml", "other", "other")) is None
            finally:
                await source.close()


async def test_a_prometheus_that_fails_leaves_the_pd_counters_out() -> None:
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)  # nothing listens
    try:
        assert await source.router_pd(REF) is None
    finally:
        await source.close()


async def test_a_source_without_token_counters_asks_no_pd_queries() -> None:
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", token_counters=False)
    try:
        assert source.router_pd_queries == {} and await source.router_pd(REF) is None
    finally:
        await source.close()
