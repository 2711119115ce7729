"""`kvpilot router` as a metric source: the requests its replicas hold for a model
(kvpilot_router_queue_depth; for a disaggregated model, those that need a prefill pod too:
pd_signals.py) and how the requests it proxied fared against the SLO
(kvpilot_router_slo_requests_total, judged with kvpilot.api.slo.judge). Every router replica is read:
a URL's host is resolved to all its addresses (the chart passes the router's headless Service).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.pd_signals import RouterPdCounts, parse_router_pd
from kvpilot.autoscaler.samples import MetricsParseError

log = logging.getLogger(__name__)

ROUTER_QUEUE_METRIC = "kvpilot_router_queue_depth"
ROUTER_SLO_METRIC = "kvpilot_router_slo_requests_total"
# The routers' SLO counter for one model, summed over the router replicas (instant values: the policy
# differences them between syncs, as it does the pods' counters).
ROUTER_SLO_QUERY = "sum by (outcome) (" + ROUTER_SLO_METRIC + '{model_name="{model}"})'


def parse_router_slo(text: str) -> dict[str, dict[str, float]]:
    """{model_name: {outcome: requests}} from a router's /metrics page (kvpilot_router_slo_requests_total)."""
    out: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                model, outcome = s.labels.get("model_name"), s.labels.get("outcome")
                if s.name == ROUTER_SLO_METRIC and model and outcome and math.isfinite(s.value):
                    by = out.setdefault(model, {})
                    by[outcome] = by.get(outcome, 0.0) + max(0.0, float(s.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"router: not Prometheus text format: {exc}") from exc
    return out


def parse_router_queues(text: str) -> dict[str, int]:
    """{model_name: queue depth} from a router's /metrics page (the models it serves)."""
    depths: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                model = s.labels.get("model_name")
                if s.name == ROUTER_QUEUE_METRIC and model and math.isfinite(s.value):
                    depths[model] = depths.get(model, 0.0) + float(s.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"router: not Prometheus text format: {exc}") from exc
    return {m: max(0, round(d)) for m, d in depths.items()}


def parse_router_queue(text: str, model: str) -> int | None:
    """The router's queue depth for `model` from its /metrics page; None when it does not serve it."""
    return parse_router_queues(text).get(model)


class RouterQueueSource:
    """Requests held by `kvpilot router` replicas for a model: the sum over the routers that serve it.

    Every router replica has its own queue, so every replica is read: a URL's host is resolved to all
    its addresses (a headless Service's name gives each router pod) and each is scraped. None when no
    router answered or none serves the model: unknown, never zero.
    """

    def __init__(self, urls: Sequence[str], timeout_s: float = 2.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.last: dict[str, int] | None = None  # the last depths read (the baseline for "grew")
        # The routers' SLO counters by model, from the same scrape as the last depths(); None: no
        # router answered.
        self.last_slo: dict[str, SloCounts] | None = None
        # The routers' P/D counters (pd_signals.py), from the same scrape; held_prefill summed over
        # the routers, each older one's whole queue counted.
        self.last_pd: dict[str, RouterPdCounts] | None = None

    async def _one(
        self, url: str
    ) -> tuple[dict[str, int], dict[str, dict[str, float]], dict[str, RouterPdCounts]] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
                return parse_router_queues(text), parse_router_slo(text), parse_router_pd(text)
        except (aiohttp.ClientError, TimeoutError, MetricsParseError, UnicodeDecodeError) as exc:
            log.info("router %s: scrape failed (%s)", url, exc or type(exc).__name__)
            return None

    async def _expand(self, url: str) -> list[str]:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            return [url]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.info("router %s: cannot resolve %s (%s)", url, host, exc)
            return []
        addresses = sorted({str(info[4][0]) for info in infos})
        return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses]

    async def depths(self) -> dict[str, int] | None:
        """{model_name: requests held} summed over every router replica that answered; None if none did."""
        urls = [u for group in await asyncio.gather(*(self._expand(u) for u in self.urls)) for u in group]
        pages = [d for d in await asyncio.gather(*(self._one(u) for u in urls)) if d is not None]
        if not pages:
            self.last_slo = None
            self.last_pd = None
            return None
        total: dict[str, int] = {}
        slo: dict[str, SloCounts] = {}
        pd: dict[str, RouterPdCounts] = {}
        for depths, counters, pd_counts in pages:
            for model, depth in depths.items():
                total[model] = total.get(model, 0) + depth
            for model, by_outcome in counters.items():
                slo[model] = slo.get(model, SloCounts()) + SloCounts.from_outcomes(by_outcome)
            for model in depths.keys() | pd_counts.keys():
                c = pd_counts.get(model, RouterPdCounts())
                if c.held_prefill is None:  # a router that does not say: all it holds (pd_signals.py)
                    c = replace(c, held_prefill=float(depths.get(model, 0)))
                pd[model] = pd.get(model, RouterPdCounts()) + c
        self.last = total
        self.last_slo = slo
        self.last_pd = pd
        return total

    async def queue_depth(self, model: str) -> int | None:
        depths = await self.depths()
        return None if depths is None else depths.get(model)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
