"""The fleet simulator for a disaggregated model: a prefill pool and a decode pool (docs/disaggregation.md).

A request whose prompt has at least `min_prompt_tokens` tokens (spec.disaggregation.minPromptTokens)
goes to the prefill pool as the router sends it there: the same prompt with one output token
(`max_tokens: 1`). A prefill replica is the simulator's ordinary engine (sim_replica.Replica) running
only such requests: chunked prefill, never a decode step of someone else's. When its prompt is done the
request is handed to the decode pool: the decode router picks a replica (or the decode central queue
holds it), the replica pulls the KV blocks it lacks, and the request joins its queue with that KV in
place. The pull covers every full KV block but the one holding the last prompt token, less the
leading blocks the decode replica's prefix cache already holds: bytes = tokens x
calibration.kv_bytes_per_token. The pulls run as the runtime runs them (pd_link.py): all at once,
sharing the decode replica's link (calibration.kv_link_bytes_s) equally, within the pod's pull budget
and the transfer deadline (a pull past it falls back: the decode replica computes the whole prompt).
The decode replica computes the remaining prompt tokens itself and samples the first token, so TTFT is
arrival -> the first token of the decode replica, as the router measures it. Shorter prompts, and
every prompt while no prefill replica is Ready, go straight to the decode pool (the router's direct
path; the long ones counted as the router counts them, path="no_prefill") and run there like on an
aggregated replica.

Measured as the parts measure it: each decode replica's pull counters (ReplicaSample.kv_transfer_*,
the runtime's kvpilot_kv_transfer_seconds and bytes received) and the router's P/D counters
(PdSnapshot.router_pd: the prefill leg's seconds, the long prompts sent direct, the held requests
that still need a prefill replica). The result's
settings["disaggregation"] has the TTFT breakdown of the disaggregated requests (prefill leg, pull,
decode admission and first step), overall and over those that missed their TTFT target.

Not modelled: the prefill replica's blocks are freed at once (the real one pins them until the pull,
a transfer time); the prefill pod's own NIC (the decode side's is the one that queues when decode
pods are fewer than prefill pods, as a P/D fleet sized for prefill compute has); transfers fail only
by their deadline or size. The router's choice of pods runs the fleet router's policy code in each
pool (sim_routing), and the prefill/direct split is the one-line threshold of docs/disaggregation.md.

The policy sees one PdSnapshot per sync (each role's pods as the controller reads them by their
kvpilot.dev/kv-role label, the requests the router holds, its SLO counter) and returns both roles'
sizes at once (pd_policy.decide_pd behind PdKvpilotPolicy, or a fixed PdStaticPolicy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvpilot.api.models import DEFAULT_KV_TRANSFER_TIMEOUT_S, DEFAULT_PD_MIN_PROMPT_TOKENS
from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.pd_link import Link, Pull
from kvpilot.autoscaler.pd_policy import DECODE, PREFILL, PdSnapshot
from kvpilot.autoscaler.pd_signals import RouterPdCounts
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sim_replica import Replica, RequestView, SimRequest
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
    seconds: float = 0.0  # sum of pull times (sharing and waiting for the link included)
    prompt_tokens: int = 0  # of the transferred requests
    direct: int = 0  # requests that skipped the prefill pool
    no_prefill: int = 0  # of those, long prompts: no prefill replica was Ready
    fallbacks: int = 0  # pulls past their deadline (or too large): the decode replica recomputed
    # The router's P/D counters: the prefill leg (arrival -> the prefill replica's answer)
    prefill_seconds: float = 0.0
    prefill_legs: int = 0


@dataclass
class _Stages:
    """One disaggregated request's TTFT stages (arrival -> prefill answered -> pull done -> first token)."""

    prefilled: float
    pulled: float | None = None


