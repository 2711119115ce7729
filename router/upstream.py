"""The router's upstream side: a request sent to a pod and its answer passed back (docs/router.md).

`open` sends it and waits for the response headers; a refused or reset connection, a missed
deadline or a 503 before any byte reached the client raises `Retry` (another pod may take it).
`forward` passes the answer back: a body whole, server-sent events whole events at a time as they
arrive. A stream whose pod dies or goes silent continues on another pod when it can (migrate.py),
else it ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvpilot.api.slo import request_tpot
from kvpilot.request_body import error_body
from kvpilot.router.call import FALLBACK_HEADER, FORWARD_HEADERS, POD_HEADER, UPSTREAM_ERRORS, Call, Retry
from kvpilot.router.deadline import Silent
from kvpilot.router.health import PodHealth
from kvpilot.router.judge import SloBook
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.migrate import continuation, rewrite_event
from kvpilot.router.policy import AdapterAffinity
from kvpilot.router.pool import ModelPool, Overloaded, Pod, Slot
from kvpilot.router.settings import RouterSettings
from kvpilot.router.sse import DONE, encode_event, event_data, split_events

log = logging.getLogger("kvpilot.router")


class Upstream:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        health: PodHealth,
        slo: SloBook,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.health = health
        self.slo = slo
        self._session = session
        self.sent_status: dict[int, int] = {}  # id(request) -> status line a stream has sent

    async def open(self, call: Call, pool: ModelPool, pod: Pod, raw: bytes) -> aiohttp.ClientResponse:
        """Send the request to the pod and wait for its response headers; Retry when it could not
        take it (refused, reset, past a deadline, a 503) and nothing reached the client."""
        request = call.request
        headers = {h: request.headers[h] for h in FORWARD_HEADERS if h in request.headers}
        call.sent_at = time.monotonic()
        try:
            async with self.health.deadline(pod, "first_byte"):
                upstream = await self._session().post(pod.url + request.path, data=raw, headers=headers)
        except UPSTREAM_ERRORS as e:  # refused, reset, or the connect deadline passed
            pool.mark_unhealthy(pod)
            phase = "connect" if isinstance(e, asyncio.TimeoutError) else None
            self.health.failed(pool, pod, f"{type(e).__name__}: {e}", phase)
            raise Retry(f"{pod.name}: {type(e).__name__}: {e}", timeout=phase is not None) from None
        except Silent as e:  # nothing was sent to the client: another pod may take it
            self.health.failed(pool, pod, str(e), e.phase)
            raise Retry(f"{pod.name}: {e}", timeout=True) from None
        pod.answered_at = time.monotonic()
        if upstream.status == 503:  # draining or still loading: another pod, and not this one for now
            upstream.close()
            pool.mark_unhealthy(pod, min(2.0, pool.settings.unhealthy_s))
            self.health.failed(pool, pod, f"answered 503 {upstream.reason}")
            raise Retry(f"{pod.name}: 503 {upstream.reason}")
        return upstream

    async def forward(
        self, call: Call, slot: Slot, raw: bytes, fallback: str | None = None
    ) -> web.StreamResponse:
        """The pod's answer to `call` on the pod `slot` holds (released at a stream's [DONE];
        the caller releases it in any case)."""
        pool, pod = slot.pool, slot.pod
        upstream = await self.open(call, pool, pod, raw)
        adapter = call.key.adapter
        try:
            if upstream.status == 404 and adapter is not None:
                # a pod that does not serve the adapter yet (the pods roll after spec.adapters changed):
                # another pod may; the pod stays healthy for every other request
                if isinstance(pool.policy, AdapterAffinity):
                    pool.policy.lacks(pod.name, adapter)
                with contextlib.suppress(*UPSTREAM_ERRORS, Silent):
                    data = await self.health.read_body(pod, upstream)
                    pool.succeeded(pod)
                    ctype = upstream.headers.get("Content-Type", "application/json")
                    answer = web.Response(
                        status=404, body=data, headers={"Content-Type": ctype, POD_HEADER: pod.name}
                    )
                    raise Retry(f"{pod.name}: does not serve adapter {adapter!r} (404)", answer)
                raise Retry(f"{pod.name}: does not serve adapter {adapter!r} (404)")
            content_type = upstream.headers.get("Content-Type", "application/json")
            out_headers = {"Content-Type": content_type, POD_HEADER: pod.name}
            if fallback is not None:
                out_headers[FALLBACK_HEADER] = fallback
            if "Retry-After" in upstream.headers:
                out_headers["Retry-After"] = upstream.headers["Retry-After"]
            if not content_type.startswith("text/event-stream"):
                data = await self.read_whole(pool, pod, upstream)
                self.health.answered(pool, pod, upstream.status)
                if upstream.status == 200:
                    self._whole_answer(call, pool, pod, data)
                return web.Response(status=upstream.status, body=data, headers=out_headers)
            return await self._stream(call, slot, upstream, out_headers)
        finally:
            upstream.close()  # a stream cut short closes the connection, and the pod aborts the request

    async def read_whole(self, pool: ModelPool, pod: Pod, upstream: aiohttp.ClientResponse) -> bytes:
        """A body answered at once, read whole; Retry when the pod breaks or goes silent before its
        end (nothing reached the client yet)."""
        try:
            return await self.health.read_body(pod, upstream)
        except (*UPSTREAM_ERRORS, Silent) as e:
            if not isinstance(e, Silent):
                pool.mark_unhealthy(pod)
            phase = e.phase if isinstance(e, Silent) else None
            self.health.failed(pool, pod, f"{type(e).__name__}: {e}", phase)
            raise Retry(f"{pod.name}: {type(e).__name__}: {e}", timeout=phase is not None) from None

    def _whole_answer(self, call: Call, pool: ModelPool, pod: Pod, data: bytes) -> None:
        """A body answered at once: its usage for the SLO, and the pod's time per output token."""
        call.answered_at = time.monotonic()
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            usage = json.loads(data).get("usage")
            if isinstance(usage, dict):
                call.tally.usage = usage
        per_token = (call.answered_at - call.sent_at) / max(1, call.tally.output_tokens)
        self.slo.observe(pool, pod, None, per_token)

    async def _stream(
        self,
        call: Call,
        slot: Slot,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        pool, pod = slot.pool, slot.pod
        out = web.StreamResponse(status=upstream.status, headers={**headers, "Cache-Control": "no-cache"})
        await out.prepare(call.request)
        self.sent_status[id(call.request)] = upstream.status
        tally = call.tally
        try:
            failure = await self._pipe(call, slot, upstream, out, continued=False)
            if failure is None:
                self.health.answered(pool, pod, upstream.status)
                if upstream.status == 200 and tally.first_content_s is not None:
                    ttft = tally.first_content_s - call.sent_at
                    tpot = request_tpot(
                        tally.first_content_s, tally.last_content_s or 0.0, tally.output_tokens
                    )
                    self.slo.observe(pool, pod, ttft, tpot)
            tried = [pod.name]
            while failure is not None:
                self._stream_broke(pool, pod, failure)
                upstream.close()
                if tally.finish_reason is not None and not tally.error:  # only [DONE] was missing
                    if not tally.done:
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
        call: Call,
        slot: Slot,
        upstream: aiohttp.ClientResponse,
        out: web.StreamResponse,
        continued: bool,
    ) -> BaseException | None:
        """Pass the pod's stream to the client, whole events at a time, until its end (None) or the
        pod fails (the exception). `continued`: a continuation after a migration, rewritten into the
        client's stream (migrate.rewrite_event). The pod is released when its [DONE] arrives, before
        the client can read it."""
        pod = slot.pod
        tokens_before = call.tally.output_tokens
        buffer = b""
        while True:
            try:
                chunk = await self.health.next_chunk(pod, upstream)
            except (*UPSTREAM_ERRORS, Silent) as e:
                return e
            if not chunk:
                if buffer.strip():
                    await out.write(buffer)  # a last event without its blank line
                return None
            events, buffer = split_events(buffer + chunk)
            payload = [self._outgoing(call, e, continued, tokens_before) for e in events]
            if call.tally.done:
                slot.release()
            data = b"".join(p for p in payload if p)
            if data:
                await out.write(data)

    def _outgoing(self, call: Call, event: bytes, continued: bool, tokens_before: int) -> bytes | None:
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
        self, call: Call, pool: ModelPool, out: web.StreamResponse, tried: list[str]
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
            slot = Slot(pool, pod, call.key)
            try:
                upstream = await self.open(call, pool, pod, raw)
            except Retry:
                slot.release()
                continue
            try:
                if upstream.status != 200:
                    why = f"answered {upstream.status} to a continuation"
                    if upstream.status >= 500:
                        self.health.failed(pool, pod, why)
                        continue
                    log.warning("%s of %s %s; the stream ends", pod.name, pool.model, why)
                    return None
                self.metrics.migrations.labels(pool.model).inc()
                log.info("continuing a stream of %s on %s", pool.model, pod.name)
                failure = await self._pipe(call, slot, upstream, out, continued=True)
                if failure is None:
                    self.health.answered(pool, pod, 200)
                return pod, failure
            finally:
                upstream.close()
                slot.release()
        return None

    def _stream_broke(self, pool: ModelPool, pod: Pod, failure: BaseException) -> None:
        silent = isinstance(failure, Silent)
        if not silent:
            pool.mark_unhealthy(pod)
        self.metrics.stream_failures.labels(pool.model).inc()
        self.health.failed(
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
