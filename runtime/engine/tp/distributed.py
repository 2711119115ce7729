"""The tensor-parallel process group on one node: rank 0 in the engine process, ranks 1..N-1 in
worker processes (spawned, so CUDA works in them).

Two channels connect the ranks:
- `torch.distributed` (gloo on CPU, NCCL on GPUs) carries the collectives inside the model: the
  all-reduces of the row-parallel linears and the vocabulary embedding, the logits all-gather;
- one pipe per worker carries control messages: the step's inputs (a few KB of host arrays), the
  KV pool size, shutdown. A worker waits for its next step on the pipe, not in a collective, so an
  idle engine never trips a collective timeout, and a dead rank 0 shows up as end-of-file.

Death is detected, not waited for: gloo fails a collective as soon as a peer's connection drops,
every collective has a timeout (`KVPILOT_TP_TIMEOUT_S`, default 300 s) for a rank that hangs, and
rank 0 checks that every worker is alive before each step and while it waits for a reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpilot.net import free_port

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.2


class TensorParallelError(Exception):
    """A tensor-parallel rank died, failed or hung; the group cannot continue.

    Deliberately not a RuntimeError: the engine must not take it for an out-of-memory error and
    retry a step on a broken group.
    """


@dataclass(frozen=True)
class GroupSpec:
    """How the ranks find each other (picklable: every worker gets a copy)."""

    world_size: int
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    init_method: str  # tcp://127.0.0.1:PORT; rank 0 hosts the store
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def local(cls, world_size: int, device: torch.device) -> GroupSpec:
        timeout = float(os.environ.get("KVPILOT_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        backend = "nccl" if device.type == "cuda" else "gloo"
        return cls(world_size, backend, f"tcp://127.0.0.1:{free_port()}", timeout)


def join_group(spec: GroupSpec, rank: int) -> None:
    """Make this process `rank` of the default process group (blocks until every rank joins)."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; "
            "a process hosts at most one tensor-parallel engine"
        )
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# Control messages: (kind, payload) tuples, pickled once and sent to every worker.


def encode(kind: str, payload: Any = None) -> bytes:
    return pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple[str, Any]:
    kind, payload = pickle.loads(data)
    return str(kind), payload


