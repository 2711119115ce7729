"""The OpenAI-compatible HTTP server (aiohttp) around an `AsyncEngine`: routes, authentication,
request bodies, the JSON and server-sent-event responses, and drain. Everything else lives apart:
api_request.py parses and validates a request into a `GenerationRequest`, output_processor.py runs
it on the engine and yields text deltas, and api_response.py renders bodies and chunks.

The runner cancels a handler when its client goes away; the output processor then aborts every
unfinished choice in the engine.

Lifecycle: `/health` answers as soon as the server listens; `/ready` only once an engine is
attached and while not draining. Both answer 503 while the engine's watchdog finds its loop stuck or
stopped (`engine.health()`, runtime/engine/health.py). `drain()` makes `/ready` and new requests answer 503,
lets in-flight requests finish until the timeout, then aborts what is left.

Nothing here logs prompts, generated text, token ids or keys.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from kvpilot.runtime.engine.kv_transfer.params import RemoteDecode
from kvpilot.runtime.engine.protocol import HEALTHY, Engine, EngineHealth
from kvpilot.runtime.grammar.service import GrammarQueueFullError
from kvpilot.runtime.grammar.structured_output import GuidedSpecError
from kvpilot.runtime.lora import access as lora_access
from kvpilot.runtime.lora.errors import LoRAError
from kvpilot.runtime.lora.names import adapter_name_problem
from kvpilot.runtime.lora.request import path_digest
from kvpilot.runtime.serving.errors import (
    APIError,
    aborted_error,
    grammar_queue_full_error,
    internal_error,
    loading_error,
    shutting_down_error,
)
from kvpilot.runtime.serving.kv_transfer import KVTransferFront
from kvpilot.runtime.serving.metrics import ServerMetrics
from kvpilot.runtime.serving.output_processor import Delta, OutputProcessor, RequestState
from kvpilot.runtime.serving.prepare import GenerationRequest, ServingLimits, prepare_chat, prepare_completion
from kvpilot.runtime.serving.request import parse_json_body
from kvpilot.runtime.serving.response import RENDERERS, now, usage

log = logging.getLogger("kvpilot.server")

# A request body can be at most BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_model_len bytes: a
# generous bound on what a context of max_model_len tokens can need (a token id is <= 8 bytes of
# JSON; a text token is rarely over 16 characters, and \uXXXX escapes take 6 bytes a character).
BODY_BASE_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 128
INLINE_BODY_BYTES = 16_384  # larger bodies are parsed, validated and tokenized in a worker thread
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

Prepare = Callable[[bytes, Any, ServingLimits, str, Collection[str]], GenerationRequest]


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    lora_runtime_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_updates_without_api_key: bool = False  # ... also when api_key is None (runtime/lora/access.py)


def adapter_names(engine: Engine | None) -> list[str]:
    """The LoRA adapters an engine has loaded (engines without LoRA support have none)."""
    return [a.name for a in engine.loras] if engine is not None else []


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_response(err: APIError) -> web.Response:
    headers = dict(err.headers)
    close = headers.pop("Connection", "").lower() == "close"
    resp = web.Response(
        status=err.status, body=_dumps(err.to_dict()), content_type="application/json", headers=headers
    )
    if close:  # also skips reading the rest of an unread (refused) body
        resp.force_close()
    return resp


def body_limit(max_model_len: int) -> int:
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_model_len


def body_too_large(limit: int, max_model_len: int) -> APIError:
    return APIError(
        f"request body is larger than {limit} bytes, the limit for --max-model-len {max_model_len} "
        f"({BODY_BYTES_PER_TOKEN} bytes per token + {BODY_BASE_BYTES} bytes)",
        status=413,
        code="request_too_large",
        headers={"Connection": "close"},
    )


def serving_limits(engine: Engine) -> ServingLimits:
    return ServingLimits(
        engine.max_model_len,
        engine.kv_capacity_tokens,
        engine.max_queue_len,
        engine.tokenizer.vocab_size,
    )


class OpenAIRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering requests that fail to parse as HTTP (bad chunk sizes,
    oversized headers, garbage) with an OpenAI error body and one log line instead of a plain-text
    body and a traceback per request. Every other error takes aiohttp's path."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        reason = " ".join(str(message or exc.message or type(exc).__name__).split())[:200]
        # not HTTP at all (TLS, scanners) is routine on an open port: aiohttp logs it at debug too
        level = logging.DEBUG if isinstance(exc, BadStatusLine) else logging.WARNING
        log.log(level, "malformed HTTP request from %s: %s", request.remote, reason)
        resp = error_response(APIError(f"malformed HTTP request: {reason}", status=status))
        resp.force_close()
        return resp


class OpenAIServer:
    def __init__(
        self, settings: ServerSettings, engine: Engine | None = None, metrics: ServerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics or ServerMetrics(settings.model_name)
        self.engine: Engine | None = None
        self.draining = False
        self.created = int(time.time())
        self._active: dict[str, list[str]] = {}  # HTTP request id -> engine request ids
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task[Any]] = set()
        self.processor = OutputProcessor(self.metrics, self._spawn)
        self.kv = KVTransferFront(self.metrics, settings.api_key, self._spawn)
        self.app = self._build_app()
        if engine is not None:
            self.attach_engine(engine)

    # -- wiring ---------------------------------------------------------------------------------
    def attach_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.processor.attach_tokenizer(engine.tokenizer)
        self.metrics.attach_engine(engine.stats)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready_handler)
        app.router.add_get("/metrics", self.metrics_handler)
        self.kv.add_routes(app, self._require_engine)
        return app

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            if request.path == "/v1" or request.path.startswith("/v1/"):
                self._check_auth(request)
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error_response(
                APIError(f"{e.reason}: {request.method} {request.path}", status=e.status, type=kind)
            )
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("internal error while handling %s %s", request.method, request.path)
            return error_response(internal_error())

    def _check_auth(self, request: web.Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # aiohttp decodes header bytes that are not UTF-8 as lone surrogates: encode them back
        # (surrogateescape) instead of failing, so any byte sequence is just a wrong key
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode()):
            raise APIError(
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _require_engine(self) -> Engine:
        if self.draining:
            raise shutting_down_error()
        if self.engine is None:
            raise loading_error()
        return self.engine

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- simple endpoints -----------------------------------------------------------------------
    def engine_health(self) -> EngineHealth:
        """The engine's own verdict (its loop's watchdog); healthy while none is attached (loading)."""
        return self.engine.health() if self.engine is not None else HEALTHY

    async def health(self, request: web.Request) -> web.Response:
        verdict = self.engine_health()
        return web.json_response(verdict.body(), status=200 if verdict.healthy else 503)

    async def ready_handler(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if self.engine is None:
            return web.json_response({"status": "loading"}, status=503)
        verdict = self.engine_health()
        if not verdict.healthy:
            return web.json_response(verdict.body(), status=503)
        return web.json_response({"status": "ready"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.content_type = "text/plain"
        resp.charset = "utf-8"
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    async def models(self, request: web.Request) -> web.Response:
        card: dict[str, Any] = {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvpilot",
        }
        if self.engine is not None:
            card["max_model_len"] = self.engine.max_model_len
        cards = [card]
        for adapter in self.engine.loras if self.engine is not None else []:
            cards.append(  # no `root`: vLLM shows the adapter's path there; clients learn no server paths
                {
                    **card,
                    "id": adapter.name,
                    "parent": self.settings.model_name,
                    "lora_rank": adapter.rank,
                    "lora_path_sha256": path_digest(adapter.path),
                }
            )
        return web.json_response({"object": "list", "data": cards})

    # -- LoRA adapters at run time (vLLM's endpoints) --------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        engine = self._lora_engine()
        body = await self._lora_body(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        problem = adapter_name_problem(name)
        if problem is not None:
            raise APIError(f"'lora_name': {problem}", param="lora_name")
        if name == self.settings.model_name:
            raise APIError(f"'lora_name' {name!r} is the base model's name", param="lora_name")
        try:
            await engine.add_lora(name, path)
        except LoRAError as e:  # names the adapter and the problem; an unusable path only in the log
            if e.client_message != str(e):
                log.warning("LoRA adapter not loaded through the API: %s", e)
            raise APIError(e.client_message, param="lora_path") from None
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        log.info("LoRA adapter %r loaded through the API", name)
        return web.json_response({"object": "lora_adapter", "id": name, "status": "loaded"})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        engine = self._lora_engine()
        name = (await self._lora_body(request, ("lora_name",)))["lora_name"]
        if name not in adapter_names(engine):
            raise APIError(
                f"LoRA adapter {name!r} is not loaded", status=404, param="lora_name", code="model_not_found"
            )
        try:
            await engine.remove_lora(name)
        except ValueError as e:
            raise APIError(str(e), param="lora_name") from None
        log.info("LoRA adapter %r unloaded through the API", name)
        return web.json_response({"object": "lora_adapter", "id": name, "status": "unloaded"})

    def _lora_engine(self) -> Any:
        s = self.settings
        refused = lora_access.refusal(s.lora_runtime_updates, bool(s.api_key), s.lora_updates_without_api_key)
        if refused is not None:
            status, kind, message = refused
            raise APIError(message, status=status, type=kind)
        engine = self._require_engine()
        if not engine.lora_enabled:
            raise APIError(
                "this server's engine does not serve LoRA adapters", status=404, type="not_found_error"
            )
        return engine

    @staticmethod
    async def _lora_body(request: web.Request, fields: tuple[str, ...]) -> dict[str, str]:
        raw = await request.content.read(65_536 + 1)
        if len(raw) > 65_536:
            raise APIError("request body is larger than 65536 bytes", status=413, code="request_too_large")
        body = parse_json_body(raw)  # the API's one set of body rules (depth, UTF-8, object)
        out: dict[str, str] = {}
        for field in fields:
            value = body.get(field)
            if not isinstance(value, str) or not value.strip() or len(value) > 4096:
                raise APIError(f"'{field}' must be a non-empty string", param=field)
            out[field] = value.strip()
        return out

    # -- generation endpoints -------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, prepare_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, prepare_chat)

    async def _handle(self, request: web.Request, prepare: Prepare) -> web.StreamResponse:
        engine = self._require_engine()
        body = await self._read_body(request, engine)
        adapters = adapter_names(engine)
        args = (body, engine.tokenizer, serving_limits(engine), self.settings.model_name, adapters)
        # large bodies are parsed, validated and tokenized in a worker thread so that the event
        # loop (and /health) keeps answering meanwhile
        gen = await asyncio.to_thread(prepare, *args) if len(body) > INLINE_BODY_BYTES else prepare(*args)
        gen = await self._compile_grammar(engine, gen)
        gen = await self.kv.prepare(engine, gen)  # disaggregation: role checks, the decode side's pull
        return await self._generate(request, self._require_engine(), gen)

    @staticmethod
    async def _compile_grammar(engine: Engine, gen: GenerationRequest) -> GenerationRequest:
        """A constrained request's grammar, compiled before the engine sees the request: a grammar
        that is refused is a 400 for this request alone, and the engine loop never waits on a compile."""
        spec = gen.guided
        if spec is None:
            return gen
        try:
            compiled = await engine.compile_grammar(spec)
        except GuidedSpecError as e:
            raise APIError(str(e), param=e.param) from None
        except GrammarQueueFullError:
            raise grammar_queue_full_error() from None
        return gen.with_compiled_grammar(compiled)

    async def _read_body(self, request: web.Request, engine: Engine) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed what max_model_len can use:
        from Content-Length before reading, else while reading."""
        limit = body_limit(engine.max_model_len)
        if request.content_length is not None and request.content_length > limit:
            raise body_too_large(limit, engine.max_model_len)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit, engine.max_model_len)
                chunks.append(chunk)
        except HttpProcessingError as e:  # a malformed chunked body
            reason = " ".join(str(e.message or type(e).__name__).split())[:200]
            log.warning("malformed request body from %s: %s", request.remote, reason)
            raise APIError(f"malformed request body: {reason}", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    async def _generate(
        self, request: web.Request, engine: Engine, gen: GenerationRequest
    ) -> web.StreamResponse:
        state = self.processor.new_request(engine, gen)
        state.on_kv_fallback = self.kv.observe_engine_fallback
        self._active[gen.request_id] = state.engine_ids
        self._idle.clear()
        try:
            state.submit()
            if gen.stream:
                return await self._stream_response(request, state)
            return await self._full_response(state, f"{request.scheme}://{request.host}")
        finally:
            state.close()
            del self._active[gen.request_id]
            if not self._active:
                self._idle.set()

    # -- response bodies ------------------------------------------------------------------------
    async def _full_response(self, state: RequestState, base_url: str) -> web.Response:
        """`base_url`: this pod as the client reached it (a prefill response's remote_url)."""
        gen = state.gen
        texts = {c.index: [c.echo_text] for c in state.choices}
        async for d in state.deltas():
            texts[d.choice.index].append(d.text)
        if state.aborted:
            raise aborted_error()
        renderer = RENDERERS[gen.kind]
        body = renderer.body(
            gen.request_id,
            gen.lora or self.settings.model_name,
            now(),
            [renderer.choice(c, "".join(texts[c.index])) for c in state.choices],
            usage(state.prompt_tokens, state.completion_tokens),
        )
        if isinstance(gen.kv_transfer, RemoteDecode):
            body["kv_transfer_params"] = self.kv.response_params(
                state.choices[0].kv_transfer_params, base_url
            )
        return web.Response(
            body=_dumps(body), content_type="application/json", headers={"X-Request-Id": gen.request_id}
        )

    async def _stream_response(self, request: web.Request, state: RequestState) -> web.StreamResponse:
        gen = state.gen
        renderer = RENDERERS[gen.kind]
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": gen.request_id})
        await resp.prepare(request)
        created = now()
        name = gen.lora or self.settings.model_name

        def chunk(choices: list[dict[str, Any]], final: bool = False) -> dict[str, Any]:
            body = renderer.chunk(gen.request_id, name, created, choices, None)
            if final or gen.continuous_usage:  # vLLM's continuous_usage_stats: usage so far in every chunk
                body["usage"] = usage(state.prompt_tokens, state.completion_tokens)
            elif not gen.include_usage:
                del body["usage"]
            return body

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + _dumps(obj) + b"\n\n")

        try:
            for c in state.choices:
                opening = renderer.opening_choice(c)
                if opening is not None:
                    await send(chunk([opening]))
            try:
                deltas: AsyncIterator[Delta] = state.deltas()
                async for d in deltas:
                    if d.text or d.finished or d.logprobs or d.tool_calls:
                        await send(chunk([renderer.delta_choice(d)]))
            except APIError as e:
                await send(e.to_dict())
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception:
                log.exception("generation failed mid-stream (%s)", gen.request_id)
                await send(internal_error("internal error during generation").to_dict())
            if gen.include_usage:
                await send(chunk([], final=True))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.info("client disconnected from stream %s", gen.request_id)
        return resp

    # -- lifecycle ------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Refuse new work, let in-flight requests finish for up to `timeout` s, then abort the rest."""
        self.draining = True
        if self._active:
            log.info("draining: waiting up to %.0fs for %d in-flight requests", timeout, len(self._active))
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pending = [eid for ids in self._active.values() for eid in ids]
                log.warning("drain timeout: aborting %d remaining requests", len(self._active))
                if self.engine is not None:
                    for eid in pending:
                        await self.engine.abort(eid)
                try:
                    await asyncio.wait_for(self._idle.wait(), 5.0)
                except TimeoutError:
                    log.warning("%d requests still active after abort", len(self._active))
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
