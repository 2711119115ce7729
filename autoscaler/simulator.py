"""Fleet simulator: replay an arrival trace against simulated replicas and a scaling policy.

Each replica is a continuous-batching engine on a calibrated cost model (calibration.py; from first
principles for a GPU x model in replica_model.py): every step it serves running requests first (one
decode token each, or the next prompt chunk), then admits waiting requests FIFO within the token
budget, the sequence limit and the free KV blocks; when blocks run out it preempts the most recently
admitted request (freed, recomputed later) and admits nobody that step. A step's time depends on the
context the batch reads (KV bytes) and the attention pairs it computes. A stretch of pure decode steps
with nothing to admit is advanced in one jump (block by block; every step of the jump is timed at the
jump's mid context, exact while the steps are memory-bound, as decode steps are), which keeps an
hours-long trace to seconds of CPU.

Prefix cache: a replica keeps an LRU of the prompt blocks (trace hash_ids, 512 tokens each) it has
computed, as many as its KV pool holds; a request admitted to the batch skips the leading run of its
blocks found there (at least its last token is computed). Cached blocks are not shared with running
requests' allocations (the pool is charged for the whole prompt): a little pessimistic on memory.

Routing (the interface the fleet router's policies plug into): a `Router` is a callable
    router(request: RequestView, replicas: Sequence[ReplicaView]) -> int | None
given the request and one view per Ready, non-draining replica (load, free KV, the request's prefix
hit there), returning the index into `replicas` to send it to, or None to hold it in the fleet's
central FIFO queue. Queued requests are offered again, oldest first, whenever a replica finishes a
step or becomes Ready, until the router holds the oldest. Routers have a `name`. Two are here:
`RoundRobin` (a plain Service: per-replica queues, never holds) and `LeastLoaded` (the replica with
the fewest requests in flight among those with a free batch slot and KV for the prompt, else hold).
`ROUTERS` also has the fleet router's policies as `router:<policy>` (round-robin, least-loaded,
prefix-affinity, kv-aware): `kvpilot.router.policy`, the code `kvpilot router` runs, through the one
adapter in sim_routing.py, shown what the router would know of each pod.

The fleet: a replica that is scaled up becomes Ready after calibration.startup_s; scale-down removes
starting replicas first, then drains the least-loaded Ready ones (no new requests, in-flight ones
finish). Every sync_interval_s the policy sees the same MetricsSnapshot the controller would build and
returns the replica count.

SLO (slo.py): a request meets it when its TTFT is within its target (which grows with the prompt) and
its TPOT (time per output token after the first) within the TPOT target; rejected requests miss.

Deterministic: no randomness, no wall clock; the same inputs give the same numbers.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from kvpilot.api.slo import OUTCOMES, Outcome, judge, request_tpot
from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sim_replica import (
    OUTPUT_TOKENS_BUCKETS,
    Replica,
    ReplicaView,
    RequestView,
    SimRequest,
)
from kvpilot.autoscaler.sim_result import SimResult, _percentile
from kvpilot.autoscaler.sim_routing import PREFIX, PolicyRouter
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.startup import STARTUP_SAMPLE_PODS, measured_startup_s
from kvpilot.autoscaler.trace import TraceRequest
from kvpilot.router.policy import POLICIES

__all__ = [
    "OUTPUT_TOKENS_BUCKETS",
    "ROUTERS",
    "FleetSimulator",
    "LeastLoaded",
    "Replica",
    "ReplicaView",
    "RequestView",
    "RoundRobin",
    "Router",
    "SimRequest",
    "SimResult",
    "simulate",
    "size_static_for_slo",
]

MIN_MINUTE_REQUESTS = 10  # minutes with fewer requests do not count for worst_minute_attainment

# Event kinds, in the order they are handled at equal times (_HANDOFF: a subclass's own, e.g. the P/D
# simulator's KV transfers landing on a decode replica).
_STEP_END, _READY, _HANDOFF, _ARRIVAL, _SYNC = 0, 1, 2, 3, 4
# The role of an aggregated replica (pd_simulator.py adds "prefill" and "decode" pools).
BOTH = "both"


class FleetPolicy(Protocol):
    name: str

    def initial_replicas(self) -> int: ...

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int: ...

    def settings(self) -> dict[str, Any]: ...


# -- routing -----------------------------------------------------------------------------------------


class Router(Protocol):
    name: str

    def __call__(self, request: RequestView, replicas: Sequence[ReplicaView]) -> int | None: ...


class RoundRobin:
    """Each request to the next Ready replica in turn; never holds (per-replica queues)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, request: RequestView, replicas: Sequence[ReplicaView]) -> int | None:
        i = self._next % len(replicas)
        self._next += 1
        return i