@dataclass
class _Breakdown:
    """Mean stage seconds over disaggregated requests (settings["disaggregation"]["ttft_breakdown"])."""

    n: int = 0
    prefill: float = 0.0
    transfer: float = 0.0
    decode: float = 0.0
    by: dict[str, float] = field(default_factory=dict)

    def add(self, arrival: float, st: _Stages, first: float) -> None:
        pulled = st.pulled if st.pulled is not None else st.prefilled
        self.n += 1
        self.prefill += st.prefilled - arrival
        self.transfer += pulled - st.prefilled
        self.decode += first - pulled

    def means(self) -> dict[str, float]:
        n = max(1, self.n)
        return {
            "requests": self.n,
            "prefill_leg_s": round(self.prefill / n, 4),
            "transfer_s": round(self.transfer / n, 4),
            "decode_admission_and_first_step_s": round(self.decode / n, 4),
        }


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
        transfer_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S,
        prefill_router: Router | None = None,
        decode_router: Router | None = None,
        **kwargs: Any,
    ) -> None:
        if min_prompt_tokens < 0:
            raise ValueError("min_prompt_tokens must be >= 0")
        if not 0.0 < transfer_timeout_s < math.inf:
            raise ValueError("transfer_timeout_s must be > 0")
        super().__init__(trace, _Named(policy), calibration, router=decode_router or RoundRobin(), **kwargs)
        self.pd_policy = policy
        self.min_prompt_tokens = min_prompt_tokens
        self.transfer_timeout_s = transfer_timeout_s
        self.routers = {PREFILL: prefill_router or RoundRobin(), DECODE: self.router}
        self._queues = {PREFILL: self._queues[BOTH], DECODE: type(self._queues[BOTH])()}
        self._jobs: dict[int, SimRequest] = {}  # id(prefill request) -> the client's request
        self._links: dict[int, Link[tuple[SimRequest, int]]] = {}  # decode replica id -> its link
        self._kv_on_the_way: set[int] = set()  # id() of requests whose KV a decode replica will pull
        self._stages: dict[int, _Stages] = {}  # id() of a disaggregated request -> its stages
        self.transfers = TransferStats()
        self._measured: Sequence[SimRequest] = ()

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
        self.transfers.no_prefill += long
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

    def _offer(self, req: SimRequest, ready: list[Replica], role: str = BOTH) -> Replica | None:
        if role != DECODE or not self._links:
            return super()._offer(req, ready, role)
        # The router counts a request in flight on its decode pod from the moment it sends it: the
        # pull runs inside that request, so the requests still pulling are the pod's load too.
        view = RequestView(req.prompt, req.output, req.hash_ids)
        views = []
        for r in ready:
            v, link = r.view(req), self._links.get(r.rid)
            views.append(replace(v, waiting=v.waiting + link.in_flight) if link is not None else v)
        idx = self.routers[role](view, views)
        return None if idx is None else ready[idx]

    def _link(self, rep: Replica) -> Link[tuple[SimRequest, int]]:
        link = self._links.get(rep.rid)
        if link is None:
            budget = self.cal.kv_capacity_tokens * self.cal.kv_bytes_per_token  # the runtime's pull budget
            link = self._links[rep.rid] = Link(self.cal.kv_link_bytes_s, budget)
        return link

    def _assign(self, rep: Replica, req: SimRequest, now: float) -> bool:
        if id(req) not in self._kv_on_the_way:
            return super()._assign(rep, req, now)
        # A handed-over request: the decode replica pulls what it lacks, then queues it.
        self._kv_on_the_way.discard(id(req))
        pulled = pulled_tokens(req.prompt, self.cal.block_size)
        hit = min(rep.prefix_hit(req.hash_ids) * HASH_BLOCK_TOKENS, req.prompt - 1) if req.hash_ids else 0
        sent = max(0, pulled - hit)
        have = max(pulled, hit)
        if sent == 0:  # its prefix cache holds every block: nothing to pull
            return self._pulled(rep, req, have, now)
        link = self._link(rep)
        self._settle(rep, link, now)
        t = self.transfers
        t.transfers += 1
        t.bytes += sent * self.cal.kv_bytes_per_token
        t.prompt_tokens += req.prompt
        pull = Pull((req, have), sent * self.cal.kv_bytes_per_token, now, now + self.transfer_timeout_s)
        if not link.start(pull):
            t.fallbacks += 1
            return self._pulled(rep, req, 0, now)
        self._next_link_event(rep, link)
        return True

    def _next_link_event(self, rep: Replica, link: Link[tuple[SimRequest, int]]) -> None:
        link.version += 1
        t = link.next_event()
        if t is not None:
            self._push(t, _HANDOFF, rep.rid, link.version)

    def _settle(self, rep: Replica, link: Link[tuple[SimRequest, int]], now: float) -> None:
        """Bring the link to `now`: the pulls done join the replica's queue, the late ones fall back."""
        done, late = link.advance(now)
        for p in done:
            req, have = p.key
            self.transfers.seconds += now - p.started
            self._pulled(rep, req, have, now)
        for p in late:
            req, _ = p.key
            self.transfers.seconds += now - p.started
            self.transfers.fallbacks += 1
            self._pulled(rep, req, 0, now)

    def _pulled(self, rep: Replica, req: SimRequest, have: int, now: float) -> bool:
        st = self._stages.get(id(req))
        if st is not None:
            st.pulled = now
        if rep.gone_at is not None:  # the decode replica left meanwhile: the router sends it again,
            req.computed = 0  # and the next decode replica recomputes the prompt (the fallback)
            self._route(req, now, DECODE)
            return True
        if have:
            rep.remember_prefix(req.hash_ids)
        req.computed = have  # 0: the fallback, the whole prompt computed here
        req.prefill_target = req.prompt
        return super()._assign(rep, req, now)

    def _handoff(self, now: float, a: int, b: int) -> None:
        rep = self.replicas[a]
        link = self._links[a]
        if b != link.version:
            return
        self._settle(rep, link, now)
        self._next_link_event(rep, link)
        if rep.draining and rep.gone_at is None and not link.in_flight and not rep.busy and not rep.in_flight:
            super()._retire(rep, now)

    def _retire(self, rep: Replica, now: float) -> None:
        link = self._links.get(rep.rid)
        if link is not None and link.in_flight and rep.ready:
            return  # pulls in flight: their requests' handlers hold the draining pod until they land
        super()._retire(rep, now)

    def _finished(self, rep: Replica, done: list[SimRequest], now: float) -> None:
        if rep.role != PREFILL:
            super()._finished(rep, done, now)
            return
        for job in done:
            req = self._jobs.pop(id(job))
            req.cached_tokens = job.cached_tokens
            self.transfers.prefill_seconds += now - req.arrival
            self.transfers.prefill_legs += 1
            self._stages[id(req)] = _Stages(now)
            self._kv_on_the_way.add(id(req))
            self._route(req, now, DECODE)

    def _reject(self, r: SimRequest) -> None:
        super()._reject(self._jobs.pop(id(r), r))

    # -- scaling -------------------------------------------------------------------------------------

    def pd_snapshot(self, now: float) -> PdSnapshot:
        """Each role's pods as the controller reads them (the router's queues are not spread over
        them: the router reports its held requests, PdSnapshot.router_queue)."""
        for rid, link in self._links.items():  # the counters as of now
            rep = self.replicas[rid]
            if rep.gone_at is None:
                self._settle(rep, link, now)
                self._next_link_event(rep, link)
        roles: dict[str, MetricsSnapshot] = {}
        held = 0
        # What the router reports of its held requests that still need a prefill pod
        # (kvpilot_router_pd_queued{path="prefill"}): the prefill pool's held jobs, and the long
        # prompts held for a decode replica whose prefill has not run (sent direct for lack of a
        # prefill replica; the handed-over ones have their stages).
        held_prefill = len(self._queues[PREFILL]) + sum(
            1
            for r in self._queues[DECODE]
            if r.prompt >= self.min_prompt_tokens and id(r) not in self._stages
        )
        for role in (PREFILL, DECODE):
            queue = self._queues[role]
            held += len(queue)
            saved, self._queues[role] = queue, type(queue)()
            roles[role] = self._snapshot(now, role)[0]
            self._queues[role] = saved
        # The decode pods' pull counters, as the runtime exports them.
        samples = []
        for sample in roles[DECODE].samples:
            pulls = self._links.get(int(sample.pod[1:]))
            samples.append(
                replace(
                    sample,
                    kv_transfer_seconds_total=pulls.seconds_total if pulls else 0.0,
                    kv_transfers_total=float(pulls.pulls_total) if pulls else 0.0,
                    kv_transfer_bytes_total=pulls.bytes_total if pulls else 0.0,
                )
            )
        t = self.transfers
        return PdSnapshot(
            prefill=roles[PREFILL],
            decode=replace(roles[DECODE], samples=tuple(samples)),
            router_queue=held,
            router_slo=SloCounts.from_outcomes(self._outcomes),
            startup_s=self.measured_startup_s((PREFILL, DECODE)),  # over the model's pods, as pd_controller
            router_pd=RouterPdCounts(
                t.prefill_seconds, float(t.prefill_legs), float(t.no_prefill), float(held_prefill)
            ),
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
            "transfer_timeout_s": self.transfer_timeout_s,
            "transfers": t.transfers,
            "direct": t.direct,
            "direct_no_prefill": t.no_prefill,
            "transfer_fallbacks": t.fallbacks,
            **self._breakdowns(result.window_s[0]),
            "transfer_gb": round(t.bytes / 1e9, 3),
            "transfer_s_mean": round(t.seconds / t.transfers, 5) if t.transfers else 0.0,
            "transfer_s_per_1k_prompt_tokens": (
                round(1000.0 * t.seconds / t.prompt_tokens, 6) if t.prompt_tokens else 0.0
            ),
        }
        result.settings["role_replica_hours"] = self.role_replica_hours(result.window_s)
        return result

    def _result(self, requests: Sequence[SimRequest], t_end: float) -> SimResult:
        self._measured = requests
        return super()._result(requests, t_end)

    def _breakdowns(self, w0: float) -> dict[str, dict[str, float]]:
        """The TTFT stages of the disaggregated requests measured (arrival >= w0): all, and those
        that missed their TTFT target."""
        every, missed = _Breakdown(), _Breakdown()
        for req in self._measured:
            st = self._stages.get(id(req))
            if st is None or req.first_token is None or req.arrival < w0:
                continue
            every.add(req.arrival, st, req.first_token)
            if self._judge(req) in ("missed_ttft", "failed"):
                missed.add(req.arrival, st, req.first_token)
        return {"ttft_breakdown": every.means(), "ttft_breakdown_missed": missed.means()}

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
