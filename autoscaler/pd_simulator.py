"""The fleet simulator for a disaggregated model: a prefill pool and a decode pool (docs/disaggregation.md).

A request whose prompt has at least `min_prompt_tokens` tokens (spec.disaggregation.minPromptTokens)
goes to the prefill pool as the router sends it there: the same prompt with one output token
(`max_tokens: 1`). A prefill replica is the simulator's ordinary engine (sim_replica.Replica) running
only such requests: chunked prefill, never a decode step of someone else's. When its prompt is done the
request is handed to the decode pool: the decode router picks a replica (or the decode central queue
holds it), the replica pulls the KV blocks it lacks, and the request joins its queue with that KV in
place. The pull covers every full KV block but the one holding the last prompt token, less the
leading blocks the decode replica's prefix cache already holds; it takes bytes / link bandwidth
(calibration.kv_bytes_per_token, kv_link_bytes_s), one pull at a time per decode replica (its NIC).
The decode replica computes the remaining prompt tokens itself and samples the first token, so TTFT is
arrival -> the first token of the decode replica, as the router measures it. Shorter prompts, and
every prompt while no prefill replica is Ready, go straight to the decode pool (the router's direct
path) and run there like on an aggregated replica.

Not modelled: the pull starts when the request is handed over (a real decode pod pulls after it
admits it, holding its blocks meanwhile: the same when it has room, as a decode pod sized for its
signals does); the prefill replica's blocks are freed at once (the real one pins them until the pull,
a transfer time); transfers do not fail (the runtime's fallback recomputes the prompt on the decode
pod). The router's choice of pods runs the fleet router's policy code in each pool (sim_routing), and
the prefill/direct split is the one-line threshold of docs/disaggregation.md.

The policy sees one PdSnapshot per sync (each role's pods as the controller reads them by their
kvpilot.dev/kv-role label, the requests the router holds, its SLO counter) and returns both roles'
sizes at once (pd_policy.decide_pd behind PdKvpilotPolicy, or a fixed PdStaticPolicy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.api.models import DEFAULT_PD_MIN_PROMPT_TOKENS
from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.pd_policy import DECODE, PREFILL, PdSnapshot
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sim_replica import Replica, SimRequest
from kvpilot.autoscaler.sim_result import SimResult
from kvpilot.autoscaler.simulator import _HANDOFF, BOTH, FleetSimulator, RoundRobin, Router
from kvpilot.autoscaler.trace import HASH_BLOCK_TOKENS, TraceRequest

Sizes = tuple[int, int]  # (prefill, decode) replicas


class PdFleetPolicy(Protocol):
    name: str

    def initial_replicas(self) -> Sizes: ...

    def decide(self, now: float, current: Sizes, snapshot: PdSnapshot) -> Sizes: ...

    def settings(self) -> dict[str, Any]: ...


class PdStaticPolicy:
    """A fixed P/D fleet."""

    name = "static P/D"

    def __init__(self, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 1:
            raise ValueError("a fixed P/D fleet needs prefill >= 0 and decode >= 1 replicas")
        self.sizes = (prefill, decode)

    def initial_replicas(self) -> Sizes:
        return self.sizes

    def decide(self, now: float, current: Sizes, snapshot: PdSnapshot) -> Sizes:
        return self.sizes

    def settings(self) -> dict[str, Any]:
        return {"prefill": self.sizes[0], "decode": self.sizes[1]}


class _Named:
    """What FleetSimulator's result reads of a policy (name, settings); decisions go through decide_pd."""

    def __init__(self, policy: PdFleetPolicy) -> None:
        self.policy = policy
        self.name = policy.name

    def initial_replicas(self) -> int:
        return 0

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        raise NotImplementedError("a P/D fleet decides both roles (PdFleetPolicy)")

    def settings(self) -> dict[str, Any]:
        return self.policy.settings()


@dataclass
class TransferStats:
    transfers: int = 0
    bytes: float = 0.0
    seconds: float = 0.0  # sum of pull times (waiting for the link included)
    prompt_tokens: int = 0  # of the transferred requests
    direct: int = 0  # requests that skipped the prefill pool


