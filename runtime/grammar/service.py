"""Compiling a request's grammar before the engine sees it: bounded in time, memory, size and
concurrency, and cached.

The server awaits `GrammarService.compile(spec)` after a request is parsed and before it is
submitted (server.py), so a grammar that is refused is a 400 for that request alone and nothing of
it reaches the engine; while one compiles, the engine keeps stepping every other request.

A compile:
1. the spec's size against `max_bytes` (400 at once: no worker is spent on it);
2. the cache, keyed by (tokenizer fingerprint, kind, sha256 of the source): a compiled grammar,
   or the reason it was refused (with the request's own field name in the 400);
3. a slot among `workers` (requests for a spec already compiling wait for that compile; beyond
   `queue` distinct specs waiting, 429 `grammar_queue_full`);
4. a grammar worker process vets it under `timeout_s` and `memory_bytes` (grammar_worker.py);
5. the server's own compile of the vetted spec, on a thread (xgrammar releases the GIL).
Refusals are cached: deterministic ones (a bad regex, a dropped constraint, a dead rule) until
evicted, time, memory and crash verdicts for `RETRY_AFTER_S` (machine load may have caused them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.runtime.grammar.structured_output import (
    CompiledGuided,
    GrammarCompiler,
    GuidedSpec,
    GuidedSpecError,
)
from kvpilot.runtime.grammar.worker import GrammarWorker, Verdict

if TYPE_CHECKING:
    from kvpilot.runtime.config import EngineConfig

log = logging.getLogger(__name__)

CACHE_ENTRIES = 256
CACHE_BYTES = 512 * 2**20  # compiled grammars' own memory (xgrammar's memory_size_bytes)
RETRY_AFTER_S = 300.0  # how long a time/memory/crash refusal is remembered


class GrammarQueueFullError(Exception):
    """More distinct grammars are waiting to compile than the queue holds; the server answers 429."""


@dataclass(frozen=True)
class GrammarLimits:
    """--grammar-compile-timeout, --grammar-compile-memory, --grammar-compile-workers,
    --grammar-compile-queue, --grammar-max-bytes (docs/runtime.md, "Structured output")."""

    timeout_s: float = 10.0
    memory_bytes: int = 2 * 2**30
    workers: int = 2
    queue: int = 64
    max_bytes: int = 256 * 2**10

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> GrammarLimits:
        return cls(
            cfg.grammar_compile_timeout,
            cfg.grammar_compile_memory,
            cfg.grammar_compile_workers,
            cfg.grammar_compile_queue,
            cfg.grammar_max_bytes,
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n < 2**30 else f"{n / 2**30:g} GiB"


def size_problem(spec: GuidedSpec, limits: GrammarLimits) -> str | None:
    size = len(spec.source.encode("utf-8"))
    if size <= limits.max_bytes:
        return None
    return (
        f"the constraint is {size} bytes, more than this server's limit of {limits.max_bytes} bytes "
        "(--grammar-max-bytes)"
    )


def verdict_problem(verdict: Verdict, limits: GrammarLimits) -> str | None:
    """The 400's message for a worker's verdict (None: it passed)."""
    if verdict.timed_out:
        return (
            f"compiling it took longer than {limits.timeout_s:g} s, this server's limit "
            "(--grammar-compile-timeout); simplify it (fewer optional properties, enum values or choices)"
        )
    if verdict.out_of_memory:
        return (
            f"compiling it needed more than {_mib(limits.memory_bytes)} of memory, this server's limit "
            "(--grammar-compile-memory); simplify it"
        )
    if verdict.crashed:
        return (
            f"the grammar compiler crashed on it ({verdict.crashed}): it nests too deeply, or it needed "
            f"more than {_mib(limits.memory_bytes)} of memory (--grammar-compile-memory); simplify it"
        )
    return verdict.problem


@dataclass
class _Refusal:
    problem: str
    expires: float | None  # monotonic time; None: until evicted


_Key = tuple[str, str, str]


class GrammarService:
    """One per engine (one tokenizer). `compile` is a coroutine of the server's event loop;
    `warm_up` (blocking) builds the tokenizer table and starts the workers ahead of the first
    guided request. `compiler` returns the engine's GrammarCompiler (built on first call)."""

    def __init__(self, compiler: Callable[[], GrammarCompiler], limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self._compiler_of = compiler
        self._workers: list[GrammarWorker] | None = None
        self._idle: list[GrammarWorker] = []
        self._slots = asyncio.Semaphore(self.limits.workers)
        self._executor = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="kvpilot-grammar")
        self._cache: OrderedDict[_Key, CompiledGuided | _Refusal] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[_Key, asyncio.Future[CompiledGuided | str]] = {}
        self.compiles = 0  # vetted by a worker (cache misses), for tests and logs

    # -- lifecycle -------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Build the compiler and start the worker processes (blocking: call it off the loops)."""
        try:
            for w in self._ensure_workers():
                w.start()
        except Exception:  # the first guided request will try again and fail loudly
            log.exception("could not start the grammar workers")

    def _ensure_workers(self) -> list[GrammarWorker]:
        if self._workers is None:
            compiler = self._compiler_of()
            info = compiler.tokenizer_info.serialize_json()
            self._workers = [
                GrammarWorker(f"kvpilot-grammar-{i}", info, self.limits.memory_bytes)
                for i in range(self.limits.workers)
            ]
            self._idle = list(self._workers)
        return self._workers

    def close(self) -> None:
        for w in self._workers or []:
            w.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- compiling -------------------------------------------------------------------------------
    async def compile(self, spec: GuidedSpec) -> CompiledGuided:
        """The compiled grammar for `spec`; raises GuidedSpecError (naming spec.param) when it is
        refused, GrammarQueueFullError when too many grammars wait."""
        problem = size_problem(spec, self.limits)
        if problem is not None:
            raise GuidedSpecError(spec.param, problem)
        # built once (about a second, off the loop); not on self._executor, where compiles may queue
        compiler = await asyncio.to_thread(self._compiler_of)
        key: _Key = (compiler.fingerprint, spec.kind, hashlib.sha256(spec.source.encode()).hexdigest())
        result = self._cached(key)
        if result is None:
            task = self._inflight.get(key)
            if task is None:
                if len(self._inflight) >= self.limits.workers + self.limits.queue:
                    raise GrammarQueueFullError(f"{len(self._inflight)} grammars are waiting to compile")
                task = asyncio.ensure_future(self._compile(key, spec, compiler))
                self._inflight[key] = task
            # shielded: a client that goes away does not cancel a compile others may wait for
            result = await asyncio.shield(task)
        if isinstance(result, str):
            raise GuidedSpecError(spec.param, result)
        return result

    def _cached(self, key: _Key) -> CompiledGuided | str | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        if isinstance(hit, _Refusal):
            if hit.expires is not None and time.monotonic() > hit.expires:
                self._forget(key)
                return None
            self._cache.move_to_end(key)
            return hit.problem
        self._cache.move_to_end(key)
        return hit

    async def _compile(self, key: _Key, spec: GuidedSpec, compiler: GrammarCompiler) -> CompiledGuided | str:
        loop = asyncio.get_running_loop()
        try:
            async with self._slots:
                self._ensure_workers()
                worker = self._idle.pop()
                try:
                    verdict = await loop.run_in_executor(
                        self._executor, worker.run, spec, self.limits.timeout_s
                    )
                finally:
                    self._idle.append(worker)
                self.compiles += 1
                problem = verdict_problem(verdict, self.limits)
                if problem is not None:
                    transient = verdict.timed_out or verdict.out_of_memory or verdict.crashed is not None
                    if transient:
                        log.info("refused a %s grammar: %s", spec.kind, problem.split(";")[0])
                    self._remember(
                        key, _Refusal(problem, time.monotonic() + RETRY_AFTER_S if transient else None)
                    )
                    return problem
                try:
                    compiled = await loop.run_in_executor(self._executor, compiler.build, spec)
                except GuidedSpecError as e:  # not expected after the worker compiled it
                    self._remember(key, _Refusal(e.problem, None))
                    return e.problem
                self._remember(key, compiled)
                return compiled
        finally:
            self._inflight.pop(key, None)

    def _remember(self, key: _Key, value: CompiledGuided | _Refusal) -> None:
        self._forget(key)
        self._cache[key] = value
        self._cache_bytes += _size(value)
        while len(self._cache) > CACHE_ENTRIES or (self._cache_bytes > CACHE_BYTES and len(self._cache) > 1):
            self._forget(next(iter(self._cache)))

    def _forget(self, key: _Key) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= _size(old)


def _size(value: CompiledGuided | _Refusal) -> int:
    return len(value.problem) if isinstance(value, _Refusal) else value.memory_bytes
