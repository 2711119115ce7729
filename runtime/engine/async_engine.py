"""`AsyncEngine`: runs `LLMEngine`'s step loop in a thread beside asyncio and streams each request's
outputs to it, so the HTTP server never blocks on the model. It implements the `Engine` contract
(runtime/engine/protocol.py) that the front end codes against.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvpilot.runtime.engine.core import LLMEngine, lora_activity
from kvpilot.runtime.engine.health import engine_stopped, judge_progress
from kvpilot.runtime.engine.protocol import (
    EngineDeadError,
    EngineHealth,
    EngineStats,
    KVExport,
    KVImport,
    KVTransferPort,
    QueueFullError,
    RequestOutput,
    merge_outputs,
)
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.service import GrammarLimits, GrammarService
from kvpilot.runtime.grammar.structured_output import CompiledGuided, GuidedSpec
from kvpilot.runtime.lora.request import LoadedAdapter

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException]
    lora: str | None = None
    kv: KVExport | KVImport | None = None


@dataclass
class _LoRAOp:
    """An adapter load or unload, run by the engine thread between steps (tensor-parallel workers
    take their part of it through the same pipe as the steps)."""

    name: str
    path: str | None  # None: unload
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class _Inbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    new: list[_Pending] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    lora_ops: list[_LoRAOp] = field(default_factory=list)


class AsyncEngine:
    """Runs `LLMEngine` in a background thread and streams each request's outputs to asyncio.

    Watchdog: the thread records a monotonic heartbeat at every turn of its loop (each step, each
    idle wait of at most 0.5 s); `health()` judges it (runtime/engine/health.py): no progress for
    `stall_timeout` s while there is work means the loop is stuck, and /health and /ready say so."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue_len: int = 1024,
        stall_timeout: float | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.engine = engine
        # compiles requests' grammars before they are submitted (the server awaits compile_grammar)
        self.grammar = GrammarService(lambda: engine.grammar_compiler, grammar_limits)
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_queue_len = max_queue_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.kv_transfer: KVTransferPort | None = engine.kv
        if engine.kv is not None:
            engine.kv.wake = self._wake_soon
        self._inbox = _Inbox()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queues: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._stats = engine.stats()
        self._num_unfinished = 0
        self._num_queued = 0  # waiting in the scheduler plus not yet picked up
        self.dead: BaseException | None = None
        # the watchdog: the heartbeat and the turn flag are written by the engine thread only
        self.stall_timeout = engine.cfg.engine_stall_timeout if stall_timeout is None else stall_timeout
        self._heartbeat = time.monotonic()
        self._in_turn = False  # the loop is doing something other than waiting for work
        self._reported_healthy = True

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # the grammar compiler's vocabulary table takes about a second and the grammar workers
            # start in a few: off both the event loop and the engine loop, before the first
            # guided request needs them
            threading.Thread(target=self.grammar.warm_up, name="kvpilot-grammar-init", daemon=True).start()
            self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, waiting up to `timeout` s for its step to end, and release the
        runner. A thread stuck in a step cannot be interrupted: it is left behind (a daemon thread,
        which the process exit ends; `kvpilot serve` bounds that exit, runtime/serving/lifecycle.py)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                log.error(
                    "the engine thread did not stop within %.0fs (stuck in a step); leaving it behind",
                    timeout,
                )
            self._thread = None
        self.grammar.close()
        self.engine.close()

    def num_unfinished(self) -> int:
        return self._num_unfinished

    def stats(self) -> EngineStats:
        """The engine thread's last snapshot, completed with what it cannot publish while a step
        runs (or is stuck): the running batch, read live (a length: safe from another thread), and
        as waiting every other admitted, unfinished request (the inbox and requests being prepared
        as well as the scheduler's queue); and the watchdog's reading."""
        with self._inbox.lock:
            snapshot, unfinished = self._stats, self._num_unfinished
        running = len(self.engine.scheduler.running)
        try:
            lora = lora_activity(self.engine.scheduler)
        except RuntimeError:  # the engine loop changed the queue while it was copied: the last snapshot
            lora = snapshot.lora
        kv = self.engine.kv
        return dataclasses.replace(
            snapshot,
            lora=lora,
            kv_transfers_pending=None if kv is None else kv.pins.pending,  # read live (it has a lock)
            num_running=running,
            num_waiting=max(0, unfinished - running),
            engine_stalled=int(not self.health().healthy),
            engine_heartbeat_age_seconds=self.heartbeat_age(),
        )

    # -- the watchdog --------------------------------------------------------------------------
    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last made progress (finished a step or an idle wait)."""
        return max(0.0, time.monotonic() - self._heartbeat)

    def has_work(self) -> bool:
        """A turn is under way, or admitted requests are unfinished."""
        return self._in_turn or self._num_unfinished > 0

    def health(self) -> EngineHealth:
        """What /health and /ready report about the engine (runtime/engine/health.py); logs each change."""
        if self.dead is not None:
            return engine_stopped(self.dead)
        verdict = judge_progress(
            self.heartbeat_age(), self.has_work(), self.stall_timeout, self.engine.expected_step_s()
        )
        if verdict.healthy != self._reported_healthy:
            self._reported_healthy = verdict.healthy
            if verdict.healthy:
                log.warning("the engine loop is making progress again")
            else:
                log.error("engine stalled: %s; /health and /ready answer 503", verdict.reason)
        return verdict

    # -- requests ------------------------------------------------------------------------------
    async def compile_grammar(self, spec: GuidedSpec) -> CompiledGuided:
        """Compile a request's constraint before `add_request` (GrammarService.compile); attach the
        result to the spec (`GuidedSpec.with_compiled`) so the engine loop never compiles."""
        return await self.grammar.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora: str | None = None,
        kv: KVExport | KVImport | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Enqueue; raises QueueFullError or EngineDeadError. A request the engine can never run
        (`LLMEngine.validate_request`, an adapter that is not loaded) fails its stream with
        ValueError; the server checks the same limits before it submits (api_request.py), so its
        clients get the 400 up front. `lora`: the adapter to run with (None: the base model). `kv`: the
        request's KV transfer (runtime/engine/kv_transfer/engine_side.py)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if self._num_queued >= self.max_queue_len:
            raise QueueFullError(f"{self._num_queued} requests are already waiting (max_queue_len)")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        pending = _Pending(
            request_id, prompt_token_ids, params, cache_salt, time.monotonic(), queue, lora, kv
        )
        self._queues[request_id] = (loop, queue)
        with self._inbox.lock:
            self._inbox.new.append(pending)
            self._num_queued += 1
            self._num_unfinished += 1
        self._wake.set()
        return self._stream(request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # coalesce what piled up while the consumer was busy
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = merge_outputs(item, nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # consumer went away (client disconnected, stop string hit)
                self.abort_nowait(request_id)

    # -- LoRA adapters -------------------------------------------------------------------------
    @property
    def loras(self) -> list[LoadedAdapter]:
        """The loaded adapters, in load order."""
        return self.engine.adapters.loaded()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.adapters.enabled

    async def add_lora(self, name: str, path: str) -> None:
        """Load (or replace) an adapter between steps; raises LoRAError naming the problem."""
        await self._lora_op(name, path)

    async def remove_lora(self, name: str) -> None:
        await self._lora_op(name, None)

    async def _lora_op(self, name: str, path: str | None) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        op = _LoRAOp(name, path, loop, loop.create_future())
        with self._inbox.lock:
            self._inbox.lora_ops.append(op)
        self._wake.set()
        await op.future

    def _run_lora_ops(self, ops: list[_LoRAOp]) -> None:
        for op in ops:
            error = self.engine.adapters.apply(op.name, op.path)
            with contextlib.suppress(RuntimeError):  # the loop is closed
                op.loop.call_soon_threadsafe(_settle, op.future, error)

    def _wake_soon(self) -> None:
        self._wake.set()

    def abort_nowait(self, request_id: str) -> None:
        with self._inbox.lock:
            self._inbox.aborts.append(request_id)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # -- the engine thread ---------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._inbox.lock:
            new, self._inbox.new = self._inbox.new, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
            lora_ops, self._inbox.lora_ops = self._inbox.lora_ops, []
        self._run_lora_ops(lora_ops)
        for p in new:
            try:
                self.engine.add_request(
                    p.request_id, p.prompt_token_ids, p.params, p.cache_salt, p.arrival_time, p.lora, p.kv
                )
            except ValueError as exc:
                self._deliver(p.request_id, exc)
                with self._inbox.lock:
                    self._num_unfinished -= 1
            finally:
                if isinstance(p.kv, KVImport) and p.kv.on_done is not None:
                    p.kv.on_done()  # the pulled bytes are in the pool (or dropped)
        for rid in aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(rid, out)
                with self._inbox.lock:
                    self._num_unfinished -= 1

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams with one wake-up of each event loop: a wake-up
        per output (~100 a step in a full batch) made the event loop take the GIL from the engine
        thread that many times a step (measured: 5-8% of a 128-request batch's throughput,
        docs/benchmarks.md)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for request_id, item in items:
            entry = self._queues.get(request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, puts in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_put_all, puts)

    def _refresh_counts(self) -> None:
        self._stats = self.engine.stats()
        with self._inbox.lock:
            self._num_queued = len(self.engine.scheduler.waiting) + len(self._inbox.new)

    def _beat(self, in_turn: bool) -> None:
        self._heartbeat = time.monotonic()
        self._in_turn = in_turn

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat(in_turn=True)
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    if self.engine.kv is not None:
                        self.engine.kv.release_due()
                    self._refresh_counts()
                    self._beat(in_turn=False)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._deliver_all([(out.request_id, out) for out in outputs])
                finished = sum(1 for out in outputs if out.finished)
                if finished:
                    with self._inbox.lock:
                        self._num_unfinished -= finished
                self._refresh_counts()
        except BaseException as exc:  # a bug, not a bad request: fail everyone loudly, keep the server up
            log.exception("engine loop died")
            self.dead = exc
            msg = f"the engine stopped: {exc}"  # an exception each: each stream raises its own
            self._deliver_all([(rid, EngineDeadError(msg)) for rid in list(self._queues)])
        finally:
            self._in_turn = False


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(puts: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)
