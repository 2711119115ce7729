"""Process lifecycle of `kvpilot serve`: listen first, load the model, serve, drain on SIGTERM.

The HTTP server listens before the model loads, so `/health` answers during a long load (a
liveness probe must not kill a pod that is still reading weights) while `/ready` says 503 until the
engine is attached. SIGTERM (or SIGINT) starts a drain: `/ready` and new requests answer 503,
in-flight requests get up to `shutdown_timeout` seconds, then the rest are aborted and the process
exits 0. A second signal skips the wait.

The exit is bounded: `serve()` gives each step after the drain a deadline, and `kvpilot serve` arms
`arm_exit_deadline` when the stop comes, which ends the process with `os._exit` if it is still
running `shutdown_timeout + EXIT_GRACE_S` seconds later (an engine loop stuck in a native call
cannot be interrupted, and a normal exit would wait for it). The operator's pods get
terminationGracePeriodSeconds = preStop sleep + shutdown timeout + 15 s, so this comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvpilot.runtime.config import EXIT_GRACE_S, ConfigError
from kvpilot.runtime.serving.server import OpenAIRequestHandler, OpenAIServer

log = logging.getLogger("kvpilot.serve")

EngineLoader = Callable[[], Any]  # returns an engine (or an awaitable of one); may block

# EXIT_GRACE_S (runtime/config.py), after the drain's `shutdown_timeout`, covers the drain's wait for
# aborted requests (5 s), closing the HTTP connections (HANDLER_CLOSE_S) and stopping the engine
# thread. A process still running then is stuck.
HANDLER_CLOSE_S = 2.0  # after the drain, handlers still running wait on an engine that is stuck
EXIT_STUCK = 1  # the status of a process ended by the exit deadline


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

    # shutdown_timeout: how long cleanup() lets handlers finish before cancelling them (the drain
    # already waited for the requests)
    runner = web.AppRunner(server.app, handler_cancellation=True, shutdown_timeout=HANDLER_CLOSE_S)
    await runner.setup()
    engine: Any = server.engine
    stopped_at: float | None = None
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
        stopped_at = loop.time()
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
                timeout = 30.0  # an error before any stop
                if stopped_at is not None:
                    # what is left of the exit's budget, and a little more: in `kvpilot serve` the
                    # exit deadline then ends a process whose engine is stuck (stacks in the log)
                    left = stopped_at + shutdown_timeout + EXIT_GRACE_S - loop.time()
                    timeout = max(1.0, left) + 5.0
                result = shutdown(timeout=timeout)
                if inspect.isawaitable(result):
                    await result
        if install_signals:
            for sig in signals:
                loop.remove_signal_handler(sig)


def arm_exit_deadline(seconds: float) -> threading.Timer:
    """End the process with status EXIT_STUCK if it is still running `seconds` from now.

    os._exit, not sys.exit: what keeps the process alive then is a thread that Python cannot
    interrupt (the engine loop in a native call that never returns, a model still loading), and a
    normal exit would join threads and run atexit handlers that wait on it. Before exiting it logs
    why and every thread's Python stack (faulthandler, to stderr), and flushes the log handlers."""

    def expire() -> None:
        alive = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        log.error(
            "still running %.0fs after the stop (--shutdown-timeout + %.0fs): something is stuck "
            "(threads: %s); exiting now with status %d. Stacks follow.",
            seconds,
            EXIT_GRACE_S,
            ", ".join(alive),
            EXIT_STUCK,
        )
        _flush_logs()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _flush_logs()
        os._exit(EXIT_STUCK)

    timer = threading.Timer(seconds, expire)
    timer.name = "kvpilot-exit-deadline"
    timer.daemon = True
    timer.start()
    return timer


async def exit_deadline_on(stop: asyncio.Event, seconds: float) -> None:
    """Arm `arm_exit_deadline(seconds)` when `stop` is set (the process's SIGTERM)."""
    await stop.wait()
    arm_exit_deadline(seconds)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def in_own_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """`fn()` in a new thread that ends with it (its result or exception in the future).

    Not `asyncio.to_thread`: the executor's threads outlive the call, and so would the OpenMP
    thread team that the load's torch operations start in that thread. libgomp counts the threads
    of every live team, and once they outnumber the CPUs it stops spinning at barriers: the engine
    thread's own team then sleeps and wakes at each of the ~250 parallel regions of a decode step
    (measured: 13-15% of 2 cores idle, batch throughput 0.87-0.92x the in-process engine's;
    benchmarks/async_engine_overhead.py). A thread that exits takes its team with it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def _load(load_engine: EngineLoader, stop: asyncio.Event) -> Any:
    """Load in a worker thread; give up (returning None) if asked to stop first or loading fails."""
    task = asyncio.ensure_future(in_own_thread(load_engine, "kvpilot-load"))
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
