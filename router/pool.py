"""A model's pods, what the router has in flight on each, and the model's central FIFO queue.

Priority classes (`PRIORITIES`, from a request header): the queue is ordered by class, FIFO within a
class, so a `high` request waits only behind earlier `high` ones; a request goes straight to a pod
only when nothing of its class or a higher one is queued. Lower classes wait longer (up to their
deadline, then 429); nothing is preempted on a pod.

Flow control (docs/router.md, "Flow control"): the queue holds at most `max_queue` requests, and each
class at most its own bound; a request waits at most its class's time to live (or less, when its
client asks), then gets 429; a model with no Ready pod holds requests for the cold-start time, then
503. With tenants (an API key or a header, the server decides), a class serves its tenants in turn
(fairqueue.py) and a tenant may hold at most `max_queue_per_tenant` requests of the queue.

No I/O: the server asks `acquire()` for a pod (waiting in the queue when no pod has room, or when the
model has no Ready pod yet: scale from zero), sends the request, then `release()`s it. Every release,
pod change and periodic `pump()` hands the head of the queue to the first pod with room, so a replica
that just became Ready takes the backlog at once. Pods the model's `OutlierDetector` has ejected
(`failed()` / `succeeded()` report each exchange) and pods passed over after a refused connection or
a 503 are not routable until their time is up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpilot.router.fairqueue import FairQueue
from kvpilot.router.outlier import Ejection, OutlierDetector, OutlierSettings
from kvpilot.router.policy import PodView, Policy, RouteKey


@dataclass(frozen=True)
class Endpoint:
    """A Ready pod of a model: its name (stable across updates), base URL, batch capacity, and its
    P/D role (`kvpilot.dev/kv-role`: prefill or decode; None for an aggregated pod)."""

    name: str
    url: str
    capacity: int = 64
    role: str | None = None


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
    ttft_s: float | None = None  # what the router measured of it (measure.PodLatency), for routing
    tpot_s: float | None = None
    error_rate: float = 0.0

    def view(self) -> PodView:
        return PodView(
            name=self.name,
            in_flight=self.in_flight,
            capacity=self.capacity,
            kv_usage=self.kv_usage,
            waiting=self.waiting,
            active_blocks=self.active_blocks,
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            error_rate=self.error_rate,
        )


class Overloaded(Exception):
    """The request cannot be queued or waited past its deadline: the client gets 429, or 503 when
    the model had no pod to send it to (`code` no_endpoints). `code` names the reason."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


PRIORITIES = ("high", "normal", "low")  # served in this order from the central queue
DEFAULT_PRIORITY = "normal"


@dataclass(frozen=True)
class QueueSettings:
    max_queue: int = 256  # requests held per model; one more gets 429 at once
    queue_timeout_s: float = 30.0  # how long a request waits for room on a model that has pods
    cold_start_timeout_s: float = 300.0  # how long it waits for a model with no Ready pod (from zero)
    unhealthy_s: float = 10.0  # a pod that refused or dropped a connection is passed over this long
    # per class (a PRIORITIES name): its own bound on requests queued, its own time to live
    class_max_queue: dict[str, int] = field(default_factory=dict)
    class_timeout_s: dict[str, float] = field(default_factory=dict)
    max_queue_per_tenant: int | None = None  # requests one tenant may hold queued (None: no bound)

    def __post_init__(self) -> None:
        for name, table in (("queue bound", self.class_max_queue), ("time to live", self.class_timeout_s)):
            for cls, value in table.items():
                if cls not in PRIORITIES:
                    raise ValueError(
                        f"{name}: unknown priority class {cls!r} (one of {', '.join(PRIORITIES)})"
                    )
                if not value > 0:
                    raise ValueError(f"{name} of class {cls} must be > 0, got {value}")
        if self.max_queue_per_tenant is not None and self.max_queue_per_tenant < 1:
            raise ValueError(f"the per-tenant queue bound must be >= 1, got {self.max_queue_per_tenant}")

    def timeout_s(self, priority: int) -> float:
        return self.class_timeout_s.get(PRIORITIES[priority], self.queue_timeout_s)

    def class_bound(self, priority: int) -> int:
        return self.class_max_queue.get(PRIORITIES[priority], self.max_queue)


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
    tenant: str = ""
    since: float = field(default_factory=time.monotonic)
    tag: str = ""  # the caller's label of the request (queued_with counts them)


