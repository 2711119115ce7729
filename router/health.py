"""Pods' health as the router sees it (docs/router.md, "Deadlines and outlier ejection"): every wait
on a pod under a deadline (deadline.py: past it the pod must answer GET /health, one probe per pod at
a time), and each exchange's outcome counted: an answer, a failure, an ejection by the pool's outlier
detector (outlier.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import aiohttp

from kvpilot.router.call import UPSTREAM_ERRORS
from kvpilot.router.deadline import PodDeadline
from kvpilot.router.judge import SloBook
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.outlier import Ejection
from kvpilot.router.pool import ModelPool, Pod
from kvpilot.router.settings import RouterSettings

log = logging.getLogger("kvpilot.router")


class PodHealth:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        slo: SloBook,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.slo = slo
        self._session = session
        self.probes: dict[str, asyncio.Task[bool]] = {}  # pod URL -> its health probe in flight

    async def next_chunk(self, pod: Pod, upstream: aiohttp.ClientResponse) -> bytes:
        """The body's bytes that came since the last call (b"" at its end), within the idle deadline;
        bytes already buffered are taken without arming it."""
        content = upstream.content
        chunk = content.read_nowait()
        if chunk or content.at_eof():
            return chunk
        async with self.deadline(pod, "idle"):
            return await content.readany()

    def deadline(self, pod: Pod, phase: str) -> PodDeadline:
        """The deadline of one wait on `pod`: its response headers (first_byte) or its next chunk (idle)."""
        s = self.settings
        timeout, what = (
            (s.first_byte_timeout_s, "response headers")
            if phase == "first_byte"
            else (s.idle_timeout_s, "chunk")
        )
        return PodDeadline(functools.partial(self._alive, pod), timeout, s.silence_limit_s, phase, what)

    async def _alive(self, pod: Pod, since: float) -> bool:
        """The pod answered anything since `since`, or answers a health probe now (one per pod at a
        time: every request waiting on the pod shares it)."""
        if pod.answered_at >= since:
            return True
        probe = self.probes.get(pod.url)
        if probe is None:
            probe = asyncio.create_task(self._probe(pod))
            self.probes[pod.url] = probe
            probe.add_done_callback(functools.partial(self._probe_done, pod.url))
        return await asyncio.shield(probe)

    def _probe_done(self, url: str, task: asyncio.Task[bool]) -> None:
        if self.probes.get(url) is task:
            del self.probes[url]

    async def _probe(self, pod: Pod) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.settings.probe_timeout_s)
        try:
            async with self._session().get(pod.url + "/health", timeout=timeout) as resp:
                alive = resp.status == 200
        except UPSTREAM_ERRORS:
            return False
        if alive:
            pod.answered_at = time.monotonic()
        return alive

    def answered(self, pool: ModelPool, pod: Pod, status: int) -> None:
        """The pod's whole answer went through: a 5xx counts as a failure, anything else as a success."""
        if status >= 500:
            self.failed(pool, pod, f"answered {status}")
        else:
            pool.succeeded(pod)

    def failed(self, pool: ModelPool, pod: Pod, why: str, timeout_phase: str | None = None) -> None:
        if timeout_phase is not None:
            self.metrics.timeouts.labels(pool.model, timeout_phase).inc()
        self.slo.meter.pod_error(pool.model, pod.name)
        self.slo.sync_latency(pool, pod)
        ejection = pool.failed(pod)
        if ejection is not None:
            self._ejected(pool, ejection, why)

    def _ejected(self, pool: ModelPool, ejection: Ejection, why: str) -> None:
        self.metrics.ejections.labels(pool.model, ejection.pod).inc()
        self.metrics.ejected_pods.labels(pool.model).inc()  # the router's tick recounts it
        log.warning(
            "ejected pod %s of %s for %gs (ejection %d) after %d failures in a row; last: %s",
            ejection.pod,
            pool.model,
            ejection.seconds,
            ejection.count,
            ejection.failures,
            why,
        )

    async def read_body(self, pod: Pod, upstream: aiohttp.ClientResponse) -> bytes:
        parts: list[bytes] = []
        while True:
            chunk = await self.next_chunk(pod, upstream)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
