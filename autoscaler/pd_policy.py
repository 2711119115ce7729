"""The P/D policy: both roles of a disaggregated model sized in one decision. Pure; the controller
(pd_controller.py) and the P/D fleet simulator (pd_simulator.py) call the same function.

decide_pd((prefill, decode), PdSnapshot, PdTargets, PdState, now) -> PdDecision

Per role, its own signals (docs/disaggregation.md, "Autoscaler"):
- **decode** pods run every request's decode steps (and the short prompts the router sends them
  directly): they are sized by policy.decide(), the aggregated policy, on the decode pods alone: KV
  use and batch slots against the target, the queue, the request arrival rate at the measured
  per-replica service rate; its stabilization, rate limits and scale from zero. (The SLO planner's
  replica model is an aggregated replica's, so it is off for the role; the closed loop below is the
  role's SLO signal.)
  Also by their **KV link** (pd_decode.py): every handed-over request's KV is pulled over a decode
  pod's NIC, so the bytes/s the decode pods receive over the link's measured bandwidth at
  DEFAULT_LINK_TARGET_UTILIZATION is a decode demand of its own (signal "KV link"); the role's demand
  is the larger of its KV-use demand and its link demand.
- **prefill** pods are sized by their prompt token rate and backlog over the measured per-replica
  prefill throughput (pd_prefill.py); the router's held requests count toward their backlog only
  when they still need a prefill pod (kvpilot_router_pd_queued{path="prefill"}; a router without it:
  all it holds), since the router's queue is in front of the decode pool and short prompts skip the
  prefill pool; at zero, such a held request or a long prompt served direct for lack of a prefill
  pod (pd_signals.py) wakes them.

Joint:
1. **Measured attainment per role** (spec.autoscaling.slo, the router's SLO counter; feedback.py's
   rules, in a per-role view of the same measurement): TPOT misses are the decode role's, failed
   requests both's, and TTFT misses go to the stage that caused them by the **TTFT breakdown**
   (pd_decode.attribute_ttft): the disaggregated requests' TTFT wait is split between the pulls
   (past their bare time over the link) and the prefill leg (past the mean prompt at the prefill
   throughput), smoothed; when the pulls' share is more than half, the TTFT misses are the decode
   role's, else the prefill role's (and the prefill role's until a breakdown is measured). A role whose
   own misses exceed the budget grows (feedback.evaluate's step) and may shrink only with headroom
   in its view; when the misses together exceed the budget but neither role's alone does, the role
   with more of them takes the step.
2. **The P:D ratio** (prefill replicas per decode replica) is learned from measured saturation: at
   every sync where both roles carry load (each at least MIN_RATIO_DEMAND replicas of demand), the
   prefill demand (its token rate over its measured throughput at target) over the decode demand
   (reporting decode replicas x utilization / target) is one sample, smoothed (RATIO_SMOOTHING). Once
   MIN_RATIO_SAMPLES are in, a growing prefill role brings the decode role along: the load reaching
   prefill now reaches decode a TTFT later, so decode is asked for at least prefill demand / ratio in
   the same decision (signal "P:D ratio"). Only that direction: decode load that grows by itself
   (short direct requests, longer outputs) needs no prefill. The ratio is in the status, so a
   restarted autoscaler keeps it.
3. **Scale from zero of both**: a request held by the router wakes the roles it needs (every held
   request decode: decide() wakes it; one that needs a prefill pod prefill too: the prefill rule
   wakes it); a prefill role above zero keeps at least one decode replica (every
   request ends on one).
4. Each role is clamped to its [minReplicas, maxReplicas] (spec.disaggregation.<role>, else
   spec.autoscaling's).
The reason names the winning signal per role: `prefill 2 -> 3: ... [signal: token rate]; decode ...`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.api.models import KV_ROLES
from kvpilot.autoscaler.attainment import SloCounts, window
from kvpilot.autoscaler.feedback import Feedback, SloState, evaluate, feedback_settings, record_interval
from kvpilot.autoscaler.pd_decode import (
    DEFAULT_LINK_TARGET_UTILIZATION,
    LinkDecision,
    LinkState,
    TtftState,
    attribute_ttft,
    bare_prefill_s,
    decide_link,
    long_prompts_direct,
)
from kvpilot.autoscaler.pd_prefill import (
    DEFAULT_PREFILL_TARGET_UTILIZATION,
    PrefillDecision,
    PrefillState,
    decide_prefill,
)
from kvpilot.autoscaler.pd_signals import RouterPdCounts, held_for_prefill
from kvpilot.autoscaler.policy import Decision, History, decide
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.spec import Behavior, ScalingTargets

PREFILL, DECODE = KV_ROLES
MIN_RATIO_DEMAND = 0.25  # replicas of demand each role needs before a ratio sample counts
MIN_RATIO_SAMPLES = 3
RATIO_SMOOTHING = 0.2  # weight of a new sample
RATIO_BOUNDS = (0.02, 50.0)
_EPS = 1e-9


@dataclass(frozen=True)
class PdSnapshot:
    """Everything the P/D policy knows at one sync: each role's pods (selected by kvpilot.dev/kv-role)
    and what the router reports for the model."""

    prefill: MetricsSnapshot
    decode: MetricsSnapshot
    router_queue: int | None = None  # requests the router holds for the model
    router_slo: SloCounts | None = None  # the routers' SLO counter (cumulative, by outcome)
    startup_s: float | None = None  # measured over the model's pods; None: declared or unknown
    scaling_limited: bool = False
    router_pd: RouterPdCounts | None = None  # the routers' P/D counters (cumulative; pd_signals.py)


@dataclass(frozen=True)
class PdTargets:
    base: ScalingTargets  # spec.autoscaling: targets, behavior, the SLO (slo.calibration, slo.slo)
    prefill_min: int
    prefill_max: int
    decode_min: int
    decode_max: int
    prefill_target_utilization: float = DEFAULT_PREFILL_TARGET_UTILIZATION
    ratio_coupling: bool = True
    link_target_utilization: float = DEFAULT_LINK_TARGET_UTILIZATION

    def __post_init__(self) -> None:
        for role, lo, hi in (
            (PREFILL, self.prefill_min, self.prefill_max),
            (DECODE, self.decode_min, self.decode_max),
        ):
            if lo < 0 or hi < max(1, lo):
                raise ValueError(
                    f"spec.disaggregation.{role}: need 0 <= minReplicas <= maxReplicas, maxReplicas >= 1"
                )
        if not 0.0 < self.prefill_target_utilization <= 1.0:
            raise ValueError("prefill_target_utilization must be in (0, 1]")
        if not 0.0 < self.link_target_utilization <= 1.0:
            raise ValueError("link_target_utilization must be in (0, 1]")

    def role_targets(self, role: str) -> ScalingTargets:
        lo, hi = (
            (self.prefill_min, self.prefill_max) if role == PREFILL else (self.decode_min, self.decode_max)
        )
        # No redundancy rule per role (redundancy.py): a role's spare is its own minReplicas
        # (spec.disaggregation.ROLE.minReplicas); on the P/D goal row it would hold a second decode
        # pod for 96% of the aggregated fleet's replica-hours instead of 85% (docs/autoscaler.md).
        behavior = replace(self.base.behavior, redundancy_replicas=1)
        return self.base.with_overrides(min_replicas=lo, max_replicas=hi, slo=None, behavior=behavior)

    @classmethod
    def from_spec(
        cls,
        autoscaling: Mapping[str, Any],
        disaggregation: Mapping[str, Any],
        behavior: Behavior | None = None,
        max_num_seqs: int | None = None,
    ) -> PdTargets:
        """From spec.autoscaling and spec.disaggregation (camelCase, as stored)."""
        base = ScalingTargets.from_spec(autoscaling, behavior, max_num_seqs=max_num_seqs)

        def bounds(role: str) -> tuple[int, int]:
            block = disaggregation.get(role) or {}
            lo, hi = block.get("minReplicas"), block.get("maxReplicas")
            return (
                base.min_replicas if lo is None else int(lo),
                base.max_replicas if hi is None else int(hi),
            )

        (pl, ph), (dl, dh) = bounds(PREFILL), bounds(DECODE)
        return cls(base, pl, ph, dl, dh)


@dataclass(frozen=True)
class PdState:
    """What the P/D policy remembers between syncs (status.autoscaler: the decode role's History in the
    aggregated fields, the rest in status.autoscaler.disaggregation)."""

    decode: History = field(default_factory=History)
    prefill: PrefillState = field(default_factory=PrefillState)
    slo: SloState = field(default_factory=SloState)  # the router's SLO counter, measured once for both
    prefill_fresh_since: float | None = None  # each role's last feedback step takes effect from here
    decode_fresh_since: float | None = None
    ratio: float | None = None  # prefill replicas per decode replica, learned
    ratio_samples: int = 0
    link: LinkState = field(default_factory=LinkState)  # the decode pods' KV link (pd_decode.py)
    ttft: TtftState = field(default_factory=TtftState)  # the TTFT breakdown (pd_decode.py)


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    recommendation: int  # the role's own raw recommendation
    demand: float | None  # replicas its load needs at its target (fractional), when known
    signal: str
    text: str


@dataclass(frozen=True)
class PdDecision:
    prefill: RoleDecision
    decode: RoleDecision
    decode_decision: Decision  # policy.decide() on the decode pods (its history is the decode role's)
    prefill_decision: PrefillDecision
    link_decision: LinkDecision
    state: PdState
    reason: str
    attainment: float | None = None  # over the window, both roles together; None: unknown
    attainment_requests: float = 0.0
    attainment_window_s: float = 0.0

    @property
    def current(self) -> tuple[int, int]:
        return self.prefill.current, self.decode.current

    @property
    def desired(self) -> tuple[int, int]:
        return self.prefill.desired, self.decode.desired


def role_counts(c: SloCounts, role: str, decode_ttft_share: float = 0.0) -> SloCounts:
    """The outcomes as one role answers for them: its own misses (TPOT: decode; TTFT: the decode role
    `decode_ttft_share` of them, the prefill role the rest) and the failed requests; the other role's
    misses count as met here."""
    to_decode = c.missed_ttft * decode_ttft_share
    if role == PREFILL:
        return SloCounts(
            met=c.met + c.missed_tpot + to_decode, missed_ttft=c.missed_ttft - to_decode, failed=c.failed
        )
    return SloCounts(
        met=c.met + c.missed_ttft - to_decode,
        missed_ttft=to_decode,
        missed_tpot=c.missed_tpot,
        failed=c.failed,
    )


def role_view(
    state: SloState, role: str, fresh_since: float | None, decode_ttft_share: float = 0.0
) -> SloState:
    """The measurement as `role` answers for it (role_counts); the measured capacity bounds are the
    prefill throughput's (tokens/s per replica), so the decode view starts without them and its result
    is not kept."""
    return replace(
        state,
        intervals=tuple(
            replace(i, counts=role_counts(i.counts, role, decode_ttft_share)) for i in state.intervals
        ),
        fresh_since=fresh_since,
        capacity_floor=state.capacity_floor if role == PREFILL else None,
        floor_capacity=state.floor_capacity if role == PREFILL else None,
        capacity_ceiling=state.capacity_ceiling if role == PREFILL else None,
    )


def decode_demand(d: Decision, target: float) -> float | None:
    if not d.reporting or d.avg_utilization is None:
        return None
    return d.reporting * d.avg_utilization / target


def learn_ratio(
    ratio: float | None, samples: int, prefill_demand: float | None, decode_demand_: float | None
) -> tuple[float | None, int]:
    """The P:D ratio after this sync's measurement (module doc, 2)."""
    if (
        prefill_demand is None
        or decode_demand_ is None
        or prefill_demand < MIN_RATIO_DEMAND
        or decode_demand_ < MIN_RATIO_DEMAND
    ):
        return ratio, samples
    sample = min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], prefill_demand / decode_demand_))
    new = sample if ratio is None else RATIO_SMOOTHING * sample + (1.0 - RATIO_SMOOTHING) * ratio
    return new, samples + 1