@dataclass
class Slot:
    """One request's slot on a pod (`ModelPool.acquire`; not the Kubernetes Lease of leader
    election): `release()` gives it back once, from whichever path ends the request first. A stream is released when the pod's `[DONE]` arrives,
    before it is relayed: a client that sends its next turn the moment it reads `[DONE]` (an agent)
    must find the pod free, with its prefix cached, not still counted busy with the last turn."""

    pool: ModelPool
    pod: Pod
    key: RouteKey
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.pod, self.key)


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
        self._queue: FairQueue[_Waiter] = FairQueue(len(PRIORITIES))
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

    def queued_with(self, tag: str) -> int:
        """Requests waiting in the queue that `acquire` was given this `tag` for."""
        return sum(1 for w in self._queue if w.tag == tag)

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

    async def acquire(
        self,
        key: RouteKey,
        exclude: frozenset[str] = frozenset(),
        priority: int = 1,
        tenant: str = "",
        timeout_s: float | None = None,
        tag: str = "",
    ) -> Pod:
        """A pod with a slot reserved for this request, waiting behind earlier requests of its
        priority class (its tenant's, and one of each other tenant's in turn) and every request of a
        higher class (`priority`: index into PRIORITIES). `timeout_s`: the client's own time to
        live, at most its class's. `tag`: the caller's label of the request while it waits
        (`queued_with`).

        Raises Overloaded when the queue (or the class's or tenant's share) is full or the wait
        passes its deadline.
        """
        head = self._queue.head_band()
        if head is None or head > priority:  # nobody queued ahead of it
            pod = self.try_acquire(key, exclude)
            if pod is not None:
                return pod
        s = self.settings
        name = PRIORITIES[priority]
        if len(self._queue) >= s.max_queue:
            raise Overloaded(
                f"model {self.model!r} is overloaded: {len(self._queue)} requests already queued; retry later",
                "queue_full",
            )
        if self._queue.band_len(priority) >= s.class_bound(priority):
            raise Overloaded(
                f"model {self.model!r} is overloaded: {self._queue.band_len(priority)} {name}-priority "
                "requests already queued; retry later",
                "queue_full",
            )
        if s.max_queue_per_tenant is not None and self._queue.tenant_len(tenant) >= s.max_queue_per_tenant:
            raise Overloaded(
                f"model {self.model!r}: your {self._queue.tenant_len(tenant)} requests already queued "
                "are your share of the queue; retry later",
                "tenant_queue_full",
            )
        cold = not self.routable(exclude)
        ttl = s.timeout_s(priority) if timeout_s is None else min(timeout_s, s.timeout_s(priority))
        timeout = s.cold_start_timeout_s if cold else ttl
        waiter = _Waiter(key, exclude, asyncio.get_running_loop().create_future(), priority, tenant, tag=tag)
        self._queue.push(waiter, priority, tenant)
        self._changed()
        try:
            await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:  # the client went away while queued
            self._drop(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()
        self._drop(waiter)
        if cold and not self.routable(exclude):
            raise Overloaded(
                f"model {self.model!r} has no Ready pod: none came up within {timeout:g}s; retry later",
                "no_endpoints",
            )
        raise Overloaded(
            f"model {self.model!r} is overloaded: no pod had room within {timeout:g}s; retry later",
            "queue_timeout",
        )

    def _drop(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.future.result(), waiter.key)  # handed a pod in the same tick: give it back
        else:
            waiter.future.cancel()
            self._queue.remove(waiter, waiter.priority, waiter.tenant)
            self._changed()
            self.pump()  # the head may have been this waiter

    def release(self, pod: Pod, key: RouteKey) -> None:
        pod.in_flight = max(0, pod.in_flight - 1)
        pod.active_blocks = max(0, pod.active_blocks - key.footprint)
        self.pump()

    def pump(self) -> None:
        """Hand queued requests, oldest first, to pods with room."""
        changed = False
        while (head := self._queue.peek()) is not None:
            if head.future.done():
                self._queue.pop()
                changed = True
                continue
            pod = self.try_acquire(head.key, head.exclude)
            if pod is None:
                break
            self._queue.pop()
            head.future.set_result(pod)
            changed = True
        if changed:
            self._changed()

    def oldest_wait_s(self) -> float:
        return time.monotonic() - min(w.since for w in self._queue) if len(self._queue) else 0.0

    def _changed(self) -> None:
        if self._on_queue_change is not None:
            self._on_queue_change(self.model, len(self._queue))
