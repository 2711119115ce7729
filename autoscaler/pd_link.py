"""A decode replica's KV link in the P/D fleet simulator (pd_simulator.py): the pulls it runs, as the
runtime runs them (runtime/serving/kv_transfer.py).

The runtime pulls a request's KV blocks off the engine loop, in the request's own handler, before the
engine sees the request: every request handed to a decode pod pulls at once, concurrently with the
others, each as one HTTP stream over the pod's one NIC. The streams share the link, so concurrency does
not raise its throughput: the link is a processor-sharing server (n pulls in flight move at
bandwidth / n each). A pull first takes its bytes from the pod's pull budget (client.ByteBudget: a KV
pool's worth of pulled blocks held at once; waiting for it counts in the pull's time) and gives up at
the transfer deadline (spec.disaggregation.transferTimeoutSeconds, counted from the pull's start):
the decode pod then recomputes the prompt (the fallback). A pull larger than the whole budget is
refused at once (`too_large`), also a fallback.

Counters, as the runtime's (api/pod_metrics.py): kvpilot_kv_transfer_seconds (sum and count of the
pulls that succeeded, from their start, budget wait included), kvpilot_kv_transfer_bytes_total
{direction="received"} (their bytes), kvpilot_kv_transfer_fallbacks_total (timeouts, too large).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
_DONE_S = 1e-9  # a pull with less than this long left is done (float rounding of the event times)


@dataclass(eq=False)
class Pull(Generic[K]):
    key: K  # what the simulator gets back (the handed-over request)
    size: float  # bytes
    started: float  # when the pull was asked for (the runtime's clock starts before the budget)
    deadline: float
    left: float = 0.0  # bytes still to move, once it holds its budget

    def __post_init__(self) -> None:
        self.left = self.size


@dataclass(eq=False)
class Link(Generic[K]):
    bytes_s: float  # the link's bandwidth
    budget: float  # bytes of pulls held at once
    active: list[Pull[K]] = field(default_factory=list)  # holding their budget, sharing the link
    waiting: deque[Pull[K]] = field(default_factory=deque)  # for the budget, first come first served
    held: float = 0.0
    since: float = 0.0  # the active pulls' `left` is as of this time
    version: int = 0  # the simulator's event for the next end is stale when this moved on
    # the runtime's counters
    seconds_total: float = 0.0
    pulls_total: int = 0
    bytes_total: float = 0.0
    fallbacks: int = 0

    def start(self, pull: Pull[K]) -> bool:
        """Ask for a pull (after advance() to its start); False when it can never fit the budget
        (the caller falls back at once)."""
        if pull.size > self.budget:
            self.fallbacks += 1
            return False
        self.waiting.append(pull)
        self._admit()
        return True

    def _admit(self) -> None:
        while self.waiting and self.held + self.waiting[0].size <= self.budget:
            p = self.waiting.popleft()
            self.held += p.size
            self.active.append(p)

    def advance(self, now: float) -> tuple[list[Pull[K]], list[Pull[K]]]:
        """Move the bytes up to `now`: (pulls done, pulls that passed their deadline)."""
        done: list[Pull[K]] = []
        late: list[Pull[K]] = []
        n = len(self.active)
        if n and now > self.since:
            moved = (now - self.since) * self.bytes_s / n
            for p in self.active:
                p.left -= moved
        self.since = max(self.since, now)
        done_bytes = _DONE_S * self.bytes_s / max(1, n)
        keep = []
        for p in self.active:
            if p.left <= done_bytes:
                done.append(p)
                self.seconds_total += now - p.started
                self.pulls_total += 1
                self.bytes_total += p.size
            elif now >= p.deadline:
                late.append(p)
            else:
                keep.append(p)
                continue
            self.held -= p.size
        self.active = keep
        waiting: deque[Pull[K]] = deque()
        for p in self.waiting:
            (late if now >= p.deadline else waiting).append(p)
        self.waiting = waiting
        self.fallbacks += len(late)
        self._admit()
        return done, late

    def next_event(self) -> float | None:
        """When the next pull ends or passes its deadline (None: nothing in flight)."""
        times = [p.deadline for p in self.active] + [p.deadline for p in self.waiting]
        if self.active:
            n = len(self.active)
            times.append(self.since + min(p.left for p in self.active) * n / self.bytes_s)
        return min(times) if times else None

    @property
    def in_flight(self) -> int:
        return len(self.active) + len(self.waiting)


__all__ = ["Link", "Pull"]
