"""A model's pods, what the router has in flight on each, and the model's central FIFO queue.

Priority classes (`PRIORITIES`, from a request header): the queue is ordered by class, FIFO within a
class, so a `high` request waits only behind earlier `high` ones; a request goes straight to a pod
only when nothing of its class or a higher one is queued. Lower classes wait longer (up to their
deadline, then 429); nothing is preempted on a pod.

No I/O: the server asks `acquire()` for a pod (waiting in the queue when no pod has room, or when the
model has no Ready pod yet: scale from zero), sends the request, then `release()`s it. Every release,
pod change and periodic `pump()` hands the head of the queue to the first pod with room, so a replica
that just became Ready takes the backlog at once. Pods the model's `OutlierDetector` has ejected
(`failed()` / `succeeded()` report each exchange) and pods passed over after a refused connection or
a 503 are not routable until their time is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpilot.router.outlier import Ejection, OutlierDetector, OutlierSettings
from kvpilot.router.policy import PodView, Policy, RouteKey


@dataclass(frozen=True)
class Endpoint:
    """A Ready pod of a model: its name (stable across updates), base URL and batch capacity."""

    name: str
    url: str
    capacity: int = 64


@dataclass
class Pod:
    name: str
    url: str
    capacity: int
    in_flight: int = 0
    active_blocks: int = 0
    kv_usage: float | None = None
    waiting: int | None = None
    unhealthy_until: float = 0.0
    sent_total: int = 0
    answered_at: float = 0.0  # monotonic time the router last heard from the pod (a response, a probe)

    def view(self) -> PodView:
        return PodView(
            name=self.name,
            in_flight=self.in_flight,
            capacity=self.capacity,
            kv_usage=self.kv_usage,
            waiting=self.waiting,
            active_blocks=self.active_blocks,
        )


class Overloaded(Exception):
    """The request cannot be queued (queue full) or waited past its deadline: the client gets 429."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class QueueSettings:
    max_queue: int = 256  # requests held per model; one more gets 429 at once
    queue_timeout_s: float = 30.0  # how long a request waits for room on a model that has pods
    cold_start_timeout_s: float = 300.0  # how long it waits for a model with no Ready pod (from zero)
    unhealthy_s: float = 10.0  # a pod that refused or dropped a connection is passed over this long


PRIORITIES = ("high", "normal", "low")  # served in this order from the central queue
DEFAULT_PRIORITY = "normal"


