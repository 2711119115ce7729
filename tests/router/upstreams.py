"""Real aiohttp servers that stand in for pods: canned OpenAI answers and SSE, with faults on demand."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpilot.router.server import Router


def completion_chunk(text: str, model: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def chat_chunk(text: str, model: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}],
    }


@dataclass
class FakePod:
    """One fake pod. `mode`: ok | 503 | 500 | die_mid_stream. `gate`, when set, holds each request until opened."""

    name: str
    mode: str = "ok"
    chunks: int = 4
    gate: asyncio.Event | None = None
    hold_after_first: asyncio.Event | None = None  # streams wait here after their first chunk
    hold_after_done: asyncio.Event | None = None  # streams wait here after [DONE], before they end
    chunk_delay_s: float = 0.0  # a stream's pause between chunks
    headers_delay_s: float = 0.0  # a slow pod: the pause before any answer (its /health stays quick)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    serves: set[str] | None = None  # the model names it answers (None: any); others get the runtime's 404
    # a prefill request (kv_transfer_params.do_remote_decode) is answered with a decode pod's params,
    # as a `--kv-role prefill` runtime does (False: answered without them, as a pod of another role)
    kv_params: bool = True
    active: int = 0
    cancelled: int = 0
    finished: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self.handle),
                web.post("/v1/chat/completions", self.handle),
                web.get("/metrics", self.metrics),
                web.get("/health", self.health),
            ]
        )
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            "# TYPE kvpilot_kv_cache_usage_ratio gauge\n"
            f'kvpilot_kv_cache_usage_ratio{{model_name="m"}} 0.5\n'
            "# TYPE kvpilot_num_requests_waiting gauge\n"
            f'kvpilot_num_requests_waiting{{model_name="m"}} {self.active}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.headers_delay_s:
            await asyncio.sleep(self.headers_delay_s)
        if self.mode == "503":
            return web.json_response({"error": {"message": "draining"}}, status=503)
        if self.mode == "500":
            return web.json_response({"error": {"message": "internal error"}}, status=500)
        if self.serves is not None and body.get("model") not in self.serves:
            error = {"message": f"model {body.get('model')!r} not found", "code": "model_not_found"}
            return web.json_response({"error": error}, status=404)
        chat = request.path.endswith("/chat/completions")
        make = chat_chunk if chat else completion_chunk
        self.active += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if not body.get("stream"):
                text = "".join(f"{self.name}-{i} " for i in range(self.chunks))
                full = make(text, body["model"], "length")
                if chat:
                    full["object"] = "chat.completion"
                    full["choices"][0]["message"] = {"role": "assistant", "content": text}
                    del full["choices"][0]["delta"]
                full["usage"] = {
                    "prompt_tokens": 1,
                    "completion_tokens": self.chunks,
                    "total_tokens": 1 + self.chunks,
                }
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and self.kv_params:
                    full["kv_transfer_params"] = {
                        "do_remote_prefill": True,
                        "transfer_id": f"{self.name}-{len(self.bodies)}",
                        "num_tokens": 1,
                        "block_size": 16,
                        "kv_cache_dtype": "auto",
                        "model_fingerprint": "fake",
                    }
                self.finished += 1
                return web.json_response(full)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                finish = "length" if i == self.chunks - 1 else None
                await resp.write(
                    b"data: "
                    + json.dumps(make(f"{self.name}-{i} ", body["model"], finish)).encode()
                    + b"\n\n"
                )
                if i == 0 and self.hold_after_first is not None:
                    await self.hold_after_first.wait()
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                if i == 1 and self.mode == "die_mid_stream":
                    assert request.transport is not None
                    request.transport.abort()  # the pod dies: the connection drops mid-stream
                    return resp
            options = body.get("stream_options") or {}
            if options.get("include_usage"):  # as the runtime: a last chunk with no choices
                usage = {
                    "prompt_tokens": 3,
                    "completion_tokens": self.chunks,
                    "total_tokens": 3 + self.chunks,
                }
                last = {**make("", body["model"]), "choices": [], "usage": usage}
                await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if self.hold_after_done is not None:
                await self.hold_after_done.wait()
            self.finished += 1
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def start(self, port: int = 0) -> FakePod:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class LiveRouter:
    router: Router
    runner: web.AppRunner
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_router(router: Router) -> LiveRouter:
    runner = web.AppRunner(router.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return LiveRouter(router, runner, port)


def closed_port_url() -> str:
    """A localhost URL where nothing listens (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
