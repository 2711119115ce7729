"""A grammar worker: a child process that vets a spec by compiling it under hard limits.

Why a process: xgrammar's compile is C++ that no Python thread can interrupt, and on hostile input
it runs for minutes (a schema of 10,000 optional properties: > 5 min, 13 GB), or crashes (a JSON
schema `pattern` of 30,000 nested groups: a segmentation fault). Only a process can be killed on a
deadline, capped in memory (RLIMIT_AS) and allowed to crash. Cheap size checks alone cannot bound
it: 2,000 optional integer properties (60 KB) take 20 s where 500 take 0.3 s. (That `pattern` now
fails the metaschema check first, in the worker too; the next crash we do not know of yet is as
contained.)

Why the server compiles again after a worker said yes: a compiled grammar cannot come back cheaply
(xgrammar's serialized form of a 500-property schema is 84 MB and takes 6 s to write), and the
matcher must live in the server. The worker's compile is the same code on the same input, so the
server compiles only what is proven to finish within the limits; xgrammar releases the GIL while
it compiles, so neither the event loop nor the engine loop waits on it.

The worker checks a JSON schema against the JSON Schema metaschema (pure Python, 1.4 s for a
240 KB schema: in the server it would hold the GIL that the event loop and the engine loop need),
then, on the grammar xgrammar builds (`vet`):
- xgrammar's warnings: each one is a constraint it drops (a `$ref` it cannot resolve, `minLength`
  next to `pattern`, a `^` inside a regex, overlapping `oneOf` branches...). Dropping one would
  give output that may not follow the request, so a warning is a refusal naming it;
- a rule that can never end (grammar_analysis.py), and a grammar that allows no first token.

Processes come from multiprocessing's forkserver, which imports xgrammar once (2 s, 800 MB of
mostly shared pages): a worker that is killed is replaced in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import re
import resource
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import IO, Any

from kvpilot.runtime.grammar.structured_output import (
    GuidedKind,
    GuidedSpec,
    GuidedSpecError,
    dead_end_problem,
    first_token_problem,
    grammar_of,
    validate_schema,
)

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # a worker's start (the forkserver's first import of xgrammar included)
_WARNING = re.compile(r"Warning: (.*)")
_MEMORY = "memory"  # a job's answer when the compile ran out of its memory limit
_PR_SET_PDEATHSIG = 1
_EXIT_NO_ANSWER = 70  # EX_SOFTWARE: the vet thread ended a job without an answer
_EXIT_OUT_OF_MEMORY = 71  # the compile ran out of the worker's memory limit (EX_OSERR)


@dataclass(frozen=True)
class Verdict:
    """What a worker found: nothing (the spec compiled within the limits and passed the checks),
    or `problem` (a check's message), `timed_out`, `out_of_memory` or `crashed`."""

    problem: str | None
    seconds: float
    timed_out: bool = False
    out_of_memory: bool = False
    crashed: str | None = None  # how the process ended ("signal 11", "exit code 127")


# ------------------------------------------------------------------------------------------------
# The child


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _limit_memory(extra_bytes: int) -> None:
    """RLIMIT_AS at what the process maps now plus `extra_bytes`: the compile may grow by that much
    (the baseline, torch's and xgrammar's libraries mapped by the import, is not the compile's)."""
    soft = _vm_size_bytes() + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _stderr_to(sink: IO[bytes]) -> Iterator[None]:
    """Point file descriptor 2 (where xgrammar's C++ logs) at `sink` for the duration."""
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def warnings_in(log_text: str) -> list[str]:
    """xgrammar's warning messages in its log output."""
    return [m.group(1).strip() for m in _WARNING.finditer(log_text)]


def vet(compiler: Any, spec: GuidedSpec, vocab_size: int) -> str | None:
    """Build and compile `spec` as the server will; the reason to refuse it, or None."""
    validate_schema(spec)  # raises GuidedSpecError
    with tempfile.TemporaryFile() as sink:
        with _stderr_to(sink):
            grammar = grammar_of(spec)
            compiled = compiler.compile_grammar(grammar)
        sink.seek(0)
        dropped = warnings_in(sink.read().decode("utf-8", "replace"))
    if dropped:
        return f"a constraint in it cannot be enforced (the grammar engine would ignore it): {dropped[0]}"
    return dead_end_problem(grammar) or first_token_problem(compiled, vocab_size)


def _answer(compiler: Any, job: tuple[GuidedKind, str, str], vocab_size: int) -> str | None:
    try:
        return vet(compiler, GuidedSpec(*job), vocab_size)
    except GuidedSpecError as e:  # (xgrammar's parser reports an allocation failure as its error)
        return _MEMORY if "bad_alloc" in e.problem else e.problem
    except MemoryError:
        return _MEMORY
    except RuntimeError as e:  # xgrammar's C++ exceptions
        return _MEMORY if "bad_alloc" in str(e) else f"the grammar engine refused it: {e}"


_NO_ANSWER = "no answer"  # the vet thread ended a job without storing an answer


class VetThread:
    """The worker's one vet thread: `answer(fn)` runs `fn()` on it (the server compiles on a thread
    too: the same stack size for the same input), with a MemoryError anywhere in it answered as
    `_MEMORY` and any other exception as `_NO_ANSWER`.

    Started once, before the memory limit, and reused for every job: at the limit, whatever
    allocates can raise MemoryError, and a thread's own machinery allocates. Under CI a compile
    over the limit was twice reported as one over the time limit: first a ThreadPoolExecutor's
    bookkeeping raised while setting the future's exception (its thread died, the future never
    resolved); then a thread started per job raised in its start-up ("Exception ignored in thread
    started by"), before it signalled that it had started, so `Thread.start` waited forever. Here
    the thread exists before the limit, it hands its answer over through slots and locks made
    before the limit (storing and releasing allocate nothing), and the waiting side notices a
    thread that died."""

    def __init__(self) -> None:
        self._job: list[Callable[[], str | None] | None] = [None]
        self._answer: list[str | None] = [_NO_ANSWER]
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._thread = threading.Thread(target=self._loop, name="kvpilot-grammar-vet", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        go, done, job, answer = self._go.acquire, self._done.release, self._job, self._answer
        while True:
            go()
            try:
                fn = job[0]
                answer[0] = fn() if fn is not None else _NO_ANSWER
            except MemoryError:
                answer[0] = _MEMORY
            except BaseException:  # a bug: the worker exits and the server reports a crash
                answer[0] = _NO_ANSWER
                with contextlib.suppress(BaseException):  # the answer is stored: nothing else to do
                    log.exception("grammar vet failed")
            done()

    def answer(self, fn: Callable[[], str | None]) -> str | None:
        self._job[0], self._answer[0] = fn, _NO_ANSWER
        self._go.release()
        while not self._done.acquire(True, 1.0):
            if not self._thread.is_alive():
                return _NO_ANSWER
        self._job[0] = None
        return self._answer[0]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the forkserver, which ends with the server)
    does, so that no compile outlives the server."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_main(conn: Connection, tokenizer_info_json: str, memory_bytes: int) -> None:
    """The worker process: answer (kind, source, param) jobs with (problem, seconds) until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
    _die_with_parent()
    import jsonschema  # noqa: F401 - the metaschema check's, imported before the limit as xgrammar is
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    vetter = VetThread()  # before the limit: starting a thread allocates
    exit_ = os._exit
    _limit_memory(memory_bytes)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        t0 = time.monotonic()
        problem = vetter.answer(functools.partial(_answer, compiler, job, info.vocab_size))
        # the verdicts that may come at the memory limit are exit codes: an exit allocates nothing
        if problem is _MEMORY:  # a process that hit its limit mid-allocation is not reused either
            exit_(_EXIT_OUT_OF_MEMORY)
        if problem is _NO_ANSWER:
            exit_(_EXIT_NO_ANSWER)
        try:
            conn.send((problem, time.monotonic() - t0))
        except MemoryError:
            exit_(_EXIT_OUT_OF_MEMORY)


# ------------------------------------------------------------------------------------------------
# The server's side


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # ignored when the forkserver already runs; a worker then imports xgrammar itself
    ctx.set_forkserver_preload(["xgrammar", "kvpilot.runtime.grammar.worker"])
    return ctx


class GrammarWorker:
    """One worker process and its pipe. `run` blocks (call it from a thread); one job at a time.
    A worker that times out is killed and replaced on its next job."""

    def __init__(self, name: str, tokenizer_info_json: str, memory_bytes: int) -> None:
        self.name = name
        self._info = tokenizer_info_json
        self._memory = memory_bytes
        self._proc: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process if it is not running (blocks until it is ready)."""
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                return
            self._stop()
            ctx = _context()
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(theirs, self._info, self._memory), name=self.name, daemon=True
            )
            proc.start()
            theirs.close()
            if not ours.poll(STARTUP_TIMEOUT_S):
                proc.kill()
                proc.join(5)
                raise RuntimeError(f"grammar worker {self.name} did not start in {STARTUP_TIMEOUT_S:.0f} s")
            ours.recv()
            self._proc, self._conn = proc, ours

    def run(self, spec: GuidedSpec, timeout_s: float) -> Verdict:
        """Vet `spec`: its problem, or None when it compiled within `timeout_s` and the memory limit."""
        self.start()
        assert self._conn is not None
        t0 = time.monotonic()
        try:
            self._conn.send((spec.kind, spec.source, spec.param))
        except OSError:  # died while idle (killed from outside): once more on a fresh one
            self._stop()
            self.start()
            self._conn.send((spec.kind, spec.source, spec.param))
        if not self._conn.poll(timeout_s):
            self._stop()
            return Verdict(None, time.monotonic() - t0, timed_out=True)
        try:
            problem, seconds = self._conn.recv()
        except (EOFError, OSError):  # it ended on this job: out of its memory, or a crash
            code = self._stop()
            if code == _EXIT_OUT_OF_MEMORY:
                return Verdict(None, time.monotonic() - t0, out_of_memory=True)
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return Verdict(None, time.monotonic() - t0, crashed=how)
        return Verdict(problem, float(seconds))

    def _stop(self) -> int | None:
        proc, self._proc = self._proc, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if proc is None:
            return None
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        code: int | None = proc.exitcode
        return code

    def close(self) -> None:
        with self._lock:
            self._stop()
