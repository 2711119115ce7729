"""A pod's load as its /metrics page tells it: KV use and waiting requests (parse_load, pure), and
the scrape that reads it into the pod's view for the routing policies."""

from __future__ import annotations

import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api.pod_metrics import KV_CACHE_USAGE, REQUESTS_WAITING
from kvpilot.router.call import UPSTREAM_ERRORS
from kvpilot.router.pool import Pod


async def scrape(session: aiohttp.ClientSession, pod: Pod, model: str, interval_s: float) -> None:
    """Read the pod's /metrics into pod.kv_usage and pod.waiting (None: unknown, not zero)."""
    try:
        timeout = aiohttp.ClientTimeout(total=max(0.5, interval_s))
        async with session.get(pod.url + "/metrics", timeout=timeout) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (*UPSTREAM_ERRORS, UnicodeDecodeError):
        pod.kv_usage, pod.waiting = None, None  # unknown, not zero
        return
    pod.answered_at = time.monotonic()
    kv, waiting = parse_load(text, model)
    pod.kv_usage, pod.waiting = kv, waiting


def parse_load(text: str, model: str) -> tuple[float | None, int | None]:
    """KV use and waiting count of a pod's /metrics page (kvpilot's or vLLM's names), None if absent."""
    kv_names, waiting_names = KV_CACHE_USAGE.names, REQUESTS_WAITING.names
    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                # the pod was chosen by its model already; a differing served name still counts
                if s.name in kv_names or s.name in waiting_names:
                    found.setdefault(s.name, []).append(float(s.value))
    except (ValueError, TypeError, IndexError):
        return None, None
    kv = next((found[n] for n in kv_names if n in found), None)
    waiting = next((found[n] for n in waiting_names if n in found), None)
    return (
        None if kv is None else min(1.0, max(0.0, sum(kv) / len(kv))),
        None if waiting is None else max(0, round(sum(waiting))),
    )