def pulled_tokens(prompt: int, block_size: int) -> int:
    """Prompt tokens whose KV the decode side pulls: every full block but the one with the last token."""
    return ((prompt - 1) // block_size) * block_size if prompt > 0 else 0


class PdFleetSimulator(FleetSimulator):
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: PdFleetPolicy,
        calibration: Calibration | None = None,
        *,
        min_prompt_tokens: int = DEFAULT_PD_MIN_PROMPT_TOKENS,
        prefill_router: Router | None = None,
        decode_router: Router | None = None,
        **kwargs: Any,
    ) -> None:
        if min_prompt_tokens < 0:
            raise ValueError("min_prompt_tokens must be >= 0")
        super().__init__(trace, _Named(policy), calibration, router=decode_router or RoundRobin(), **kwargs)
        self.pd_policy = policy
        self.min_prompt_tokens = min_prompt_tokens
        self.routers = {PREFILL: prefill_router or RoundRobin(), DECODE: self.router}
        self._queues = {PREFILL: self._queues[BOTH], DECODE: type(self._queues[BOTH])()}
        self._jobs: dict[int, SimRequest] = {}  # id(prefill request) -> the client's request
        self._pulls: list[tuple[SimRequest, Replica, int] | None] = []  # in flight, by hand-off index
        self._link_free: dict[int, float] = {}  # decode replica -> when its link is free
        self._kv_on_the_way: set[int] = set()  # id() of requests whose KV a decode replica will pull
        self.transfers = TransferStats()

    # -- routing -------------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest, now: float) -> None:
        # The router's P/D path: long prompts to a prefill pod while one is Ready, the rest direct.
        long = req.prompt >= self.min_prompt_tokens
        if long and (self._routable(PREFILL) or (self._active(PREFILL) and not self._routable(DECODE))):
            job = SimRequest(req.arrival, req.prompt, 1, req.hash_ids)
            self._jobs[id(job)] = req
            self._route(job, now, PREFILL)
            return
        self.transfers.direct += 1
        self._route(req, now, DECODE)

    def _route(self, req: SimRequest, now: float, role: str = BOTH) -> None:
        if not self._routable(role) and req.prompt + req.output <= self.cal.kv_capacity_tokens:
            # Nothing Ready in the pool (scaled to zero, or starting): the router holds the request;
            # its queue is what wakes the pool (PdSnapshot.router_queue).
            queue = self._queues[role]
            if len(queue) >= self.cal.max_queue_len:
                self._reject(req)
            else:
                queue.append(req)
            return
        super()._route(req, now, role)

    def _assign(self, rep: Replica, req: SimRequest, now: float) -> bool:
        if id(req) not in self._kv_on_the_way:
            return super()._assign(rep, req, now)
        # A handed-over request: the decode replica pulls what it lacks, then queues it.
        self._kv_on_the_way.discard(id(req))
        pulled = pulled_tokens(req.prompt, self.cal.block_size)
        hit = min(rep.prefix_hit(req.hash_ids) * HASH_BLOCK_TOKENS, req.prompt - 1) if req.hash_ids else 0
        sent = max(0, pulled - hit)
        seconds = sent * self.cal.kv_bytes_per_token / self.cal.kv_link_bytes_s
        start = max(now, self._link_free.get(rep.rid, 0.0))
        end = start + seconds
        self._link_free[rep.rid] = end
        t = self.transfers
        t.transfers += 1
        t.bytes += sent * self.cal.kv_bytes_per_token
        t.seconds += end - now
        t.prompt_tokens += req.prompt
        self._pulls.append((req, rep, max(pulled, hit)))
        self._push(end, _HANDOFF, len(self._pulls) - 1)
        return True

    def _handoff(self, now: float, index: int) -> None:
        pull = self._pulls[index]
        self._pulls[index] = None
        assert pull is not None
        req, rep, have = pull
        if rep.gone_at is not None:  # the decode replica left meanwhile: the router sends it again,
            req.computed = 0  # and the next decode replica recomputes the prompt (the fallback)
            self._route(req, now, DECODE)
            return
        rep.remember_prefix(req.hash_ids)
        req.computed = have
        req.prefill_target = req.prompt
        super()._assign(rep, req, now)

    def _finished(self, rep: Replica, done: list[SimRequest], now: float) -> None:
        if rep.role != PREFILL:
            super()._finished(rep, done, now)
            return
        for job in done:
            req = self._jobs.pop(id(job))
            req.cached_tokens = job.cached_tokens
            self._kv_on_the_way.add(id(req))
            self._route(req, now, DECODE)

    def _reject(self, r: SimRequest) -> None:
        super()._reject(self._jobs.pop(id(r), r))

    # -- scaling -------------------------------------------------------------------------------------

    def pd_snapshot(self, now: float) -> PdSnapshot:
        """Each role's pods as the controller reads them (the router's queues are not spread over
        them: the router reports its held requests, PdSnapshot.router_queue)."""
        roles: dict[str, MetricsSnapshot] = {}
        held = 0
        for role in (PREFILL, DECODE):
            queue = self._queues[role]
            held += len(queue)
            saved, self._queues[role] = queue, type(queue)()
            roles[role] = self._snapshot(now, role)[0]
            self._queues[role] = saved
        return PdSnapshot(
            prefill=roles[PREFILL],
            decode=roles[DECODE],
            router_queue=held,
            router_slo=SloCounts.from_outcomes(self._outcomes),
        )

    def _sync(self, now: float) -> None:
        current = (len(self._active(PREFILL)), len(self._active(DECODE)))
        desired = self.pd_policy.decide(now, current, self.pd_snapshot(now))
        if desired != current:
            self.scale_events += 1
            self._scale_to(now, desired[0], PREFILL)
            self._scale_to(now, desired[1], DECODE)

    def run(self) -> SimResult:
        p, d = self.pd_policy.initial_replicas()
        for _ in range(max(0, p)):
            self._add_replica(0.0, ready_now=True, role=PREFILL)
        for _ in range(max(0, d)):
            self._add_replica(0.0, ready_now=True, role=DECODE)
        result = super().run()
        result.policy = self.pd_policy.name
        t = self.transfers
        result.settings["router"] = {role: r.name for role, r in self.routers.items()}
        result.settings["disaggregation"] = {
            "min_prompt_tokens": self.min_prompt_tokens,
            "kv_bytes_per_token": self.cal.kv_bytes_per_token,
            "kv_link_bytes_s": self.cal.kv_link_bytes_s,
            "transfers": t.transfers,
            "direct": t.direct,
            "transfer_gb": round(t.bytes / 1e9, 3),
            "transfer_s_mean": round(t.seconds / t.transfers, 5) if t.transfers else 0.0,
            "transfer_s_per_1k_prompt_tokens": (
                round(1000.0 * t.seconds / t.prompt_tokens, 6) if t.prompt_tokens else 0.0
            ),
        }
        result.settings["role_replica_hours"] = self.role_replica_hours(result.window_s)
        return result

    def role_replica_hours(self, window: tuple[float, float]) -> dict[str, float]:
        w0, t_end = window
        out: dict[str, float] = {PREFILL: 0.0, DECODE: 0.0}
        for rep in self.replicas:
            start = max(rep.created, w0)
            stop = min(rep.gone_at if rep.gone_at is not None else t_end, t_end)
            out[rep.role] += max(0.0, stop - start) / 3600.0
        return {k: round(v, 4) for k, v in out.items()}


