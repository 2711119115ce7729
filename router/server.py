"""The router's HTTP shell: one OpenAI endpoint that proxies each request to a pod of its model.

Decisions live in `policy` and admission in `pool`; this module reads the request, asks the model's
pool for a pod (queueing when none has room), forwards the body as is, and passes the answer back:
server-sent events chunk by chunk as they arrive, other bodies whole. A refused or reset connection,
a missed connect or first-byte deadline, or a 503 (a draining pod) before any byte reached the client
is retried on another pod; after the first byte nothing is retried, and a pod that dies or goes
silent mid-stream ends the stream with an error event. Each wait on a pod runs under a `PodDeadline`
(deadline.py: past it the pod must answer /health); each exchange's outcome goes to the pool's
outlier detector (outlier.py), which ejects pods that fail in a row.
A client that goes away cancels the handler (handler_cancellation), which closes the upstream
connection, and the pod aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api.slo import SloTargets, request_tpot
from kvpilot.request_body import BodyError, error_body, parse_json_object
from kvpilot.router.deadline import PodDeadline, Silent
from kvpilot.router.keys import BLOCK_CHARS, prompt_text, request_key
from kvpilot.router.measure import QUANTILES, SloMeter, estimate_tokens
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.migrate import continuation, migratable, rewrite_event
from kvpilot.router.outlier import Ejection, OutlierSettings
from kvpilot.router.policy import (
    DEFAULT_POLICY,
    POLICIES,
    AdapterAffinity,
    RouteKey,
    make_policy,
    stable_hash,
)
from kvpilot.router.pool import Endpoint, ModelPool, Overloaded, Pod, QueueSettings, priority_class
from kvpilot.router.sse import DONE, StreamTally, encode_event, event_data, split_events

log = logging.getLogger("kvpilot.router")

RETRY_AFTER_S = 1
SESSION_HEADER = "X-Session-ID"
PRIORITY_HEADER = "X-Kvpilot-Priority"  # high | normal | low: the request's class in the central queue
POD_HEADER = "X-Kvpilot-Pod"
FALLBACK_HEADER = "X-Kvpilot-Fallback"  # set when another model served the request (overload spill-over)
REJECT_HEADER = "X-Kvpilot-Reject-Reason"  # why the router answered a 429/502/503/504 itself
QUEUE_TIMEOUT_HEADER = "X-Kvpilot-Queue-Timeout"  # seconds the client lets it wait (at most its class's)
# Only what the pod needs from the client's request; hop-by-hop headers stay here.
FORWARD_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Request-Id", "OpenAI-Organization")
UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(error_body(message, type_, code, param), status=status, headers=headers)


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error the router answers is an OpenAI error body: aiohttp's own (unknown path, wrong
    method, body over the size limit) and an unexpected exception (500, logged, no traceback sent)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(e.status, f"{e.reason}: {request.method} {request.path}", kind)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("internal error while handling %s %s", request.method, request.path)
        return error_response(500, "internal error in the router", "internal_server_error")


class UpdateEndpoints(Protocol):
    def __call__(
        self,
        model: str,
        endpoints: list[Endpoint] | None,
        policy: str | None = None,
        fallback: str | None = None,
        adapters: Sequence[str] | None = None,
        slo: SloTargets | None = None,
    ) -> None: ...


class EndpointSource(Protocol):
    """Feeds the router the Ready pods of each model it serves (static list, Kubernetes watch...).

    `run` calls `update(model, endpoints, policy, fallback, adapters, slo)` whenever a model's pods (or
    its routing policy, fallback model, LoRA adapter names or SLO targets)
    change (endpoints None: the model is gone), `synced()` once every model is known, and returns only when cancelled. An error while
    watching must not drop the endpoints already known: keep them until the source sees otherwise.
    """

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class RouterSettings:
    policy: str = DEFAULT_POLICY
    policy_options: dict[str, float] = field(default_factory=dict)
    queue: QueueSettings = field(default_factory=QueueSettings)
    max_retries: int = 2  # other pods tried after a refused/reset connection or a 503
    # model -> model that takes its requests instead of a 429 (static mode; spec.routing.fallbackModel)
    fallbacks: dict[str, str] = field(default_factory=dict)
    # model -> its LoRA adapters' names (static mode; spec.adapters with Kubernetes)
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_eps: float = 0.25  # an adapter's holder keeps it while within ceil((1 + eps) x avg load)
    adapter_slots: int = 4  # adapters remembered per pod (the runtime's --max-loras default)
    session_header: str = SESSION_HEADER
    priority_header: str = PRIORITY_HEADER
    tenant_header: str | None = (
        None  # fairness between tenants named by this header (Authorization: API keys)
    )
    block_chars: int = BLOCK_CHARS
    scrape_interval_s: float = 2.0  # pods' /metrics for KV use and waiting counts; 0 turns it off
    # Deadlines of a request to a pod (docs/router.md, "Deadlines and outlier ejection"):
    connect_timeout_s: float = 5.0  # the TCP connection
    first_byte_timeout_s: float = 10.0  # the response headers, from sending the request
    idle_timeout_s: float = 10.0  # between two chunks of the response body
    probe_timeout_s: float = 2.0  # a pod past one of those two deadlines must answer GET /health by then
    silence_limit_s: float = 600.0  # the most a pod that answers its probes may stay silent
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    # The SLO (docs/router.md, "Measured SLO"): targets of models that name none, the window of the
    # attainment and quantile gauges, the weight of a new sample in a pod's latency averages
    slo: SloTargets = field(default_factory=SloTargets)
    slo_window_s: float = 300.0
    latency_alpha: float = 0.2
    migrate_streams: bool = True  # continue a plain stream on another pod when its pod dies


@dataclass
class _Call:
    """One client request on its way through the router, and what it measured."""

    request: web.Request
    model: str  # the name it is counted under
    chat: bool
    body: dict[str, Any]  # as the pods get it
    raw: bytes
    key: RouteKey
    priority: int
    prompt_chars: int
    started: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0  # when it went to the pod that answers
    answered_at: float | None = None  # an answer in one body: when it was read
    tally: StreamTally = field(default_factory=StreamTally)
    tenant: str = ""
    queue_timeout_s: float | None = None  # the client's own time to live in the queue
    unmigratable: str | None = field(init=False)  # why its stream cannot move to another pod (None: it can)
    keep_usage: bool = field(init=False)  # the client asked for usage in its stream

    def __post_init__(self) -> None:
        self.unmigratable = migratable(self.body, self.chat)
        options = self.body.get("stream_options")
        self.keep_usage = isinstance(options, dict) and options.get("include_usage") is True

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


class _Retry(Exception):
    """The pod could not take the request and nothing reached the client: try another pod.

    `answer`: what to send the client when no other pod can take it either (else a 502, or a 504 after
    a missed deadline)."""

    def __init__(self, message: str, answer: web.Response | None = None, timeout: bool = False) -> None:
        super().__init__(message)
        self.answer = answer
        self.timeout = timeout  # the pod missed a deadline: a 504 when no other pod can take it


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
        self.pools: dict[str, ModelPool] = {}
        self._policy_of: dict[str, str] = {}
        self._fallback_of: dict[str, str] = {}
        self._adapters_of: dict[str, tuple[str, ...]] = {}  # model -> its adapters, as declared
        self.adapter_parent: dict[str, str] = {}  # adapter name -> the model that serves it
        self.synced = False
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._sent_status: dict[int, int] = {}  # id(request) -> status line a stream has sent
        self._probes: dict[str, asyncio.Task[bool]] = {}  # pod URL -> its health probe in flight
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
    ) -> None:
        """Set a model's Ready pods, its routing policy (None = the router's default), the model
        that takes its requests instead of a 429 (None = the static --fallback, if any), the names
        of its LoRA adapters (None = the static --adapters, if any) and its SLO targets (None = the
        router's --slo-* flags).

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
        pool = self.pools.get(model)
        is_new = pool is None
        if pool is None or self._policy_of.get(model) != name:
            options = self.settings.policy_options if name == self.settings.policy else {}
            chosen_policy = AdapterAffinity(
                make_policy(name, **options), self.settings.adapter_eps, self.settings.adapter_slots
            )
            new = ModelPool(
                model,
                chosen_policy,
                self.settings.queue,
                self._queue_changed,
                outliers=self.settings.outliers,
            )
            if pool is not None:  # a policy change keeps the queue, the counters and the ejections
                new.pods, new._queue, new.outliers = pool.pods, pool._queue, pool.outliers
            self.pools[model], self._policy_of[model] = new, name
            self.metrics.queue_depth.labels(model).set(new.queue_depth)
            pool = new
        if is_new or self._adapters_of.get(model) != declared:  # a new model may shadow an adapter
            self._adapters_of[model] = declared
            self._index_adapters()
        self.meter.set_targets(model, slo)
        gone = pool.pods.keys() - {e.name for e in endpoints}
        pool.set_endpoints(endpoints)
        for name in gone:
            self.meter.forget_pod(model, name)
            for gauge in (self.metrics.pod_ttft, self.metrics.pod_tpot, self.metrics.pod_errors):
                with contextlib.suppress(KeyError):
                    gauge.remove(model, name)
        self.metrics.ready_pods.labels(model).set(len(pool.pods))

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
        self._policy_of.pop(model, None)
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

    async def _startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
        await self._spawn(self._tick())
        if self.settings.scrape_interval_s > 0:
            await self._spawn(self._scrape_loop())

    async def _cleanup(self, app: web.Application) -> None:
        probes = list(self._probes.values())
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
            for pool in list(self.pools.values()):
                pool.pump()
                self.metrics.in_flight.labels(pool.model).set(pool.in_flight)
                self.metrics.ejected_pods.labels(pool.model).set(pool.ejected_count)

    async def _scrape_loop(self) -> None:
        while True:
            pods = [(pool, pod) for pool in list(self.pools.values()) for pod in list(pool.pods.values())]
            await asyncio.gather(*(self._scrape(pool, pod) for pool, pod in pods))
            await asyncio.sleep(self.settings.scrape_interval_s)

    async def _scrape(self, pool: ModelPool, pod: Pod) -> None:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(0.5, self.settings.scrape_interval_s))
            async with self._session.get(pod.url + "/metrics", timeout=timeout) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (*UPSTREAM_ERRORS, UnicodeDecodeError):
            pod.kv_usage, pod.waiting = None, None  # unknown, not zero
            return
        pod.answered_at = time.monotonic()
        kv, waiting = parse_load(text, pool.model)
        pod.kv_usage, pod.waiting = kv, waiting

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
        for pool in list(self.pools.values()):
            self.metrics.in_flight.labels(pool.model).set(pool.in_flight)
            self.metrics.ejected_pods.labels(pool.model).set(pool.ejected_count)
        self._export_slo(time.monotonic())
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
        call = _Call(request, model, chat, body, raw, key, priority, len(prompt_text(body, chat)))
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
            status = self._sent_status.get(id(request))
            if status is not None:
                self.metrics.requests.labels(model, str(status)).inc()
            self._judge(call, status)
            raise
        finally:
            self._sent_status.pop(id(request), None)
        self.metrics.requests.labels(model, str(response.status)).inc()
        self._judge(call, response.status)
        return response

    def _tenant(self, request: web.Request) -> str:
        """The request's tenant for fair queueing: a hash of the tenant header's value (an API key
        is not kept), "" without fairness or without the header."""
        name = self.settings.tenant_header
        value = request.headers.get(name, "") if name else ""
        return f"{stable_hash(value.encode('utf-8', 'replace')):016x}" if value else ""

    def _reject(
        self, call: _Call, status: int, message: str, reason: str, type_: str, retry_after: bool = False
    ) -> web.Response:
        """An answer the router gives itself, naming its reason in a header and the error's code."""
        self.metrics.rejections.labels(call.model, reason).inc()
        headers = {REJECT_HEADER: reason}
        if retry_after:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return error_response(status, message, type_, code=reason, headers=headers)

    async def _route(self, call: _Call, pool: ModelPool) -> web.StreamResponse:
        tried: set[str] = set()
        while True:
            try:
                pod = await pool.acquire(
                    call.key, frozenset(tried), call.priority, call.tenant, call.queue_timeout_s
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
            try:
                return await self._forward(call, pool, pod, call.raw)
            except _Retry as e:
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
                pool.release(pod, call.key)

    async def _spill(self, call: _Call, pool: ModelPool) -> web.StreamResponse | None:
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
        try:
            return await self._forward(call, target, pod, json.dumps(body).encode(), fallback=target.model)
        except _Retry as e:
            status, reason = (504, "upstream_timeout") if e.timeout else (502, "upstream_failed")
            message = f"fallback model {target.model!r} failed too: {e}"
            return self._reject(call, status, message, reason, "upstream_error")
        finally:
            target.release(pod, call.key)

    async def _open(self, call: _Call, pool: ModelPool, pod: Pod, raw: bytes) -> aiohttp.ClientResponse:
        """Send the request to the pod and wait for its response headers; _Retry when it could not
        take it (refused, reset, past a deadline, a 503) and nothing reached the client."""
        assert self._session is not None
        request = call.request
        headers = {h: request.headers[h] for h in FORWARD_HEADERS if h in request.headers}
        call.sent_at = time.monotonic()
        try:
            async with self._deadline(pod, "first_byte"):
                upstream = await self._session.post(pod.url + request.path, data=raw, headers=headers)
        except UPSTREAM_ERRORS as e:  # refused, reset, or the connect deadline passed
            pool.mark_unhealthy(pod)
            phase = "connect" if isinstance(e, asyncio.TimeoutError) else None
            self._failed(pool, pod, f"{type(e).__name__}: {e}", phase)
            raise _Retry(f"{pod.name}: {type(e).__name__}: {e}", timeout=phase is not None) from None
        except Silent as e:  # nothing was sent to the client: another pod may take it
            self._failed(pool, pod, str(e), e.phase)
            raise _Retry(f"{pod.name}: {e}", timeout=True) from None
        pod.answered_at = time.monotonic()
        if upstream.status == 503:  # draining or still loading: another pod, and not this one for now
            upstream.close()
            pool.mark_unhealthy(pod, min(2.0, pool.settings.unhealthy_s))
            self._failed(pool, pod, f"answered 503 {upstream.reason}")
            raise _Retry(f"{pod.name}: 503 {upstream.reason}")
        return upstream

    async def _forward(
        self, call: _Call, pool: ModelPool, pod: Pod, raw: bytes, fallback: str | None = None
    ) -> web.StreamResponse:
        upstream = await self._open(call, pool, pod, raw)
        adapter = call.key.adapter
        try:
            if upstream.status == 404 and adapter is not None:
                # a pod that does not serve the adapter yet (the pods roll after spec.adapters changed):
                # another pod may; the pod stays healthy for every other request
                if isinstance(pool.policy, AdapterAffinity):
                    pool.policy.lacks(pod.name, adapter)
                with contextlib.suppress(*UPSTREAM_ERRORS, Silent):
                    data = await self._read_body(pod, upstream)
                    pool.succeeded(pod)
                    ctype = upstream.headers.get("Content-Type", "application/json")
                    answer = web.Response(
                        status=404, body=data, headers={"Content-Type": ctype, POD_HEADER: pod.name}
                    )
                    raise _Retry(f"{pod.name}: does not serve adapter {adapter!r} (404)", answer)
                raise _Retry(f"{pod.name}: does not serve adapter {adapter!r} (404)")
            content_type = upstream.headers.get("Content-Type", "application/json")
            out_headers = {"Content-Type": content_type, POD_HEADER: pod.name}
            if fallback is not None:
                out_headers[FALLBACK_HEADER] = fallback
            if "Retry-After" in upstream.headers:
                out_headers["Retry-After"] = upstream.headers["Retry-After"]
            if not content_type.startswith("text/event-stream"):
                try:
                    data = await self._read_body(pod, upstream)
                except (*UPSTREAM_ERRORS, Silent) as e:  # nothing reached the client yet
                    if not isinstance(e, Silent):
                        pool.mark_unhealthy(pod)
                    phase = e.phase if isinstance(e, Silent) else None
                    self._failed(pool, pod, f"{type(e).__name__}: {e}", phase)
                    raise _Retry(f"{pod.name}: {type(e).__name__}: {e}", timeout=phase is not None) from None
                self._answered(pool, pod, upstream.status)
                if upstream.status == 200:
                    self._whole_answer(call, pool, pod, data)
                return web.Response(status=upstream.status, body=data, headers=out_headers)
            return await self._stream(call, pool, pod, upstream, out_headers)
        finally:
            upstream.close()  # a stream cut short closes the connection, and the pod aborts the request

    def _whole_answer(self, call: _Call, pool: ModelPool, pod: Pod, data: bytes) -> None:
        """A body answered at once: its usage for the SLO, and the pod's time per output token."""
        call.answered_at = time.monotonic()
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            usage = json.loads(data).get("usage")
            if isinstance(usage, dict):
                call.tally.usage = usage
        per_token = (call.answered_at - call.sent_at) / max(1, call.tally.output_tokens)
        self._observe(pool, pod, None, per_token)

    async def _read_body(self, pod: Pod, upstream: aiohttp.ClientResponse) -> bytes:
        parts: list[bytes] = []
        while True:
            chunk = await self._next_chunk(pod, upstream)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def _stream(
        self,
        call: _Call,
        pool: ModelPool,
        pod: Pod,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, headers={**headers, "Cache-Control": "no-cache"})
        await out.prepare(call.request)
        self._sent_status[id(call.request)] = upstream.status
        tally = call.tally
        try:
            failure = await self._pipe(call, pod, upstream, out, continued=False)
            if failure is None:
                self._answered(pool, pod, upstream.status)
                if upstream.status == 200 and tally.first_content_s is not None:
                    ttft = tally.first_content_s - call.sent_at
                    tpot = request_tpot(
                        tally.first_content_s, tally.last_content_s or 0.0, tally.output_tokens
                    )
                    self._observe(pool, pod, ttft, tpot)
            tried = [pod.name]
            while failure is not None:
                self._stream_broke(pool, pod, failure)
                upstream.close()
                if tally.finish_reason is not None and not tally.error:  # only [DONE] was missing
                    await out.write(DONE + b"\n\n")
                    failure = None
                    break
                if upstream.status != 200 or call.unmigratable is not None:
                    break
                moved = await self._continue(call, pool, out, tried)
                if moved is None:
                    break
                pod, failure = moved
            if failure is not None:
                tally.error = True
                await self._error_event(out, failure)
        except ConnectionError:  # the client went away (its write failed): not the pod's fault
            return out
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out

    async def _pipe(
        self,
        call: _Call,
        pod: Pod,
        upstream: aiohttp.ClientResponse,
        out: web.StreamResponse,
        continued: bool,
    ) -> BaseException | None:
        """Pass the pod's stream to the client, whole events at a time, until its end (None) or the
        pod fails (the exception). `continued`: a continuation after a migration, rewritten into the
        client's stream (migrate.rewrite_event)."""
        tokens_before = call.tally.output_tokens
        buffer = b""
        while True:
            try:
                chunk = await self._next_chunk(pod, upstream)
            except (*UPSTREAM_ERRORS, Silent) as e:
                return e
            if not chunk:
                if buffer.strip():
                    await out.write(buffer)  # a last event without its blank line
                return None
            events, buffer = split_events(buffer + chunk)
            payload = [self._outgoing(call, e, continued, tokens_before) for e in events]
            data = b"".join(p for p in payload if p)
            if data:
                await out.write(data)

    def _outgoing(self, call: _Call, event: bytes, continued: bool, tokens_before: int) -> bytes | None:
        """What of one whole event of a pod's stream goes to the client (None: nothing), measured."""
        if continued:
            data = event_data(event)
            if isinstance(data, dict):
                tally = call.tally
                rewritten = rewrite_event(data, tally.stream_id, tally.created, tokens_before, True)
                if rewritten is None:
                    return None
                event = encode_event(rewritten)
        data = call.tally.see(event, time.monotonic())
        if not call.keep_usage and isinstance(data, dict) and "usage" in data and not data.get("choices"):
            return None  # the usage chunk the router asked for itself
        return event

    async def _continue(
        self, call: _Call, pool: ModelPool, out: web.StreamResponse, tried: list[str]
    ) -> tuple[Pod, BaseException | None] | None:
        """Continue a broken stream on another pod (migrate.py): the pod that took it and how its
        stream ended (None: to its end), or None when no pod could take it."""
        tally = call.tally
        body = continuation(call.body, call.chat, tally.delivered_text, tally.output_tokens)
        if body is None:
            return None
        raw = json.dumps(body).encode()
        while len(tried) <= self.settings.max_retries:
            try:  # ahead of every queued request: this one's client is waiting mid-answer
                pod = await pool.acquire(call.key, frozenset(tried), priority=0)
            except Overloaded:
                return None
            tried.append(pod.name)
            try:
                upstream = await self._open(call, pool, pod, raw)
            except _Retry:
                pool.release(pod, call.key)
                continue
            try:
                if upstream.status != 200:
                    why = f"answered {upstream.status} to a continuation"
                    if upstream.status >= 500:
                        self._failed(pool, pod, why)
                        continue
                    log.warning("%s of %s %s; the stream ends", pod.name, pool.model, why)
                    return None
                self.metrics.migrations.labels(pool.model).inc()
                log.info("continuing a stream of %s on %s", pool.model, pod.name)
                failure = await self._pipe(call, pod, upstream, out, continued=True)
                if failure is None:
                    self._answered(pool, pod, 200)
                return pod, failure
            finally:
                upstream.close()
                pool.release(pod, call.key)
        return None

    def _stream_broke(self, pool: ModelPool, pod: Pod, failure: BaseException) -> None:
        silent = isinstance(failure, Silent)
        if not silent:
            pool.mark_unhealthy(pod)
        self.metrics.stream_failures.labels(pool.model).inc()
        self._failed(
            pool, pod, f"broke a stream: {type(failure).__name__}: {failure}", "idle" if silent else None
        )

    async def _error_event(self, out: web.StreamResponse, failure: BaseException) -> None:
        if isinstance(failure, Silent):
            message = (
                f"the pod serving this request went silent mid-stream ({failure}); the output is incomplete"
            )
            code = "upstream_timeout"
        else:
            message = f"the pod serving this request failed mid-stream ({type(failure).__name__}); the output is incomplete"
            code = "upstream_disconnected"
        with contextlib.suppress(ConnectionError):
            await out.write(encode_event(error_body(message, "upstream_error", code=code)))

    # -- the SLO ----------------------------------------------------------------------------------

    def _judge(self, call: _Call, status: int | None) -> None:
        """Judge the request against its model's SLO (api/slo.py). An answer in the 4xx other than
        429 is the client's error, not judged; none (the client left before an answer), a 429 or a
        5xx is `failed`; a stream that ended with an error event too."""
        if status is not None and 400 <= status < 500 and status != 429:
            return
        now, tally, model = time.monotonic(), call.tally, call.model
        prompt = tally.prompt_tokens
        if prompt is None:
            prompt = estimate_tokens(call.prompt_chars)
        if status is None or status >= 400:
            outcome = self.meter.record(model, now, None, None, prompt)
        elif not call.stream:
            total = (call.answered_at or now) - call.started
            outcome = self.meter.record_whole(model, now, total, tally.output_tokens, prompt)
        else:
            first = tally.first_content_s
            ttft = None if first is None else first - call.started
            tpot = (
                None
                if first is None
                else request_tpot(first, tally.last_content_s or first, tally.output_tokens)
            )
            if ttft is not None:
                self.metrics.ttft.labels(model).observe(ttft)
            if tpot is not None:
                self.metrics.tpot.labels(model).observe(tpot)
            outcome = self.meter.record(model, now, None if tally.error else ttft, tpot, prompt)
        self.metrics.slo_requests.labels(model, outcome).inc()

    def _observe(self, pool: ModelPool, pod: Pod, ttft_s: float | None, tpot_s: float | None) -> None:
        self.meter.observe_pod(pool.model, pod.name, ttft_s, tpot_s)
        self._sync_latency(pool, pod)

    def _sync_latency(self, pool: ModelPool, pod: Pod) -> None:
        """The pod's latency averages where the routing policies read them (its PodView)."""
        lat = self.meter.pod_latency(pool.model, pod.name)
        if lat is not None:
            pod.ttft_s, pod.tpot_s, pod.error_rate = lat.ttft_s, lat.tpot_s, lat.error_rate

    def _export_slo(self, now: float) -> None:
        """The window gauges and the pods' averages, as of now (at each scrape of /metrics)."""
        m = self.metrics
        for model in self.meter.models():
            w = self.meter.window(model, now)
            m.slo_attainment.labels(model).set(w.attainment)
            m.slo_window_requests.labels(model).set(w.requests)
            for q in QUANTILES:
                m.ttft_window.labels(model, str(q)).set(w.ttft_s[q])
                m.tpot_window.labels(model, str(q)).set(w.tpot_s[q])
        for model, pool in list(self.pools.items()):
            for name, lat in self.meter.pods(model).items():
                if name not in pool.pods:
                    continue
                m.pod_errors.labels(model, name).set(lat.error_rate)
                if lat.ttft_s is not None:
                    m.pod_ttft.labels(model, name).set(lat.ttft_s)
                if lat.tpot_s is not None:
                    m.pod_tpot.labels(model, name).set(lat.tpot_s)

    # -- deadlines, probes, ejection --------------------------------------------------------------

    async def _next_chunk(self, pod: Pod, upstream: aiohttp.ClientResponse) -> bytes:
        """The body's bytes that came since the last call (b"" at its end), within the idle deadline;
        bytes already buffered are taken without arming it."""
        content = upstream.content
        chunk = content.read_nowait()
        if chunk or content.at_eof():
            return chunk
        async with self._deadline(pod, "idle"):
            return await content.readany()

    def _deadline(self, pod: Pod, phase: str) -> PodDeadline:
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
        probe = self._probes.get(pod.url)
        if probe is None:
            probe = asyncio.create_task(self._probe(pod))
            self._probes[pod.url] = probe
            probe.add_done_callback(functools.partial(self._probe_done, pod.url))
        return await asyncio.shield(probe)

    def _probe_done(self, url: str, task: asyncio.Task[bool]) -> None:
        if self._probes.get(url) is task:
            del self._probes[url]

    async def _probe(self, pod: Pod) -> bool:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.probe_timeout_s)
        try:
            async with self._session.get(pod.url + "/health", timeout=timeout) as resp:
                alive = resp.status == 200
        except UPSTREAM_ERRORS:
            return False
        if alive:
            pod.answered_at = time.monotonic()
        return alive

    def _answered(self, pool: ModelPool, pod: Pod, status: int) -> None:
        """The pod's whole answer went through: a 5xx counts as a failure, anything else as a success."""
        if status >= 500:
            self._failed(pool, pod, f"answered {status}")
        else:
            pool.succeeded(pod)

    def _failed(self, pool: ModelPool, pod: Pod, why: str, timeout_phase: str | None = None) -> None:
        if timeout_phase is not None:
            self.metrics.timeouts.labels(pool.model, timeout_phase).inc()
        self.meter.pod_error(pool.model, pod.name)
        self._sync_latency(pool, pod)
        ejection = pool.failed(pod)
        if ejection is not None:
            self._ejected(pool, ejection, why)

    def _ejected(self, pool: ModelPool, ejection: Ejection, why: str) -> None:
        self.metrics.ejections.labels(pool.model, ejection.pod).inc()
        self.metrics.ejected_pods.labels(pool.model).set(pool.ejected_count)
        log.warning(
            "ejected pod %s of %s for %gs (ejection %d) after %d failures in a row; last: %s",
            ejection.pod,
            pool.model,
            ejection.seconds,
            ejection.count,
            ejection.failures,
            why,
        )


def parse_load(text: str, model: str) -> tuple[float | None, int | None]:
    """KV use and waiting count of a pod's /metrics page (kvpilot's or vLLM's names), None if absent."""
    kv_names = ("kvpilot_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    waiting_names = ("kvpilot_num_requests_waiting", "vllm:num_requests_waiting")
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