def priority_class(value: str | None) -> int:
    """The queue class of a priority header value (None: normal); ValueError for anything else."""
    if value is None or not value.strip():
        return PRIORITIES.index(DEFAULT_PRIORITY)
    name = value.strip().lower()
    if name not in PRIORITIES:
        raise ValueError(f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return PRIORITIES.index(name)


@dataclass
class _Waiter:
    key: RouteKey
    exclude: frozenset[str]
    future: asyncio.Future[Pod]
    priority: int = 1  # index into PRIORITIES: lower is served first
    since: float = field(default_factory=time.monotonic)


class ModelPool:
    def __init__(
        self,
        model: str,
        policy: Policy,
        settings: QueueSettings | None = None,
        on_queue_change: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        outliers: OutlierSettings | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.settings = settings or QueueSettings()
        self.outliers = OutlierDetector(outliers)
        self.pods: dict[str, Pod] = {}
        self._queue: deque[_Waiter] = deque()
        self._on_queue_change = on_queue_change
        self._clock = clock

    # -- pods ----------------------------------------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the Ready pods; pods that stay keep their counters, pods that left are forgotten.

        A request in flight on a pod that left still releases normally (its Pod object lives on).
        """
        fresh: dict[str, Pod] = {}
        for ep in endpoints:
            pod = self.pods.get(ep.name)
            if pod is None or pod.url != ep.url:
                pod = Pod(name=ep.name, url=ep.url, capacity=ep.capacity)
            pod.capacity = ep.capacity
            fresh[ep.name] = pod
        for name in self.pods.keys() - fresh.keys():
            self.policy.forget(name)
            self.outliers.forget(name)
        self.pods = fresh
        self.pump()

    def routable(self, exclude: frozenset[str] = frozenset()) -> list[Pod]:
        now = self._clock()
        return sorted(
            (
                p
                for p in self.pods.values()
                if p.unhealthy_until <= now
                and p.name not in exclude
                and not self.outliers.is_ejected(p.name, now)
            ),
            key=lambda p: p.name,
        )

    def mark_unhealthy(self, pod: Pod, seconds: float | None = None) -> None:
        pod.unhealthy_until = self._clock() + (self.settings.unhealthy_s if seconds is None else seconds)

    def succeeded(self, pod: Pod) -> None:
        """An exchange with the pod went through (an answer below 500, a stream to its end)."""
        self.outliers.success(pod.name)

    def failed(self, pod: Pod) -> Ejection | None:
        """An exchange with the pod failed; the ejection it caused, if any (outlier.py decides)."""
        if self.pods.get(pod.name) is not pod:
            return None  # the pod left the model (or was replaced) while the request ran
        return self.outliers.failure(pod.name, self._clock(), self.pods.keys())

    @property
    def ejected_count(self) -> int:
        return len(self.outliers.ejected(self.pods.keys(), self._clock()))

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.pods.values())

    # -- admission -----------------------------------------------------------------------------

    def try_acquire(self, key: RouteKey, exclude: frozenset[str] = frozenset()) -> Pod | None:
        pods = self.routable(exclude)
        i = self.policy.choose(key, [p.view() for p in pods])
        if i is None:
            return None
        pod = pods[i]
        pod.in_flight += 1
        pod.active_blocks += key.footprint
        pod.sent_total += 1
        self.policy.dispatched(pod.name, key)
        return pod

    async def acquire(self, key: RouteKey, exclude: frozenset[str] = frozenset(), priority: int = 1) -> Pod:
        """A pod with a slot reserved for this request, waiting behind earlier requests of its
        priority class and every request of a higher class (`priority`: index into PRIORITIES).

        Raises Overloaded when the queue is full or the wait passes its deadline.
        """
        if not self._queue or self._queue[0].priority > priority:  # nobody queued ahead of it
            pod = self.try_acquire(key, exclude)
            if pod is not None:
                return pod
        s = self.settings
        if len(self._queue) >= s.max_queue:
            raise Overloaded(
                f"model {self.model!r} is overloaded: {len(self._queue)} requests already queued; retry later",
                "queue_full",
            )
        cold = not self.routable(exclude)
        timeout = s.cold_start_timeout_s if cold else s.queue_timeout_s
        waiter = _Waiter(key, exclude, asyncio.get_running_loop().create_future(), priority)
        at = len(self._queue)
        while at > 0 and self._queue[at - 1].priority > priority:  # behind its class, ahead of lower ones
            at -= 1
        self._queue.insert(at, waiter)
        self._changed()
        try:
            await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:  # the client went away while queued
            self._drop(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()
        self._drop(waiter)
        what = "no Ready pod came up" if cold and not self.routable(exclude) else "no pod had room"
        raise Overloaded(
            f"model {self.model!r} is overloaded: {what} within {timeout:g}s; retry later", "queue_timeout"
        )

    def _drop(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.future.result(), waiter.key)  # handed a pod in the same tick: give it back
        else:
            waiter.future.cancel()
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)
            self._changed()
            self.pump()  # the head may have been this waiter

    def release(self, pod: Pod, key: RouteKey) -> None:
        pod.in_flight = max(0, pod.in_flight - 1)
        pod.active_blocks = max(0, pod.active_blocks - key.footprint)
        self.pump()

    def pump(self) -> None:
        """Hand queued requests, oldest first, to pods with room."""
        changed = False
        while self._queue:
            head = self._queue[0]
            if head.future.done():
                self._queue.popleft()
                changed = True
                continue
            pod = self.try_acquire(head.key, head.exclude)
            if pod is None:
                break
            self._queue.popleft()
            head.future.set_result(pod)
            changed = True
        if changed:
            self._changed()

    def oldest_wait_s(self) -> float:
        return time.monotonic() - self._queue[0].since if self._queue else 0.0

    def _changed(self) -> None:
        if self._on_queue_change is not None:
            self._on_queue_change(self.model, len(self._queue))
