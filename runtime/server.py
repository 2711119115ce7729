"""The OpenAI-compatible HTTP server (aiohttp) around an `AsyncEngine`.

Each of a request's choices (n per prompt, for each prompt of a batch) is its own engine request,
`{request_id}-{choice}`, with seed+choice when a seed is given; prefix caching makes the shared
prompt cheap. The server turns engine token streams into text with `TextStream` (detokenization
and stop strings), aborts a choice in the engine when its stop string appears, and aborts every
unfinished choice when the client goes away (the runner cancels the handler on disconnect).

Lifecycle: `/health` answers as soon as the server listens; `/ready` only once an engine is
attached and while not draining. `drain()` makes `/ready` and new requests answer 503, lets
in-flight requests finish until the timeout, then aborts what is left.

Nothing here logs prompts, generated text, token ids or keys.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from kvpilot.runtime import protocol as P
from kvpilot.runtime.detokenizer import TextStream
from kvpilot.runtime.engine import EngineDeadError, QueueFullError
from kvpilot.runtime.metrics import ServerMetrics
from kvpilot.runtime.protocol import APIError
from kvpilot.runtime.sampling_params import SamplingParams

log = logging.getLogger("kvpilot.server")

# A request body can be at most BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_model_len bytes: a
# generous bound on what a context of max_model_len tokens can need (a token id is <= 8 bytes of
# JSON; a text token is rarely over 16 characters, and \uXXXX escapes take 6 bytes a character).
BODY_BASE_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 128
INLINE_BODY_BYTES = 16_384  # larger bodies are parsed, validated and tokenized in a worker thread
RETRY_AFTER_S = 1
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Engine(Protocol):
    """The slice of `kvpilot.runtime.engine.AsyncEngine` the server uses."""

    tokenizer: Any
    max_model_len: int
    max_queue_len: int  # a request with more choices than this could never be admitted
    kv_capacity_tokens: int  # the whole KV pool: the longest sequence that can ever run

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    shutdown_timeout: float = 30.0


@dataclass
class _Choice:
    index: int
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream
    echo_text: str = ""
    want_logprobs: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    engine_done: bool = False  # the engine finished it (no abort needed)
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time_seen: bool = False
    text_offset: int = 0
    logprobs: list[P.LogprobEntry] = field(default_factory=list)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (per tenant)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Prepared:
    """A validated, tokenized request, ready to be submitted to the engine."""

    kind: str  # "completion" or "chat"
    request_id: str
    choices: list[_Choice]
    prompt_lens: list[int]
    stream: bool
    include_usage: bool
    continuous_usage: bool


@dataclass
class _Delta:
    choice: _Choice
    text: str
    logprobs: list[P.LogprobEntry]
    finished: bool


class _OutputMerger:
    """Interleaves the engine streams of several choices; one stream is read directly."""

    def __init__(self, streams: dict[int, AsyncIterator[Any]]) -> None:
        self._streams = streams
        self.open = set(streams)
        self._queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        if len(streams) > 1:
            self._tasks = {i: asyncio.create_task(self._pump(i, s)) for i, s in streams.items()}

    async def _pump(self, index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out, None))
            self._queue.put_nowait((index, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((index, None, e))

    async def next(self) -> tuple[int, Any]:
        """(choice index, RequestOutput), or (index, None) when that stream ended."""
        if not self._tasks:
            (index,) = self.open
            try:
                return index, await anext(self._streams[index])
            except StopAsyncIteration:
                return index, None
        while True:
            index, out, exc = await self._queue.get()
            if index not in self.open:
                continue  # leftovers of a choice we already closed
            if exc is not None:
                raise exc
            return index, out

    async def close(self, index: int) -> None:
        self.open.discard(index)
        task = self._tasks.pop(index, None)
        if task is not None:
            task.cancel()
        else:
            await _aclose(self._streams[index])

    async def close_all(self) -> None:
        for index in list(self.open):
            await self.close(index)
        for task in self._tasks.values():
            task.cancel()


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.debug("closing an engine stream failed", exc_info=True)


def engine_dead_error() -> APIError:
    return APIError(
        "the engine stopped on an internal error; retry on another replica",
        status=503,
        type="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


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
        self._token_text: dict[int, P.TokenText] = {}
        self.app = self._build_app()
        if engine is not None:
            self.attach_engine(engine)

    # -- wiring ---------------------------------------------------------------------------------
    def attach_engine(self, engine: Engine) -> None:
        self.engine = engine
        self._token_text.clear()
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
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready_handler)
        app.router.add_get("/metrics", self.metrics_handler)
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
            return error_response(APIError("internal server error", status=500, type="internal_server_error"))

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
            raise APIError(
                "the server is shutting down; retry on another replica",
                status=503,
                type="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
            )
        if self.engine is None:
            raise APIError(
                "the model is still loading",
                status=503,
                type="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return self.engine

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- simple endpoints -----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if getattr(self.engine, "dead", None) is not None:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def ready_handler(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if self.engine is None:
            return web.json_response({"status": "loading"}, status=503)
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
        return web.json_response({"object": "list", "data": [card]})

    # -- generation endpoints -------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        engine = self._require_engine()
        body = await self._read_body(request, engine)
        return await self._generate(request, await self._prepare(self._prepare_completion, engine, body))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        engine = self._require_engine()
        body = await self._read_body(request, engine)
        return await self._generate(request, await self._prepare(self._prepare_chat, engine, body))

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

    async def _prepare(
        self, prepare: Callable[[Engine, bytes], _Prepared], engine: Engine, body: bytes
    ) -> _Prepared:
        """Parse, validate and tokenize; large bodies in a worker thread so the event loop (and
        /health) keeps answering while they are processed."""
        if len(body) > INLINE_BODY_BYTES:
            return await asyncio.to_thread(prepare, engine, body)
        return prepare(engine, body)

    def _prepare_completion(self, engine: Engine, body: bytes) -> _Prepared:
        req = P.parse_completion_request(body)
        req.check_model(self.settings.model_name)
        prompts = req.prompt_list()
        self._check_admissible(engine, len(prompts) * req.n)
        tok = engine.tokenizer
        vocab = getattr(tok, "vocab_size", None)
        choices: list[_Choice] = []
        prompt_lens: list[int] = []
        request_id = f"cmpl-{uuid.uuid4().hex}"
        for p_idx, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = list(tok.encode(prompt, add_special_tokens=True))
                if not ids:
                    raise APIError("'prompt' encodes to zero tokens", param="prompt")
            else:
                ids = prompt
                P.check_token_ids(ids, vocab, "prompt")
            params = req.to_sampling_params(len(ids), engine.max_model_len, engine.kv_capacity_tokens)
            P.check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
            echo = ""
            if req.echo:
                echo = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
            prompt_lens.append(len(ids))
            for i in range(req.n):
                choices.append(
                    self._new_choice(
                        request_id, p_idx * req.n + i, ids, P.choice_params(params, i), echo, req.cache_salt
                    )
                )
        return _Prepared(
            "completion",
            request_id,
            choices,
            prompt_lens,
            req.stream,
            req.include_usage,
            req.continuous_usage,
        )

    def _prepare_chat(self, engine: Engine, body: bytes) -> _Prepared:
        req = P.parse_chat_request(body)
        req.check_model(self.settings.model_name)
        self._check_admissible(engine, req.n)
        tok = engine.tokenizer
        messages = req.template_messages()
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:
            raise APIError(
                f"'messages' could not be formatted with the chat template: {e}", param="messages"
            ) from None
        # The template already has the special tokens (BOS) it wants.
        ids = list(tok.encode(rendered, add_special_tokens=False))
        params = req.to_sampling_params(len(ids), engine.max_model_len, engine.kv_capacity_tokens)
        P.check_token_ids(params.stop_token_ids, getattr(tok, "vocab_size", None), "stop_token_ids")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [
            self._new_choice(request_id, i, ids, P.choice_params(params, i), "", req.cache_salt)
            for i in range(req.n)
        ]
        return _Prepared(
            "chat", request_id, choices, [len(ids)], req.stream, req.include_usage, req.continuous_usage
        )

    @staticmethod
    def _check_admissible(engine: Engine, num_choices: int) -> None:
        """Each choice waits in the engine's queue; more than --max-queue-len can never be admitted
        (a 429 would be retried forever), so that is the client's error."""
        if num_choices > engine.max_queue_len:
            raise APIError(
                f"the request asks for {num_choices} choices (n x prompts), more than this server's "
                f"--max-queue-len of {engine.max_queue_len}; lower 'n' or split the request",
                param="n",
            )

    def _new_choice(
        self,
        request_id: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        echo: str,
        cache_salt: str | None = None,
    ) -> _Choice:
        assert self.engine is not None
        return _Choice(
            index=index,
            engine_id=f"{request_id}-{index}",
            prompt_token_ids=ids,
            params=params,
            stream=TextStream(self.engine.tokenizer, params, ids),
            echo_text=echo,
            want_logprobs=params.logprobs is not None,
            text_offset=len(echo),
            cache_salt=cache_salt,
        )

    async def _generate(self, request: web.Request, prep: _Prepared) -> web.StreamResponse:
        engine = self._require_engine()
        kind, request_id, choices, prompt_lens = prep.kind, prep.request_id, prep.choices, prep.prompt_lens
        arrival = time.monotonic()
        streams: dict[int, AsyncIterator[Any]] = {}
        self._active[request_id] = [c.engine_id for c in choices]
        self._idle.clear()
        merger: _OutputMerger | None = None
        deltas: AsyncGenerator[_Delta, None] | None = None
        try:
            for c in choices:
                streams[c.index] = self._submit(engine, c)
            self.metrics.prompt_tokens.inc(sum(prompt_lens))
            merger = _OutputMerger(streams)
            deltas = self._deltas(engine, choices, merger, arrival)
            if prep.stream:
                return await self._stream_response(request, prep, deltas)
            return await self._full_response(kind, request_id, choices, prompt_lens, deltas)
        finally:
            for c in choices:
                if c.index in streams and not c.engine_done:
                    self._spawn(engine.abort(c.engine_id))
                    if not c.finished:
                        c.finish_reason = "abort"
                        self.metrics.request_finished("abort")
            if deltas is not None:
                self._spawn(deltas.aclose())
            if merger is not None:
                self._spawn(merger.close_all())
            del self._active[request_id]
            if not self._active:
                self._idle.set()

    def _submit(self, engine: Engine, c: _Choice) -> AsyncIterator[Any]:
        try:
            return engine.add_request(c.engine_id, c.prompt_token_ids, c.params, cache_salt=c.cache_salt)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None
        except QueueFullError:
            raise APIError(
                "the server is overloaded (request queue full); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineDeadError:
            raise engine_dead_error() from None

    async def _deltas(
        self, engine: Engine, choices: list[_Choice], merger: _OutputMerger, arrival: float
    ) -> AsyncGenerator[_Delta, None]:
        by_index = {c.index: c for c in choices}
        while merger.open:
            try:
                index, out = await merger.next()
            except EngineDeadError:
                raise engine_dead_error() from None
            except ValueError as e:  # the engine rejected the request after queueing it
                # (a grammar the engine could not compile names its field: GuidedSpecError.param)
                raise APIError(str(e), param=getattr(e, "param", "prompt")) from None
            c = by_index[index]
            if out is None:  # the stream ended without a finish reason: the engine dropped it
                delta = _Delta(c, c.stream.finish(), [], True)
                self._finish(c, "abort", None, arrival, engine_done=True)
            else:
                delta = self._process(c, out, arrival)
            if c.finished:
                await merger.close(index)
                if not c.engine_done:  # stopped by a stop string: free its engine slot now
                    c.engine_done = True
                    self._spawn(engine.abort(c.engine_id))
            yield delta

    def _process(self, c: _Choice, out: Any, arrival: float) -> _Delta:
        co = out.outputs[0]
        new: list[int] = list(co.new_token_ids)
        now = time.monotonic()
        m = out.metrics
        if not c.queue_time_seen and m is not None and m.first_scheduled_time is not None:
            self.metrics.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            c.queue_time_seen = True
        if new:
            self.metrics.generation_tokens.inc(len(new))
            if c.first_token_time is None:
                c.first_token_time = now
                self.metrics.ttft.observe(now - arrival)
            elif c.last_token_time is not None:
                # Outputs may carry several tokens (the engine coalesces); spread the gap over them.
                per_token = (now - c.last_token_time) / len(new)
                for _ in new:
                    self.metrics.itl.observe(per_token)
            c.last_token_time = now
        text = c.stream.push(new)
        entries = self._logprob_entries(co.logprobs) if c.want_logprobs else []
        if c.stream.stop_str is not None:
            self._finish(c, "stop", c.stream.stop_str, arrival, engine_done=co.finish_reason is not None)
        elif co.finish_reason is not None:
            text += c.stream.finish()
            self._finish(c, co.finish_reason, co.stop_reason, arrival, engine_done=True)
        c.logprobs.extend(entries)
        return _Delta(c, text, entries, c.finished)

    def _finish(
        self, c: _Choice, reason: str, stop_reason: int | str | None, arrival: float, engine_done: bool
    ) -> None:
        c.finish_reason = reason
        c.stop_reason = stop_reason
        c.engine_done = engine_done
        self.metrics.request_finished(reason)
        self.metrics.e2e.observe(time.monotonic() - arrival)

    def _logprob_entries(self, logprobs: Sequence[Any] | None) -> list[P.LogprobEntry]:
        if not logprobs:
            return []
        text = self._text_of
        return [
            (
                text(lp.token_id),
                P.clamp_logprob(lp.logprob),
                [(text(t), P.clamp_logprob(v)) for t, v in lp.top],
            )
            for lp in logprobs
        ]

    def _text_of(self, token_id: int) -> P.TokenText:
        t = self._token_text.get(token_id)
        if t is None:
            assert self.engine is not None
            tok = self.engine.tokenizer
            text = tok.decode([token_id], skip_special_tokens=False)
            token_bytes = getattr(tok, "token_bytes", None)
            raw = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8")
            t = P.TokenText(text, list(raw))
            self._token_text[token_id] = t
        return t

    # -- response bodies ------------------------------------------------------------------------
    async def _full_response(
        self,
        kind: str,
        request_id: str,
        choices: list[_Choice],
        prompt_lens: list[int],
        deltas: AsyncIterator[_Delta],
    ) -> web.Response:
        texts = {c.index: [c.echo_text] for c in choices}
        async for d in deltas:
            texts[d.choice.index].append(d.text)
        if any(c.finish_reason == "abort" for c in choices):
            raise APIError(
                "the request was aborted by the server (shutting down); retry it",
                status=503,
                type="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        usage = P.usage(sum(prompt_lens), sum(c.stream.num_tokens for c in choices))
        created = P.now()
        name = self.settings.model_name
        body: dict[str, Any]
        if kind == "chat":
            body = P.chat_body(
                request_id,
                name,
                created,
                [
                    P.chat_choice(
                        c.index,
                        "".join(texts[c.index]),
                        P.chat_logprobs(c.logprobs) if c.want_logprobs else None,
                        c.finish_reason,
                        c.stop_reason,
                    )
                    for c in choices
                ],
                usage,
            )
        else:
            body = P.completion_body(
                request_id,
                name,
                created,
                [
                    P.completion_choice(
                        c.index,
                        "".join(texts[c.index]),
                        P.completion_logprobs(c.logprobs, len(c.echo_text)) if c.want_logprobs else None,
                        c.finish_reason,
                        c.stop_reason,
                    )
                    for c in choices
                ],
                usage,
            )
        return web.Response(
            body=_dumps(body), content_type="application/json", headers={"X-Request-Id": request_id}
        )

    async def _stream_response(
        self, request: web.Request, prep: _Prepared, deltas: AsyncIterator[_Delta]
    ) -> web.StreamResponse:
        kind, request_id, choices, include_usage = (
            prep.kind,
            prep.request_id,
            prep.choices,
            prep.include_usage,
        )
        prompt_tokens = sum(prep.prompt_lens)
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": request_id})
        await resp.prepare(request)
        created = P.now()
        name = self.settings.model_name

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            if kind == "chat":
                body = P.chat_body(request_id, name, created, [choice], None, chunk=True)
            else:
                body = P.completion_body(request_id, name, created, [choice], None)
            if prep.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                body["usage"] = P.usage(prompt_tokens, sum(c.stream.num_tokens for c in choices))
            elif not include_usage:
                del body["usage"]
            return body

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + _dumps(obj) + b"\n\n")

        try:
            for c in choices:
                if kind == "chat":
                    await send(
                        chunk(P.chat_chunk_choice(c.index, {"role": "assistant", "content": ""}, None, None))
                    )
                elif c.echo_text:
                    await send(chunk(P.completion_choice(c.index, c.echo_text, None, None)))
            try:
                async for d in deltas:
                    if not d.text and not d.finished and not d.logprobs:
                        continue
                    c = d.choice
                    reason = c.finish_reason if d.finished else None
                    stop_reason = c.stop_reason if d.finished else None
                    if kind == "chat":
                        lps = P.chat_logprobs(d.logprobs) if c.want_logprobs and d.logprobs else None
                        delta = {"content": d.text} if d.text or not d.finished else {}
                        await send(chunk(P.chat_chunk_choice(c.index, delta, lps, reason, stop_reason)))
                    else:
                        lps = (
                            P.completion_logprobs(d.logprobs, c.text_offset)
                            if c.want_logprobs and d.logprobs
                            else None
                        )
                        c.text_offset += sum(len(t.text) for t, _, _ in d.logprobs)
                        await send(chunk(P.completion_choice(c.index, d.text, lps, reason, stop_reason)))
            except APIError as e:
                await send(e.to_dict())
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception:
                log.exception("generation failed mid-stream (%s)", request_id)
                await send(
                    APIError(
                        "internal error during generation", status=500, type="internal_server_error"
                    ).to_dict()
                )
            if include_usage:
                usage = P.usage(prompt_tokens, sum(c.stream.num_tokens for c in choices))
                body = chunk({})
                body["choices"] = []
                body["usage"] = usage
                await send(body)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.info("client disconnected from stream %s", request_id)
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
