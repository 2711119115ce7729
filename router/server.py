"""The router's HTTP shell: one OpenAI endpoint that proxies each request to a pod of its model.

Decisions live in `policy` and admission in `pool`; this module keeps the models' pools, reads the
request, asks the model's pool for a pod (queueing when none has room) and has `upstream` forward the
body as is and pass the answer back: server-sent events as they arrive, other bodies whole. A
refused or reset connection, a missed connect or first-byte deadline, or a 503 (a draining pod)
before any byte reached the client is retried here on another pod (upstream raises `call.Retry`);
after the first byte nothing is retried, and a pod that dies or goes silent mid-stream continues on
another pod or ends the stream with an error event (upstream). Each wait on a pod runs under a
deadline and each exchange's outcome goes to the pool's outlier detector (`health`); each request is
judged against its model's SLO (`judge`). The request's record is `call.Call`.
A client that goes away cancels the handler (handler_cancellation), which closes the upstream
connection, and the pod aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.api.slo import SloTargets
from kvpilot.request_body import BodyError, parse_json_object
from kvpilot.router.call import (
    FALLBACK_HEADER,
    POD_HEADER,
    QUEUE_TIMEOUT_HEADER,
    REJECT_HEADER,
    RETRY_AFTER_S,
    Call,
    Retry,
)
from kvpilot.router.errors import error_response, openai_errors
from kvpilot.router.health import PodHealth
from kvpilot.router.judge import SloBook
from kvpilot.router.keys import prompt_text, request_key
from kvpilot.router.load import parse_load, scrape
from kvpilot.router.measure import SloMeter
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.pd import DECODE_POLICY, HELD_PATHS, PdSettings, decode_body, held_path
from kvpilot.router.pd import plan as pd_plan
from kvpilot.router.policy import POLICIES, AdapterAffinity, make_policy, stable_hash
from kvpilot.router.pool import Endpoint, ModelPool, Overloaded, Slot, priority_class
from kvpilot.router.prefill import PrefillLeg
from kvpilot.router.settings import PRIORITY_HEADER, SESSION_HEADER, RouterSettings
from kvpilot.router.source import EndpointSource, UpdateEndpoints
from kvpilot.router.upstream import Upstream

# the names the router's users import from here (cli.py, discovery, tests, e2e)
__all__ = [
    "FALLBACK_HEADER",
    "POD_HEADER",
    "PRIORITY_HEADER",
    "QUEUE_TIMEOUT_HEADER",
    "REJECT_HEADER",
    "SESSION_HEADER",
    "EndpointSource",
    "Router",
    "RouterSettings",
    "UpdateEndpoints",
    "error_response",
    "parse_load",
]

log = logging.getLogger("kvpilot.router")


class Router:
    def __init__(self, settings: RouterSettings | None = None, metrics: RouterMetrics | None = None) -> None:
        self.settings = settings or RouterSettings()
        if self.settings.policy not in POLICIES:
            raise ValueError(
                f"unknown routing policy {self.settings.policy!r}; choose one of {', '.join(POLICIES)}"
            )
        make_policy(self.settings.policy, **self.settings.policy_options)  # options are checked up front
        AdapterAffinity(
            make_policy(self.settings.policy), self.settings.adapter_eps, self.settings.adapter_slots
        )
        self.metrics = metrics or RouterMetrics()
        self.meter = SloMeter(self.settings.slo, self.settings.slo_window_s, self.settings.latency_alpha)
        self.slo = SloBook(self.meter, self.metrics)
        self.pod_health = PodHealth(self.settings, self.metrics, self.slo, self._client)
        self.upstream = Upstream(self.settings, self.metrics, self.pod_health, self.slo, self._client)
        self.prefill = PrefillLeg(self.settings, self.metrics, self.pod_health, self.slo, self.upstream)
        self.pools: dict[str, ModelPool] = {}  # model -> its pods (a disaggregated model's decode pods)
        self.prefill_pools: dict[str, ModelPool] = {}  # disaggregated model -> its prefill pods
        self._pd_of: dict[str, PdSettings] = {}
        self._fallback_of: dict[str, str] = {}
        self._adapters_of: dict[str, tuple[str, ...]] = {}  # model -> its adapters, as declared
        self.adapter_parent: dict[str, str] = {}  # adapter name -> the model that serves it
        self.synced = False
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.app = web.Application(client_max_size=64 * 2**20, middlewares=[openai_errors])
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", self.metrics_handler),
            ]
        )
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    # -- endpoints ------------------------------------------------------------------------------

    def update(
        self,
        model: str,
        endpoints: list[Endpoint] | None,
        policy: str | None = None,
        fallback: str | None = None,
        adapters: Sequence[str] | None = None,
        slo: SloTargets | None = None,
        disaggregation: PdSettings | None = None,
    ) -> None:
        """Set a model's Ready pods, its routing policy (None = the router's default), the model
        that takes its requests instead of a 429 (None = the static --fallback, if any), the names
        of its LoRA adapters (None = the static --adapters, if any), its SLO targets (None = the
        router's --slo-* flags) and its P/D settings (None: not disaggregated, every pod serves
        whole requests). A disaggregated model's prefill pods (role "prefill") form its prefill
        pool, routed by the model's policy; its other pods are its decode pods, routed by
        least-loaded (pd.DECODE_POLICY), and admit its requests through the central queue.

        endpoints None removes the model: it leaves /v1/models and new requests for it get 404.
        """
        if endpoints is None:
            self.remove_model(model)
            return
        chosen = fallback or self.settings.fallbacks.get(model)
        if chosen and chosen != model:
            self._fallback_of[model] = chosen
        else:
            self._fallback_of.pop(model, None)
        declared = tuple(self.settings.adapters.get(model, ()) if adapters is None else adapters)
        name = policy or self.settings.policy
        prefill = [e for e in endpoints if e.role == "prefill"] if disaggregation else []
        decode = [e for e in endpoints if e.role != "prefill"] if disaggregation else endpoints
        is_new = model not in self.pools
        pool = self._pool(self.pools, model, DECODE_POLICY if disaggregation else name, self._queue_changed)
        self.metrics.queue_depth.labels(model).set(pool.queue_depth)
        if is_new or self._adapters_of.get(model) != declared:  # a new model may shadow an adapter
            self._adapters_of[model] = declared
            self._index_adapters()
        self.meter.set_targets(model, slo)
        self._set_pods(pool, decode)
        self.metrics.ready_pods.labels(model).set(len(pool.pods))
        if disaggregation is None:
            self._drop_prefill(model)
            return
        self._pd_of[model] = disaggregation
        prefill_pool = self._pool(self.prefill_pools, model, name, None)
        self._set_pods(prefill_pool, prefill)
        self.metrics.pd_prefill_pods.labels(model).set(len(prefill_pool.pods))

    def _pool(
        self,
        pools: dict[str, ModelPool],
        model: str,
        policy: str,
        on_queue_change: Callable[[str, int], None] | None,
    ) -> ModelPool:
        """The model's pool in `pools`, made (or remade when its policy changed: the queue, the
        counters and the ejections stay) for `policy`."""
        pool = pools.get(model)
        if pool is not None and pool.policy.name == policy:
            return pool
        options = self.settings.policy_options if policy == self.settings.policy else {}
        chosen = AdapterAffinity(
            make_policy(policy, **options), self.settings.adapter_eps, self.settings.adapter_slots
        )
        new = ModelPool(model, chosen, self.settings.queue, on_queue_change, outliers=self.settings.outliers)
        if pool is not None:
            new.pods, new._queue, new.outliers = pool.pods, pool._queue, pool.outliers
        pools[model] = new
        return new

    def _set_pods(self, pool: ModelPool, endpoints: list[Endpoint]) -> None:
        gone = pool.pods.keys() - {e.name for e in endpoints}
        pool.set_endpoints(endpoints)
        for name in gone:
            self.meter.forget_pod(pool.model, name)
            for gauge in (self.metrics.pod_ttft, self.metrics.pod_tpot, self.metrics.pod_errors):
                with contextlib.suppress(KeyError):
                    gauge.remove(pool.model, name)

    def _drop_prefill(self, model: str) -> None:
        """The model is no longer disaggregated (or gone): its prefill pool goes."""
        self._pd_of.pop(model, None)
        prefill_pool = self.prefill_pools.pop(model, None)
        if prefill_pool is not None:
            self._set_pods(prefill_pool, [])
            self.metrics.pd_prefill_pods.labels(model).set(0)
            for path in HELD_PATHS:
                with contextlib.suppress(KeyError):
                    self.metrics.pd_queued.remove(model, path)

    def _index_adapters(self) -> None:
        """adapter -> parent model. A name that is also a model's stays the model's; an adapter two
        models declare goes to the first model by name (both logged: the other cannot be reached)."""
        parent: dict[str, str] = {}
        for model in sorted(self._adapters_of):
            for adapter in self._adapters_of[model]:
                if adapter in self.pools:
                    log.warning("adapter %r of %s has the name of a model; it is not routed", adapter, model)
                elif adapter in parent and parent[adapter] != model:
                    log.warning(
                        "adapter %r is declared by %s and %s; routed to %s",
                        adapter,
                        parent[adapter],
                        model,
                        parent[adapter],
                    )
                else:
                    parent[adapter] = model
        self.adapter_parent = parent

    def remove_model(self, model: str) -> None:
        pool = self.pools.pop(model, None)
        self._drop_prefill(model)
        self._fallback_of.pop(model, None)
        self._adapters_of.pop(model, None)
        self._index_adapters()  # its adapters leave; an adapter it shadowed may come back
        self.meter.forget_model(model)
        if pool is not None:
            pool.set_endpoints([])
            self.metrics.ready_pods.labels(model).set(0)
            self.metrics.ejected_pods.labels(model).set(0)

    def mark_synced(self) -> None:
        self.synced = True

    def _queue_changed(self, model: str, depth: int) -> None:
        self.metrics.queue_depth.labels(model).set(depth)

    # -- lifecycle ------------------------------------------------------------------------------

    def add_source(self, source: EndpointSource) -> None:
        self.app.on_startup.append(lambda app: self._spawn(source.run(self.update, self.mark_synced)))

    async def _spawn(self, coro: Awaitable[Any]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("router background task failed")

        self._tasks.append(asyncio.create_task(guarded()))

    def _client(self) -> aiohttp.ClientSession:
        """The session to the pods (made at startup)."""
        assert self._session is not None
        return self._session

    async def _startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
        await self._spawn(self._tick())
        if self.settings.scrape_interval_s > 0:
            await self._spawn(self._scrape_loop())

    async def _cleanup(self, app: web.Application) -> None:
        probes = list(self.pod_health.probes.values())
        for task in [*self._tasks, *probes]:
            task.cancel()
        for task in [*self._tasks, *probes]:
            with contextlib.suppress(BaseException):
                await task
        if self._session is not None:
            await self._session.close()

    async def _tick(self) -> None:
        """Pods coming back from their unhealthy spell take queued requests without a release."""
        while True:
            await asyncio.sleep(0.25)
            for pool in list(self.prefill_pools.values()):
                pool.pump()
            for pool in list(self.pools.values()):
                pool.pump()
            self._pool_gauges()

    def _pool_gauges(self) -> None:
        """Requests in flight (each holds a slot on a decode pod, or its model's only pod) and pods
        ejected now (a disaggregated model's prefill pods too)."""
        for model, pool in list(self.pools.items()):
            self.metrics.in_flight.labels(model).set(pool.in_flight)
            prefill = self.prefill_pools.get(model)
            ejected = pool.ejected_count + (prefill.ejected_count if prefill is not None else 0)
            self.metrics.ejected_pods.labels(model).set(ejected)
            if model in self._pd_of:  # what its held requests will need (pd.held_path)
                held = pool.queued_with("prefill")
                self.metrics.pd_queued.labels(model, "prefill").set(held)
                self.metrics.pd_queued.labels(model, "direct").set(max(0, pool.queue_depth - held))

    async def _scrape_loop(self) -> None:
        while True:
            pools = [*self.pools.values(), *self.prefill_pools.values()]
            pods = [(pool, pod) for pool in pools for pod in list(pool.pods.values())]
            interval = self.settings.scrape_interval_s
            await asyncio.gather(*(scrape(self._client(), pod, pool.model, interval) for pool, pod in pods))
            await asyncio.sleep(self.settings.scrape_interval_s)

    # -- handlers -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if not self.synced:
            return error_response(
                503, "the router has not listed its models' pods yet", "service_unavailable"
            )
        return web.json_response({"status": "ready", "models": sorted(self.pools)})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self._pool_gauges()
        self.slo.export(time.monotonic(), [*self.pools.values(), *self.prefill_pools.values()])
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        data: list[dict[str, Any]] = []
        for m in sorted(self.pools):
            card = {"id": m, "object": "model", "created": 0, "owned_by": "kvpilot"}
            data.append(card)
            for adapter in self._adapters_of.get(m, ()):
                if self.adapter_parent.get(adapter) == m:
                    data.append({**card, "id": adapter, "parent": m})
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    async def _proxy(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json_object(raw)  # the runtime's checks: a pod would refuse it the same way
        except BodyError as e:
            return error_response(400, e.message, param=e.param)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return error_response(400, "'model' is required and must be a string", param="model")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            return error_response(400, "'stream' must be a boolean", param="stream")
        pool = self.pools.get(model)
        adapter: str | None = None
        if pool is None and model in self.adapter_parent:
            adapter, pool = model, self.pools.get(self.adapter_parent[model])
        if pool is None:
            served = ", ".join(sorted(self.pools)) or "(none)"
            adapters = ", ".join(f"{a} ({m})" for a, m in sorted(self.adapter_parent.items()))
            if adapters:
                served += f"; LoRA adapters: {adapters}"
            return error_response(
                404,
                f"model {model!r} is not served here; served models: {served}",
                code="model_not_found",
                param="model",
            )
        try:
            priority = priority_class(request.headers.get(self.settings.priority_header))
        except ValueError as e:
            return error_response(400, f"header {self.settings.priority_header}: {e}")
        ttl = request.headers.get(QUEUE_TIMEOUT_HEADER)
        try:
            queue_timeout = None if ttl is None else float(ttl)
        except ValueError:
            queue_timeout = -1.0
        if queue_timeout is not None and not 0 < queue_timeout < float("inf"):
            return error_response(400, f"header {QUEUE_TIMEOUT_HEADER}: must be seconds > 0, got {ttl!r}")
        key = request_key(
            body, chat, request.headers.get(self.settings.session_header), self.settings.block_chars
        )
        if adapter is not None:
            key = replace(key, adapter=adapter)
            model = pool.model  # counted under the adapter's model
        call = Call(request, model, chat, body, raw, key, priority, len(prompt_text(body, chat)))
        call.tenant, call.queue_timeout_s = self._tenant(request), queue_timeout
        if not self.settings.migrate_streams:
            call.unmigratable = "stream migration is off (--stream-migration off)"
        options = body.get("stream_options")
        if call.stream and not call.keep_usage and isinstance(options, dict | None):
            # exact token counts for the SLO: the pod reports usage at the stream's end, the router
            # keeps that chunk to itself (the client did not ask for it)
            body = {**body, "stream_options": {**(options or {}), "include_usage": True}}
            call.body, call.raw = body, json.dumps(body).encode()
        try:
            response = await self._route(call, pool)
        except asyncio.CancelledError:
            # The client left. A stream whose status line had gone out was answered: count it (a
            # client that stops reading after `data: [DONE]` leaves before the pod's stream ends).
            status = self.upstream.sent_status.get(id(request))
            if status is not None:
                self.metrics.requests.labels(model, str(status)).inc()
            self.slo.judge(call, status)
            raise
        finally:
            self.upstream.sent_status.pop(id(request), None)
        self.metrics.requests.labels(model, str(response.status)).inc()
        self.slo.judge(call, response.status)
        return response

    def _tenant(self, request: web.Request) -> str:
        """The request's tenant for fair queueing: a hash of the tenant header's value (an API key
        is not kept), "" without fairness or without the header."""
        name = self.settings.tenant_header
        value = request.headers.get(name, "") if name else ""
        return f"{stable_hash(value.encode('utf-8', 'replace')):016x}" if value else ""

    def _reject(
        self, call: Call, status: int, message: str, reason: str, type_: str, retry_after: bool = False
    ) -> web.Response:
        """An answer the router gives itself, naming its reason in a header and the error's code."""
        self.metrics.rejections.labels(call.model, reason).inc()
        headers = {REJECT_HEADER: reason}
        if retry_after:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return error_response(status, message, type_, code=reason, headers=headers)

    async def _route(self, call: Call, pool: ModelPool) -> web.StreamResponse:
        tried: set[str] = set()
        raw: bytes | None = None  # what the pods get: the client's body, or the decode leg's
        pd = self._pd_of.get(pool.model)
        while True:
            # what it will need while held (kvpilot_router_pd_queued): the decode leg's retry, direct
            tag = held_path(call.body, call.chat, pd, prefilled=raw is not None) if pd is not None else ""
            try:
                pod = await pool.acquire(
                    call.key, frozenset(tried), call.priority, call.tenant, call.queue_timeout_s, tag
                )
            except Overloaded as e:
                self.metrics.queue_time.labels(pool.model).observe(time.monotonic() - call.started)
                spilled = await self._spill(call, pool)
                if spilled is not None:
                    return spilled
                status = 503 if e.code == "no_endpoints" else 429
                kind = "service_unavailable" if status == 503 else "rate_limit_error"
                return self._reject(call, status, str(e), e.code, kind, retry_after=True)
            if not tried:
                self.metrics.queue_time.labels(pool.model).observe(time.monotonic() - call.started)
            slot = Slot(pool, pod, call.key)
            try:
                if raw is None:  # admitted: a disaggregated model's prompt runs on a prefill pod now
                    raw = await self._disaggregate(call, pool.model)
                return await self.upstream.forward(call, slot, raw)
            except Retry as e:
                tried.add(pod.name)
                if len(tried) > self.settings.max_retries or not pool.routable(frozenset(tried)):
                    if e.answer is not None:
                        return e.answer
                    if e.timeout:
                        message = f"no pod of model {pool.model!r} answered in time: {e}"
                        return self._reject(call, 504, message, "upstream_timeout", "upstream_error")
                    message = f"no pod of model {pool.model!r} could take the request: {e}"
                    return self._reject(call, 502, message, "upstream_failed", "upstream_error")
                self.metrics.retries.labels(pool.model).inc()
                log.info("retrying %s on another pod after %s failed: %s", pool.model, pod.name, e)
            finally:
                slot.release()

    async def _disaggregate(self, call: Call, model: str) -> bytes:
        """The body for the request's decode pod: with the transfer params of its prefill leg when
        the model is disaggregated and the request takes the two legs (pd.plan), else the client's
        (counted: kvpilot_router_pd_requests_total)."""
        pd, prefill_pool = self._pd_of.get(model), self.prefill_pools.get(model)
        if pd is None or prefill_pool is None:
            return call.raw
        plan = pd_plan(call.body, call.chat, pd, len(prefill_pool.routable()))
        params = None
        if plan.path == "disaggregated":
            params = await self.prefill.run(call, prefill_pool, pd, plan.prompt_tokens)
        path = plan.path if params is not None or plan.path != "disaggregated" else "prefill_failed"
        self.metrics.pd_requests.labels(model, path).inc()
        if params is None:
            return call.raw
        return json.dumps(decode_body(call.body, params)).encode()

    async def _spill(self, call: Call, pool: ModelPool) -> web.StreamResponse | None:
        """Serve an overloaded model's request on its fallback model when a pod there has room now
        (no queueing there, no retries); None when there is no fallback or it has no room either."""
        name = self._fallback_of.get(pool.model)
        # an adapter lives only on its own model's pods: the fallback model cannot serve it
        target = self.pools.get(name) if name and call.key.adapter is None else None
        if target is None:
            return None
        pod = target.try_acquire(call.key)
        if pod is None:
            return None
        self.metrics.fallbacks.labels(pool.model, target.model).inc()
        body = {**call.body, "model": target.model}  # the fallback's pods serve their own name
        slot = Slot(target, pod, call.key)
        try:
            return await self.upstream.forward(call, slot, json.dumps(body).encode(), fallback=target.model)
        except Retry as e:
            status, reason = (504, "upstream_timeout") if e.timeout else (502, "upstream_failed")
            message = f"fallback model {target.model!r} failed too: {e}"
            return self._reject(call, status, message, reason, "upstream_error")
        finally:
            slot.release()