def simulate_pd(
    trace: Sequence[TraceRequest],
    policy: PdFleetPolicy,
    calibration: Calibration | None = None,
    **kwargs: Any,
) -> SimResult:
    return PdFleetSimulator(trace, policy, calibration, **kwargs).run()


def best_static_split(
    trace: Sequence[TraceRequest],
    calibration: Calibration | None,
    total: int,
    **kwargs: Any,
) -> tuple[Sizes, SimResult]:
    """The fixed P/D fleet of `total` replicas with the highest SLO attainment on this trace (every
    split from 1 prefill up to total - 1; ties to the fewer prefill replicas). kwargs: simulate_pd's;
    `prefill_router_factory` / `decode_router_factory` make fresh routers for each run."""
    if total < 2:
        raise ValueError("a P/D fleet needs at least 2 replicas")
    pf = kwargs.pop("prefill_router_factory", None)
    df = kwargs.pop("decode_router_factory", None)
    best: tuple[Sizes, SimResult] | None = None
    for p in range(1, total):
        extra = {}
        if pf is not None:
            extra["prefill_router"] = pf()
        if df is not None:
            extra["decode_router"] = df()
        r = simulate_pd(trace, PdStaticPolicy(p, total - p), calibration, **kwargs, **extra)
        if best is None or r.slo_attainment > best[1].slo_attainment + 1e-12:
            best = ((p, total - p), r)
    assert best is not None
    return best


__all__ = [
    "PdFleetPolicy",
    "PdFleetSimulator",
    "PdStaticPolicy",
    "TransferStats",
    "best_static_split",
    "pulled_tokens",
    "simulate_pd",
]