class Workers:
    """Rank 0's handle on ranks 1..N-1: their processes and control pipes."""

    def __init__(self, spec: GroupSpec, procs: list[BaseProcess], conns: list[Connection]) -> None:
        self.spec = spec
        self.procs = procs
        self.conns = conns
        self.errors: dict[int, str] = {}  # rank -> the traceback it reported
        self.broken: str | None = None  # why the group cannot run another step
        self.closed = False
        # the engine thread sends steps while the KV transfer's threads ask one rank for its blocks
        # (request): one writer per pipe at a time, and one request-reply exchange at a time
        self._send_lock = threading.Lock()
        self._request_lock = threading.Lock()

    @classmethod
    def spawn(
        cls,
        spec: GroupSpec,
        target: Callable[..., None],
        args: Callable[[int], tuple[Any, ...]],
        env: dict[str, str] | None = None,
    ) -> Workers:
        """Start `target(rank, conn, *args(rank))` for ranks 1..N-1 in spawned processes, with `env`
        added to their environment (set before the interpreter starts: `import torch` already
        imports tqdm, which reads its settings then)."""
        ctx = mp.get_context("spawn")
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(1, spec.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=target, args=(rank, theirs, *args(rank)), name=f"kvpilot-tp{rank}", daemon=True
            )
            with _environ(env or {}):
                proc.start()
            theirs.close()  # only the worker holds its end: its death reads as EOF / EPIPE here
            procs.append(proc)
            conns.append(ours)
        return cls(spec, procs, conns)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def send(self, kind: str, payload: Any = None) -> None:
        """Send one message to every worker; a dead worker raises TensorParallelError."""
        self.check_alive()
        data = encode(kind, payload)
        for rank in range(1, self.spec.world_size):
            self._send(rank, data)

    def send_to(self, rank: int, kind: str, payload: Any = None) -> None:
        """Send one message to one worker (rank >= 1); a dead worker raises TensorParallelError."""
        self.check_alive()
        self._send(rank, encode(kind, payload))

    def _send(self, rank: int, data: bytes) -> None:
        try:
            with self._send_lock:
                self.conns[rank - 1].send_bytes(data)
        except OSError as exc:  # BrokenPipeError and friends
            raise TensorParallelError(self.describe_failure(f"sending to rank {rank} failed: {exc}")) from exc

    def exchange(self, kind: str, payload: Any, expect: str) -> list[Any]:
        """`send` to every worker, then `gather` their replies, as one exchange (see `request`)."""
        with self._request_lock:
            self.send(kind, payload)
            return [self._receive(rank, expect, None) for rank in range(1, self.spec.world_size)]

    def request(self, rank: int, kind: str, payload: Any, expect: str) -> Any:
        """One message to one worker and its `expect` reply, from any thread. The worker answers
        after the steps sent before it (its pipe is in order); no step waits for a reply, so the
        engine thread's steps go on meanwhile."""
        with self._request_lock:
            self.send_to(rank, kind, payload)
            return self._receive(rank, expect, None)

    def gather(self, expect: str, timeout_s: float | None = None) -> list[Any]:
        """One `expect` reply from each worker, in rank order; errors and deaths raise."""
        with self._request_lock:
            return [self._receive(rank, expect, timeout_s) for rank in range(1, self.spec.world_size)]

    def _receive(self, rank: int, expect: str, timeout_s: float | None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        while not conn.poll(_POLL_S):
            if not proc.is_alive():
                raise TensorParallelError(self.describe_failure(f"rank {rank} exited before its {expect!r}"))
            if deadline is not None and time.monotonic() > deadline:
                raise TensorParallelError(f"rank {rank} sent no {expect!r} within {timeout_s:.0f}s")
        try:
            kind, payload = decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise TensorParallelError(self.describe_failure(f"rank {rank} closed its pipe")) from exc
        if kind == "error":
            self._record_error(rank, str(payload))
            raise TensorParallelError(self.describe_failure(f"rank {rank} failed"))
        if kind != expect:
            raise TensorParallelError(f"rank {rank} sent {kind!r}, expected {expect!r}")
        return payload

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Rank 0's part of a collective step. A failure inside leaves the ranks out of step, so it
        breaks the group for good: it and every later step raise TensorParallelError."""
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        try:
            yield
        except TensorParallelError as exc:
            self.broken = str(exc)
            raise
        except Exception as exc:
            self.broken = self.describe_failure(f"rank 0 saw {type(exc).__name__}: {exc}")
            raise TensorParallelError(self.broken) from exc

    def check_alive(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise TensorParallelError(self.describe_failure(f"rank {rank} is not running"))

    def describe_failure(self, seen: str, wait_s: float = 1.0) -> str:
        """What each failed worker reported (or its exit code), then what rank 0 `seen`."""
        deadline = time.monotonic() + wait_s
        for rank, conn in enumerate(self.conns, start=1):
            # a failing worker reports its traceback, then exits; give it a moment to do so
            with contextlib.suppress(EOFError, OSError):
                while rank not in self.errors and conn.poll(max(0.0, deadline - time.monotonic())):
                    kind, payload = decode(conn.recv_bytes())
                    if kind == "error":
                        self._record_error(rank, str(payload))
        for proc in self.procs:  # a worker that is going down: wait for its exit code
            proc.join(max(0.0, deadline - time.monotonic()))
        parts = []
        for rank, proc in enumerate(self.procs, start=1):
            if rank in self.errors:
                last = self.errors[rank].strip().splitlines()[-1:] or ["?"]
                parts.append(f"rank {rank} (pid {proc.pid}) raised {last[0]}")
            elif proc.exitcode is not None:
                parts.append(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
        return f"tensor-parallel group broken: {'; '.join([*parts, seen])}"

    def _record_error(self, rank: int, text: str) -> None:
        if rank not in self.errors:
            log.error("tensor-parallel rank %d failed:\n%s", rank, text.rstrip())
        self.errors[rank] = text

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop, then make sure it has (terminate, kill); idempotent."""
        if self.closed:
            return
        self.closed = True
        data = encode("shutdown")
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(data)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                log.warning("tensor-parallel worker %s did not stop; terminating it", proc.name)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()