class LeastLoaded:
    """The replica with the fewest requests in flight (then the most free KV) among those with a free
    batch slot and KV for the prompt; None (hold in the central queue) when none has room."""

    name = "least-loaded"

    def __call__(self, request: RequestView, replicas: Sequence[ReplicaView]) -> int | None:
        best, key = None, None
        for i, r in enumerate(replicas):
            if (
                r.in_flight >= r.max_num_seqs
                or r.free_kv_tokens < request.prompt_tokens - r.prefix_hit_tokens
            ):
                continue
            k = (r.in_flight, -r.free_kv_tokens)
            if key is None or k < key:
                best, key = i, k
        return best


# Router factories by name: the two built in here, and the fleet router's own policies
# (`router:<policy>`, kvpilot.router.policy through sim_routing.PolicyRouter).
ROUTERS: dict[str, Callable[[], Router]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    **{PREFIX + p: partial(PolicyRouter, p) for p in POLICIES},
}


class FleetSimulator:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: FleetPolicy,
        calibration: Calibration | None = None,
        *,
        sync_interval_s: float = 15.0,
        slo: Slo | None = None,
        slo_ttft_s: float | None = None,
        warmup_s: float = 300.0,
        router: Router | None = None,
    ) -> None:
        """slo_ttft_s alone (no slo): a fixed TTFT target and no TPOT target (the old judgement)."""
        if not trace:
            raise ValueError("empty trace")
        self.trace = trace
        self.policy = policy
        self.cal = calibration or Calibration()
        self.sync_interval_s = sync_interval_s
        if slo is None:
            slo = Slo(ttft_s=slo_ttft_s, tpot_s=math.inf, ttft_prefill_factor=0.0) if slo_ttft_s else Slo()
        self.slo = slo
        # Every request is judged as the router judges it (api/slo.judge), with the prefill terms the
        # autoscaler publishes for this calibration; the counts are the router's SLO counter.
        self.judge_targets = slo.judge_targets(self.cal)
        self._outcomes: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)
        self.warmup_s = warmup_s
        self.router: Router = router or RoundRobin()
        self.routers: dict[str, Router] = {BOTH: self.router}  # by replica role
        self.replicas: list[Replica] = []
        self.scale_events = 0
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._peak = 0
        # The central queue (requests the router held), one per replica role.
        self._queues: dict[str, deque[SimRequest]] = {BOTH: deque()}
        self._ready_cache: dict[str, list[Replica]] = {}

    # -- events --------------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, a, b))

    def _schedule(self, rep: Replica, now: float) -> None:
        end = rep.plan(now)
        rep.version += 1
        if end is not None:
            self._push(end, _STEP_END, rep.rid, rep.version)
        elif rep.draining:
            self._retire(rep, now)

    def _reschedule(self, rep: Replica, end: float) -> None:
        rep.version += 1
        self._push(end, _STEP_END, rep.rid, rep.version)

    # -- fleet ---------------------------------------------------------------------------------------

    def _active(self, role: str | None = BOTH) -> list[Replica]:
        """Replicas the Deployment counts: starting or Ready, not draining (of `role`; None: all)."""
        return [r for r in self.replicas if r.gone_at is None and not r.draining and role in (None, r.role)]

    def _routable(self, role: str = BOTH) -> list[Replica]:
        cached = self._ready_cache.get(role)
        if cached is None:
            cached = [
                r
                for r in self.replicas
                if r.ready and not r.draining and r.gone_at is None and r.role == role
            ]
            self._ready_cache[role] = cached
        return cached

    def _add_replica(self, now: float, ready_now: bool = False, role: str = BOTH) -> None:
        rep = Replica(
            rid=len(self.replicas),
            role=role,
            cal=self.cal,
            created=now,
            ready_at=now if ready_now else now + self.cal.startup_s,
            free_blocks=self.cal.num_kv_blocks,
            ready=ready_now,
            started_ready=ready_now,
        )
        self.replicas.append(rep)
        self._ready_cache.clear()
        if not ready_now:
            self._push(rep.ready_at, _READY, rep.rid)

    def _retire(self, rep: Replica, now: float) -> None:
        rep.gone_at = now
        rep.version += 1
        self._ready_cache.clear()

    def _scale_to(self, now: float, desired: int, role: str = BOTH) -> None:
        active = self._active(role)
        if desired > len(active):
            for _ in range(desired - len(active)):
                self._add_replica(now, role=role)
        elif desired < len(active):
            excess = len(active) - desired
            # ReplicaSet order: not-ready pods first (newest first), then the lowest deletion cost.
            starting = sorted((r for r in active if not r.ready), key=lambda r: -r.created)
            ready = sorted((r for r in active if r.ready), key=lambda r: (r.in_flight, r.kv_usage, -r.rid))
            for rep in (starting + ready)[:excess]:
                rep.draining = True
                if not rep.ready or (not rep.busy and rep.in_flight == 0):
                    self._retire(rep, now)
            self._ready_cache.clear()
        self._peak = max(self._peak, len(self._active(None)))

    def _assign(self, rep: Replica, req: SimRequest, now: float) -> bool:
        if len(rep.waiting) >= self.cal.max_queue_len:
            self._reject(req)
            return False
        rep.waiting.append(req)
        rep.waiting_tokens += req.prompt
        rep.admitted += 1
        rep.admitted_prompt_tokens += req.prompt
        if not rep.busy:
            self._schedule(rep, now)
        elif rep.jump:
            end = rep.materialize(now, truncate=True)
            if end is not None:
                self._reschedule(rep, end)
        return True

    def _offer(self, req: SimRequest, ready: list[Replica], role: str = BOTH) -> Replica | None:
        view = RequestView(req.prompt, req.output, req.hash_ids)
        idx = self.routers[role](view, [r.view(req) for r in ready])
        return None if idx is None else ready[idx]

    def _route(self, req: SimRequest, now: float, role: str = BOTH) -> None:
        ready = self._routable(role)
        queue = self._queues[role]
        if not ready or req.prompt + req.output > self.cal.kv_capacity_tokens:
            self._reject(req)
            return
        if queue:  # FIFO: nobody overtakes the central queue
            if len(queue) >= self.cal.max_queue_len * len(ready):
                self._reject(req)
                return
            queue.append(req)
            self._dispatch(now, role)
            return
        rep = self._offer(req, ready, role)
        if rep is None:
            queue.append(req)
        else:
            self._assign(rep, req, now)

    def _dispatch(self, now: float, role: str = BOTH) -> None:
        """Offer the central queue to the router, oldest first, until it holds one."""
        queue = self._queues[role]
        while queue:
            ready = self._routable(role)
            if not ready:
                return
            rep = self._offer(queue[0], ready, role)
            if rep is None:
                return
            self._assign(rep, queue.popleft(), now)

    def _dispatch_all(self, now: float) -> None:
        for role, queue in self._queues.items():
            if queue:
                self._dispatch(now, role)

    def measured_startup_s(self, roles: tuple[str, ...]) -> float | None:
        """The startup as the controller measures it from these roles' pods: the median creation ->
        Ready of the most recent Ready ones."""
        started = sorted(
            (r for r in self.replicas if r.ready and r.gone_at is None and r.role in roles),
            key=lambda r: r.created,
        )
        return measured_startup_s(r.startup_s for r in started[-STARTUP_SAMPLE_PODS:])

    def _snapshot(self, now: float, role: str = BOTH) -> tuple[MetricsSnapshot, int]:
        """What the controller would read of `role`'s replicas (the role's central queue spread over
        them as waiting), and the requests in flight there."""
        samples = []
        queue = self._queues[role]
        in_flight = len(queue)
        for rep in self.replicas:
            if rep.gone_at is not None or not rep.ready or rep.role != role:
                continue
            if rep.jump:
                end = rep.materialize(now, truncate=False)
                if end is not None:
                    self._reschedule(rep, end)
            in_flight += rep.in_flight
            if not rep.draining:
                samples.append(rep.sample())
        # The central queue is the router's, reported as the router reports it (router_queue: its
        # kvpilot_router_queue_depth, which the controller reads beside the pods').
        snapshot = MetricsSnapshot(
            ready_replicas=len(samples),
            samples=tuple(samples),
            startup_s=self.measured_startup_s((role,)),
            router_slo=SloCounts.from_outcomes(self._outcomes),
            router_queue=len(queue),
        )
        return snapshot, in_flight

    # -- run -----------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        requests = [SimRequest(r.t, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in self.trace]
        t_end = requests[-1].arrival
        for _ in range(max(0, self.policy.initial_replicas())):
            self._add_replica(0.0, ready_now=True)
        self._peak = len(self._active())
        for i, req in enumerate(requests):
            self._push(req.arrival, _ARRIVAL, i)
        self._push(self.sync_interval_s, _SYNC)
        while self._events:
            t, kind, _, a, b = heapq.heappop(self._events)
            if kind == _STEP_END:
                rep = self.replicas[a]
                if b != rep.version or rep.gone_at is not None:
                    continue
                self._finished(rep, rep.end_step(t), t)
                self._schedule(rep, t)
                self._dispatch_all(t)
            elif kind == _ARRIVAL:
                self._arrive(requests[a], t)
            elif kind == _HANDOFF:
                self._handoff(t, a, b)
            elif kind == _READY:
                rep = self.replicas[a]
                if rep.gone_at is None:
                    rep.ready = True
                    self._ready_cache.clear()
                    self._dispatch_all(t)
            elif kind == _SYNC:
                self._sync(t)
                if t + self.sync_interval_s <= t_end:
                    self._push(t + self.sync_interval_s, _SYNC)
        for queue in self._queues.values():  # still held when the trace ended with no replica to take it
            for req in queue:
                self._reject(req)
        return self._result(requests, t_end)

    # -- hooks (pd_simulator.PdFleetSimulator overrides them) ------------------------------------------

    def _arrive(self, req: SimRequest, now: float) -> None:
        self._route(req, now)

    def _finished(self, rep: Replica, done: list[SimRequest], now: float) -> None:
        for r in done:
            self._outcomes[self._judge(r)] += 1

    def _handoff(self, now: float, a: int, b: int) -> None:
        raise NotImplementedError("an aggregated fleet has no hand-offs")

    def _sync(self, now: float) -> None:
        snapshot, in_flight = self._snapshot(now)
        current = len(self._active())
        desired = self.policy.decide(now, current, snapshot, in_flight)
        if desired != current:
            self.scale_events += 1
            self._scale_to(now, desired)

    def _judge(self, r: SimRequest) -> Outcome:
        """api/slo.judge on what the router would have seen; a request still decoding at the end of the
        trace is judged on what it did so far (its TTFT)."""
        if r.rejected or r.first_token is None:
            return "failed"
        ttft = r.first_token - r.arrival
        tpot = None if r.finish is None else request_tpot(r.first_token, r.finish, r.output)
        return judge(self.judge_targets, ttft, tpot, r.prompt)

    def _reject(self, r: SimRequest) -> None:
        r.rejected = True
        self._outcomes["failed"] += 1

    def _result(self, requests: Sequence[SimRequest], t_end: float) -> SimResult:
        w0 = min(self.warmup_s, t_end)
        measured = [r for r in requests if r.arrival >= w0]
        ttfts = sorted(
            (r.first_token - r.arrival) for r in measured if r.first_token is not None and not r.rejected
        )
        tpots = sorted(
            (r.finish - r.first_token) / (r.output - 1)
            for r in measured
            if r.finish is not None and r.first_token is not None and r.output > 1
        )
        ok = ok_ttft = 0
        minutes: dict[int, list[int]] = {}
        for r in measured:
            outcome = self._judge(r)
            met, t_ok = outcome == "met", outcome in ("met", "missed_tpot")
            ok += met
            ok_ttft += t_ok
            counts = minutes.setdefault(int((r.arrival - w0) // 60.0), [0, 0])
            counts[0] += int(met)
            counts[1] += 1
        worst = min((m / n for m, n in minutes.values() if n >= MIN_MINUTE_REQUESTS), default=1.0)
        replica_seconds = 0.0
        for rep in self.replicas:
            start = max(rep.created, w0)
            stop = min(rep.gone_at if rep.gone_at is not None else t_end, t_end)
            replica_seconds += max(0.0, stop - start)
        window = max(1e-9, t_end - w0)
        prompt_tokens = sum(r.prompt for r in measured if r.cached_tokens is not None)
        cached = sum(r.cached_tokens or 0 for r in measured)
        out_tokens = sum(r.output for r in measured if r.finish is not None and r.finish <= t_end)
        return SimResult(
            policy=self.policy.name,
            slo=self.slo,
            slo_attainment=ok / len(measured) if measured else 1.0,
            ttft_attainment=ok_ttft / len(measured) if measured else 1.0,
            replica_hours=replica_seconds / 3600.0,
            scale_events=self.scale_events,
            requests=len(measured),
            rejected=sum(1 for r in measured if r.rejected),
            ttft_p50_s=_percentile(ttfts, 0.50),
            ttft_p95_s=_percentile(ttfts, 0.95),
            ttft_p99_s=_percentile(ttfts, 0.99),
            tpot_p50_s=_percentile(tpots, 0.50),
            tpot_p99_s=_percentile(tpots, 0.99),
            prefix_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
            throughput_tokens_s=out_tokens / window,
            last_finish_s=max((r.finish for r in measured if r.finish is not None), default=0.0),
            preemptions=sum(r.preemptions for r in self.replicas),
            peak_replicas=self._peak,
            mean_replicas=replica_seconds / window,
            window_s=(w0, t_end),
            worst_minute_attainment=worst,
            settings={
                "policy": self.policy.settings(),
                "calibration": self.cal.to_dict(),
                "sync_interval_s": self.sync_interval_s,
                "warmup_s": self.warmup_s,
                "router": self.router.name,
                "slo": {
                    "ttft_s": self.slo.ttft_s,
                    "tpot_s": self.slo.tpot_s,
                    "ttft_prefill_factor": self.slo.ttft_prefill_factor,
                    "ttft_target": "ttft_s + ttft_prefill_factor x (a x prompt + b x prompt^2)",
                    "prefill_s_per_token": self.judge_targets.prefill_s_per_token,
                    "prefill_s_per_token_sq": self.judge_targets.prefill_s_per_token_sq,
                },
            },
        )


def simulate(
    trace: Sequence[TraceRequest],
    policy: FleetPolicy,
    calibration: Calibration | None = None,
    **kwargs: Any,
) -> SimResult:
    return FleetSimulator(trace, policy, calibration, **kwargs).run()


def size_static_for_slo(
    trace: Sequence[TraceRequest],
    calibration: Calibration | None,
    slo_target: float,
    max_replicas: int,
    *,
    every_minute: bool = False,
    router_factory: Any = None,
    **kwargs: Any,
) -> int:
    """Smallest fixed fleet whose SLO attainment on this trace is >= slo_target, found with perfect
    hindsight; max_replicas when none is. Binary search: attainment grows with size.

    every_minute=False: over the whole trace (the cheapest static fleet that meets the goal; it may
    let the short peaks miss, since they are a small share of all requests).
    every_minute=True: in every minute too, i.e. provisioned for the peak load.
    router_factory: makes a fresh router for each run (routers may keep state).
    """
    from kvpilot.autoscaler.fleet_policies import StaticPolicy

    def meets(n: int) -> bool:
        extra = {"router": router_factory()} if router_factory else {}
        r = simulate(trace, StaticPolicy(n), calibration, **kwargs, **extra)
        return r.slo_attainment >= slo_target and (
            not every_minute or r.worst_minute_attainment >= slo_target
        )

    lo, hi = 1, max(1, max_replicas)
    if not meets(hi):
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