def _last_up(events: Any) -> float | None:
    return max((e.time for e in events if e.to_replicas > e.from_replicas), default=None)


def decide_pd(
    current: tuple[int, int],
    snapshot: PdSnapshot,
    targets: PdTargets,
    state: PdState,
    now: float,
) -> PdDecision:
    """Both roles' sizes, the reason, and the state for the next call (module doc)."""
    cur_p, cur_d = current
    base = targets.base
    b = base.behavior
    startup = snapshot.startup_s if snapshot.startup_s is not None else base.startup_s
    router_queue = snapshot.router_queue or 0
    # The router's queue is in front of the decode pool: all of it is decode's, only what still needs
    # a prefill pod is prefill's (short prompts skip the prefill pool; pd_signals.py).
    prefill_queue = held_for_prefill(snapshot.router_queue, snapshot.router_pd)

    # Decode: the aggregated policy on the decode pods.
    dsnap = replace(
        snapshot.decode,
        router_queue=snapshot.router_queue,
        startup_s=startup,
        scaling_limited=snapshot.scaling_limited,
    )
    dd = decide(cur_d, dsnap, targets.role_targets(DECODE), state.decode, now)
    # Prefill: the token rate and backlog over the measured throughput.
    cal = base.slo.calibration if base.slo is not None else None
    pf = decide_prefill(
        cur_p,
        snapshot.prefill,
        prefill_queue,
        targets.role_targets(PREFILL),
        state.prefill,
        now,
        startup=startup,
        calibration=cal,
        target_utilization=targets.prefill_target_utilization,
        ttft_s=base.slo.ttft_s if base.slo is not None else 2.0,
        slo_state=state.slo,
        direct_long=long_prompts_direct(state.ttft, snapshot.router_pd),
    )
    # Decode's KV link, and the TTFT breakdown that splits TTFT misses between the roles.
    lk = decide_link(
        cur_d,
        snapshot.decode,
        targets.role_targets(DECODE),
        state.link,
        state.decode.events,  # the role's scale events before this sync
        now,
        startup=startup,
        calibration=cal,
        target_utilization=targets.link_target_utilization,
    )
    bare = bare_prefill_s(pf.state.mean_prompt, pf.throughput)
    ttft_state, wait_share = attribute_ttft(state.ttft, snapshot.router_pd, now, lk, bare)
    # The stage whose wait dominates answers for the TTFT misses (a wait well within the target is
    # no cause of a miss: the misses are not split in proportion).
    decode_share = 1.0 if wait_share > 0.5 else 0.0
    want = {PREFILL: pf.desired, DECODE: dd.desired}
    signal = {PREFILL: pf.signal, DECODE: dd.signal}
    extra: dict[str, list[str]] = {PREFILL: [], DECODE: []}
    if lk.desired is not None and lk.desired > want[DECODE]:
        want[DECODE], signal[DECODE] = lk.desired, "KV link"
        extra[DECODE].append(lk.text)
    ready = {PREFILL: snapshot.prefill.ready_replicas, DECODE: snapshot.decode.ready_replicas}
    cur = {PREFILL: cur_p, DECODE: cur_d}
    fresh = {PREFILL: state.prefill_fresh_since, DECODE: state.decode_fresh_since}

    # 1. The closed loop, per role.
    slo_state = state.slo
    attainment, att_requests, att_window = None, 0.0, 0.0
    if base.slo is not None and b.slo_feedback:
        # A backlog on either role's pods or at the router (the aggregated policy's test per role):
        # its misses say the fleet was short for a while, which the queue rules answer.
        backlog = router_queue > 0 or any(
            s.total_waiting > base.target_queue_depth * max(1, s.reporting)
            for s in (snapshot.prefill, snapshot.decode)
        )
        # The intervals' load is the prefill role's (prompt tokens/s per Ready prefill replica): the
        # loop's capacity correction (feedback.py, rule 2) applies to the prefill throughput.
        load = pf.token_rate / ready[PREFILL] if pf.token_rate is not None and ready[PREFILL] else None
        slo_state = record_interval(
            state.slo, now, snapshot.router_slo, {}, {}, load, b.attainment_window_s, backlog
        )
        p_capacity = (
            pf.throughput * targets.prefill_target_utilization
            if pf.throughput and pf.demand is not None
            else None
        )
        settings = feedback_settings(base.slo, b)
        settle = startup if startup is not None else b.arrival_lead_s
        last_up = {PREFILL: _last_up(pf.state.events), DECODE: _last_up(dd.history.events)}
        fbs: dict[str, Feedback] = {}
        for role in KV_ROLES:
            fbs[role] = evaluate(
                role_view(slo_state, role, fresh[role], decode_share), now, cur[role], ready[role],
                settings, p_capacity if role == PREFILL else None, settle, last_up[role],
            )  # fmt: skip
        slo_state = replace(
            slo_state,
            capacity_floor=fbs[PREFILL].state.capacity_floor,
            floor_capacity=fbs[PREFILL].state.floor_capacity,
            capacity_ceiling=fbs[PREFILL].state.capacity_ceiling,
        )
        if all(fbs[r].recommendation is None for r in KV_ROLES):
            # Together over the budget, neither alone: the role with more misses takes the step.
            w = window(slo_state.intervals, now, b.attainment_window_s).counts
            decode_misses = w.missed_tpot + w.missed_ttft * decode_share
            role = PREFILL if w.missed_ttft - w.missed_ttft * decode_share > decode_misses else DECODE
            joint = evaluate(
                replace(slo_state, fresh_since=fresh[role], capacity_floor=None, capacity_ceiling=None),
                now, cur[role], ready[role], settings, None, settle, last_up[role],
            )  # fmt: skip
            if joint.recommendation is not None:
                fbs[role] = replace(joint, allow_scale_down=False)
        whole = window(slo_state.intervals, now, b.attainment_window_s)
        attainment, att_requests, att_window = whole.counts.attainment, whole.counts.total, whole.seconds
        for role in KV_ROLES:
            fb = fbs[role]
            fresh[role] = fb.state.fresh_since
            if fb.recommendation is not None and fb.recommendation > want[role]:
                want[role] = fb.recommendation
                signal[role] = "measured attainment"
                extra[role].append(fb.text)
                if decode_share > 0.0:
                    extra[role].append(
                        f"TTFT misses are decode's (KV pull waits {wait_share:.0%} of the wait)"
                    )
            elif want[role] < cur[role] and not fb.allow_scale_down:
                want[role] = cur[role]
                signal[role] = "attainment unknown" if fb.attainment is None else "attainment headroom"
                extra[role].append(f"scale-down held: {fb.text}")

    # 2. The P:D ratio.
    d_demand = decode_demand(dd, base.target_kv_cache_utilization)
    if lk.demand is not None and (d_demand is None or lk.demand > d_demand):
        d_demand = lk.demand
    ratio, samples = learn_ratio(state.ratio, state.ratio_samples, pf.demand, d_demand)
    if (
        targets.ratio_coupling
        and ratio is not None
        and samples >= MIN_RATIO_SAMPLES
        and want[PREFILL] > cur_p
        and pf.demand is not None
    ):
        floor = math.ceil(pf.demand / ratio - _EPS)
        if floor > want[DECODE] and floor > cur_d:
            want[DECODE] = floor
            signal[DECODE] = "P:D ratio"
            extra[DECODE].append(f"prefill demand {pf.demand:.2f} / P:D ratio {ratio:.2f} -> {floor}")

    # 3. Both from zero (a role the held requests need); every request ends on a decode replica.
    held = {PREFILL: prefill_queue, DECODE: router_queue}
    if cur_p == 0 and cur_d == 0:
        for role in KV_ROLES:
            if held[role] and want[role] < 1:
                want[role], signal[role] = 1, "scale from zero"
    if want[PREFILL] > 0 and want[DECODE] < 1:
        want[DECODE], signal[DECODE] = 1, "prefill needs a decode replica"
        extra[DECODE].append("every request ends on a decode replica")

    # 4. Limits.
    if snapshot.scaling_limited:
        for role in KV_ROLES:
            if want[role] > cur[role]:
                extra[role].append(f"ScalingLimited (pods unschedulable): holding {cur[role]}")
                want[role] = cur[role]
    bounds = {
        PREFILL: (targets.prefill_min, targets.prefill_max),
        DECODE: (targets.decode_min, targets.decode_max),
    }
    for role in KV_ROLES:
        lo, hi = bounds[role]
        clamped = min(max(want[role], lo), hi)
        if clamped != want[role]:
            extra[role].append(
                f"clamped to {'minReplicas' if clamped > want[role] else 'maxReplicas'} {clamped}"
            )
            want[role] = clamped

    texts = {PREFILL: pf.text + f" [signal: {pf.signal}]", DECODE: dd.reason}
    first = {PREFILL: pf.signal, DECODE: dd.signal}
    recs = {PREFILL: pf.recommendation, DECODE: max(dd.recommendation, lk.recommendation or 0)}
    demands = {PREFILL: pf.demand, DECODE: d_demand}
    roles = {}
    parts = []
    for role in KV_ROLES:
        text = texts[role] + "".join(f"; {e}" for e in extra[role])
        roles[role] = RoleDecision(role, cur[role], want[role], recs[role], demands[role], signal[role], text)
        verb = f"{cur[role]} -> {want[role]}" if want[role] != cur[role] else f"{cur[role]} (hold)"
        if signal[role] != first[role]:
            text += f" [signal: {signal[role]}]"
        parts.append(f"{role} {verb}: {text}")
    if ratio is not None:
        parts.append(f"P:D ratio {ratio:.2f} ({samples} samples)")
    ts = ttft_state
    if ts.decode_share is not None:
        waits = ""
        if ts.prefill_wait_s is not None and ts.transfer_wait_s is not None:
            waits = f" (last: prefill {ts.prefill_wait_s:.2f} s, pull {ts.transfer_wait_s:.2f} s)"
        whose = "decode's" if decode_share else "prefill's"
        parts.append(f"TTFT wait {ts.decode_share:.0%} in KV pulls{waits}: TTFT misses {whose}")
    new_state = PdState(
        decode=dd.history,
        prefill=pf.state,
        slo=slo_state,
        prefill_fresh_since=fresh[PREFILL],
        decode_fresh_since=fresh[DECODE],
        ratio=ratio,
        ratio_samples=samples,
        link=lk.state,
        ttft=ttft_state,
    )
    return PdDecision(
        prefill=roles[PREFILL],
        decode=roles[DECODE],
        decode_decision=dd,
        prefill_decision=pf,
        link_decision=lk,
        state=new_state,
        reason="; ".join(parts),
        attainment=attainment,
        attainment_requests=att_requests,
        attainment_window_s=att_window,
    )


class PdKvpilotPolicy:
    """decide_pd() with its state, for the P/D fleet simulator (pd_simulator.PdFleetPolicy)."""

    name = "kvpilot P/D"

    def __init__(self, targets: PdTargets, initial: tuple[int, int] | None = None) -> None:
        self.targets = targets
        self.state = PdState()
        self._initial = initial or (max(1, targets.prefill_min), max(1, targets.decode_min))
        self.last_reason = ""

    def initial_replicas(self) -> tuple[int, int]:
        return self._initial

    def decide(self, now: float, current: tuple[int, int], snapshot: PdSnapshot) -> tuple[int, int]:
        d = decide_pd(current, snapshot, self.targets, self.state, now)
        self.state = d.state
        self.last_reason = d.reason
        return d.desired

    def settings(self) -> dict[str, Any]:
        t = self.targets
        return {
            "prefill": [t.prefill_min, t.prefill_max],
            "decode": [t.decode_min, t.decode_max],
            "prefill_target_utilization": t.prefill_target_utilization,
            "ratio_coupling": t.ratio_coupling,
            "initial": list(self._initial),
        }
