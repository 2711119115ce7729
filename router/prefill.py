"""The prefill leg of a disaggregated request (docs/disaggregation.md, "Router"): the prompt run on a
prefill pod, whose answer carries the `kv_transfer_params` the decode leg sends on. The decisions are
pd.py's; this is the I/O.

The leg is an optimisation, not the request: waiting for a prefill pod with room (which the prefill
pool's own queue orders by priority and tenant like the central queue) is bounded by the model's
transfer timeout, the prompt's run on the pod by the budget the pool's measured speed gives it
(`pd.PrefillSpeed`: a leg far slower than the pool's is given up, and closing its connection makes
the pod abort the prompt), and whatever goes wrong returns None, so the request runs whole on its
decode pod instead (the caller counts it `prefill_failed`). A refused or reset connection or a 503 is
tried on another prefill pod first (up to --max-retries), as for any request; each exchange's outcome
goes to the prefill pool's outlier detector, and the pod's time to answer to its latency average
(what least-loaded and kv-aware read).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from kvpilot.router.call import Call, Retry
from kvpilot.router.health import PodHealth
from kvpilot.router.judge import SloBook
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.pd import PREFILL_SLACK, PdSettings, PrefillSpeed, prefill_body, transfer_params
from kvpilot.router.policy import AdapterAffinity
from kvpilot.router.pool import ModelPool, Overloaded, Pod
from kvpilot.router.settings import RouterSettings
from kvpilot.router.upstream import Upstream

log = logging.getLogger("kvpilot.router")


class PrefillLeg:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        health: PodHealth,
        slo: SloBook,
        upstream: Upstream,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.health = health
        self.slo = slo
        self.upstream = upstream
        self._speed: dict[str, PrefillSpeed] = {}

    async def run(
        self, call: Call, pool: ModelPool, pd: PdSettings, prompt_tokens: int
    ) -> dict[str, Any] | None:
        """The transfer params for the decode leg, or None when the leg failed (logged).
        `prompt_tokens`: the prompt's size as the router estimates it (pd.plan)."""
        started = time.monotonic()
        params, why = await self._legs(call, pool, pd, prompt_tokens, started)
        if params is None:
            log.warning("prefill of a %s request failed (%s); it runs whole on a decode pod", pool.model, why)
            return None
        self.metrics.pd_prefill_seconds.labels(pool.model).observe(time.monotonic() - started)
        return params

    def speed(self, model: str) -> PrefillSpeed:
        """The model's prefill pool's measured speed (kept across its pool's rebuilds)."""
        return self._speed.setdefault(model, PrefillSpeed())

    async def _legs(
        self, call: Call, pool: ModelPool, pd: PdSettings, prompt_tokens: int, started: float
    ) -> tuple[dict[str, Any] | None, str]:
        """Prefill pods tried in turn: (the params, "") or (None, why not)."""
        raw = json.dumps(prefill_body(call.body)).encode()
        tried: set[str] = set()
        while True:
            left = pd.transfer_timeout_s - (time.monotonic() - started)
            if left <= 0:
                return None, f"no prefill pod within the transfer timeout ({pd.transfer_timeout_s:g}s)"
            try:
                pod = await pool.acquire(call.key, frozenset(tried), call.priority, call.tenant, left)
            except Overloaded as e:
                return None, f"no prefill pod: {e}"
            budget = self.speed(pool.model).budget_s(prompt_tokens, pd.transfer_timeout_s)
            try:
                async with asyncio.timeout(budget):
                    return await self._exchange(call, pool, pod, raw, prompt_tokens)
            except Retry as e:
                tried.add(pod.name)
                if len(tried) > self.settings.max_retries or not pool.routable(frozenset(tried)):
                    return None, str(e)
                log.info("prefill of %s: retrying on another pod after %s", pool.model, e)
            except TimeoutError:
                return None, (
                    f"{pod.name} did not finish the prompt (~{prompt_tokens} tokens) within {budget:.1f}s, "
                    f"the transfer timeout plus {PREFILL_SLACK:g}x the time the pool's measured speed gives it"
                )
            finally:
                pool.release(pod, call.key)

    async def _exchange(
        self, call: Call, pool: ModelPool, pod: Pod, raw: bytes, prompt_tokens: int
    ) -> tuple[dict[str, Any] | None, str]:
        """One prefill request to `pod`: (its transfer params, "") or (None, why not: an answer
        other than 200, or one without them); Retry when another prefill pod may take it."""
        upstream = await self.upstream.open(call, pool, pod, raw)  # Retry: refused, reset, 503, silent
        sent = call.sent_at
        try:
            data = await self.upstream.read_whole(pool, pod, upstream)
        finally:
            upstream.close()
        self.health.answered(pool, pod, upstream.status)
        if upstream.status != 200:
            if upstream.status == 404 and call.key.adapter and isinstance(pool.policy, AdapterAffinity):
                pool.policy.lacks(pod.name, call.key.adapter)  # a pod from before the adapter was added
            return None, f"{pod.name} answered {upstream.status}: {data[:300]!r}"
        answer: Any = None
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            answer = json.loads(data)
        params = transfer_params(answer, pod.url)
        if params is None:
            return None, f"{pod.name} answered without kv_transfer_params"
        took = time.monotonic() - sent
        self.slo.observe(pool, pod, took, None)
        speed = self.speed(pool.model)
        speed.observe(prompt_tokens, took)
        if speed.seconds_per_token:
            self.metrics.pd_prefill_speed.labels(pool.model).set(1.0 / speed.seconds_per_token)
        return params, ""
