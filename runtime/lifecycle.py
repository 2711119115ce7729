"""Process lifecycle of `kvpilot serve`: listen first, load the model, serve, drain on SIGTERM.

The HTTP server listens before the model loads, so `/health` answers during a long load (a
liveness probe must not kill a pod that is still reading weights) while `/ready` says 503 until the
engine is attached. SIGTERM (or SIGINT) starts a drain: `/ready` and new requests answer 503,
in-flight requests get up to `shutdown_timeout` seconds, then the rest are aborted and the process
exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvpilot.runtime.config import ConfigError
from kvpilot.runtime.server import OpenAIRequestHandler, OpenAIServer

log = logging.getLogger("kvpilot.serve")

EngineLoader = Callable[[], Any]  # returns an engine (or an awaitable of one); may block


async def serve(
    server: OpenAIServer,
    host: str,
    port: int,
    load_engine: EngineLoader | None = None,
    shutdown_timeout: float = 30.0,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
    on_listening: Callable[[int], None] | None = None,
) -> int:
    """Run until `stop` is set (or SIGTERM/SIGINT); return the process exit code."""
    stop = stop or asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    if install_signals:

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("second %s: aborting in-flight requests now", sig.name)
                hurry.set()
            else:
                log.info("%s received: draining (up to %.0fs)", sig.name, shutdown_timeout)
                stop.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)

    runner = web.AppRunner(server.app, handler_cancellation=True)
    await runner.setup()
    engine: Any = server.engine
    try:
        site = _Site(runner, host, port)
        await site.start()
        bound = site.bound_port()
        shown = "localhost" if host in ("0.0.0.0", "::", "") else host
        log.info(
            "kvpilot serving '%s' at http://%s:%d/v1 (health: /health, ready: /ready)",
            server.settings.model_name,
            shown,
            bound,
        )
        if on_listening is not None:
            on_listening(bound)

        if engine is None and load_engine is not None:
            engine = await _load(load_engine, stop)
            if engine is None:
                return 0 if stop.is_set() else 1
            start = getattr(engine, "start", None)
            if callable(start):
                start()
            server.attach_engine(engine)
            log.info("model loaded; ready")

        await stop.wait()
        drain = asyncio.ensure_future(server.drain(shutdown_timeout))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({drain, hurried}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            drain.cancel()
            await server.drain(0.0)
        hurried.cancel()
        log.info("drained; shutting down")
        return 0
    finally:
        await runner.cleanup()
        if engine is not None:
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                result = shutdown()
                if inspect.isawaitable(result):
                    await result
        if install_signals:
            for sig in signals:
                loop.remove_signal_handler(sig)


async def _load(load_engine: EngineLoader, stop: asyncio.Event) -> Any:
    """Load in a worker thread; give up (returning None) if asked to stop first or loading fails."""
    task = asyncio.ensure_future(asyncio.to_thread(load_engine))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        log.info("stop requested while the model was loading")
        return None
    try:
        engine = task.result()
        if inspect.isawaitable(engine):
            engine = await engine
    except ConfigError:
        raise  # a setting that cannot work: the CLI prints it on one line
    except Exception:
        log.exception("loading the model failed")
        return None
    return engine


class _Site(web.BaseSite):
    """aiohttp's TCPSite, with connections handled by `OpenAIRequestHandler` (OpenAI error bodies for
    requests that are not valid HTTP)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        manager = self._runner.server
        assert manager is not None

        def protocol() -> OpenAIRequestHandler:
            return OpenAIRequestHandler(manager, loop=loop)

        self._listener = self._server = await loop.create_server(
            protocol, self._host, self._port, reuse_address=True
        )

    def bound_port(self) -> int:
        assert self._listener is not None
        for sock in self._listener.sockets:
            return int(sock.getsockname()[1])
        return self._port
