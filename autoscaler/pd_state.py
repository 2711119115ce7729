"""The P/D policy's memory in status.autoscaler, so a restarted autoscaler keeps the P:D ratio, the
prefill throughput it learned and both roles' windows. Pure: dicts in, dataclasses out, and back.

Layout (the shared model kvpilot.api.models.AutoscalerStatus):
  lastDecision            both roles' totals (fromReplicas, toReplicas) and the joint reason
  history, scaleEvents, arrivals
                          the decode role's (policy.decide() runs on the decode pods: state.py writes them)
  slo                     the router's SLO measurement, once for both roles; capacityFloor and
                          capacityCeiling bound the prefill throughput (tokens/s per replica; pd_policy)
  disaggregation: {ratio, ratioSamples,
                   prefill: {fromReplicas, toReplicas, signal, demand, freshSince, throughput,
                             meanPrompt, time, pods, rates, history, scaleEvents},
                   decode:  {fromReplicas, toReplicas, signal, demand, freshSince,
                             linkBytesPerSecond, time, pods, rates, history},
                   ttft:    {decodeShare, prefillWaitSeconds, transferWaitSeconds, time,
                             prefillSeconds, prefillLegs, noPrefill}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvpilot.api.models import (
    AutoscalerStatus,
    HistoryEntry,
    PdAutoscalerStatus,
    PdDecodeAutoscaling,
    PdPrefillAutoscaling,
    PdTtftStatus,
    PodCounters,
    PullCounters,
    RatePoint,
    ScaleEventEntry,
)
from kvpilot.autoscaler.arrivals import PodCounter, RateSample
from kvpilot.autoscaler.feedback import SloState
from kvpilot.autoscaler.pd_decode import LinkState, PullCounter, TtftState
from kvpilot.autoscaler.pd_policy import PdDecision, PdState, PdTargets, RoleDecision
from kvpilot.autoscaler.pd_prefill import PrefillState
from kvpilot.autoscaler.pd_signals import RouterPdCounts
from kvpilot.autoscaler.policy import Recommendation, ScaleEvent
from kvpilot.autoscaler.state import _at, _seconds, _time, decision_to_status, history_from_status


def pd_state_from_status(autoscaler_status: Mapping[str, Any] | None) -> PdState:
    """Read back pd_decision_to_status; what does not parse is left out, never guessed."""
    if not autoscaler_status:
        return PdState()
    history = history_from_status(autoscaler_status)
    block = AutoscalerStatus.model_validate(
        {"disaggregation": autoscaler_status.get("disaggregation")}
    ).disaggregation
    state = PdState(decode=replace(history, slo=SloState()), slo=history.slo)
    if block is None:
        return state
    p = block.prefill
    prefill = PrefillState()
    if p is not None:
        prefill = PrefillState(
            time=_seconds(p.time),
            counters=tuple(PodCounter(c.pod, c.completed, c.in_flight, c.prompt_tokens) for c in p.pods or []),
            rates=tuple(sorted((RateSample(r.time.timestamp(), r.rate) for r in p.rates or []), key=lambda r: r.time)),
            throughput=p.throughput or None,
            mean_prompt=p.mean_prompt or None,
            recommendations=tuple(
                sorted((Recommendation(h.time.timestamp(), h.replicas) for h in p.history or []), key=lambda r: r.time)
            ),
            events=tuple(
                sorted(
                    (ScaleEvent(e.time.timestamp(), e.from_replicas, e.to_replicas) for e in p.scale_events or []),
                    key=lambda e: e.time,
                )
            ),
        )  # fmt: skip
    d = block.decode
    link = LinkState()
    if d is not None:
        link = LinkState(
            time=_seconds(d.time),
            counters=tuple(PullCounter(c.pod, c.seconds, c.pulls, c.bytes) for c in d.pods or []),
            link_bytes_s=d.link_bytes_per_second or None,
            rates=tuple(sorted((RateSample(r.time.timestamp(), r.rate) for r in d.rates or []), key=lambda r: r.time)),
            recommendations=tuple(
                sorted((Recommendation(h.time.timestamp(), h.replicas) for h in d.history or []), key=lambda r: r.time)
            ),
        )  # fmt: skip
    t = block.ttft
    ttft = TtftState()
    if t is not None:
        router = None
        if t.prefill_seconds is not None and t.prefill_legs is not None:
            router = RouterPdCounts(t.prefill_seconds, t.prefill_legs, t.no_prefill or 0.0)
        ttft = TtftState(
            time=_seconds(t.time),
            router=router,
            decode_share=t.decode_share,
            prefill_wait_s=t.prefill_wait_seconds,
            transfer_wait_s=t.transfer_wait_seconds,
        )
    return replace(
        state,
        prefill=prefill,
        link=link,
        ttft=ttft,
        prefill_fresh_since=None if p is None else _seconds(p.fresh_since),
        decode_fresh_since=None if block.decode is None else _seconds(block.decode.fresh_since),
        ratio=block.ratio or None,
        ratio_samples=block.ratio_samples or 0,
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _role(r: RoleDecision, fresh_since: float | None) -> dict[str, Any]:
    return {
        "from_replicas": r.current,
        "to_replicas": r.desired,
        "signal": r.signal[:64],
        "demand": None if r.demand is None else round(r.demand, 4),
        "fresh_since": _time(fresh_since),
    }


def pd_decision_to_status(
    decision: PdDecision,
    targets: PdTargets,
    now: float,
    previous: Mapping[str, Any] | None,
    decided_by: str | None = None,
    held_kind: str | None = None,
) -> dict[str, Any]:
    """The whole status.autoscaler block for a P/D decision (layout in the module doc)."""
    s = decision.state
    slo = targets.base.slo
    dd = replace(
        decision.decode_decision,
        current=sum(decision.current),
        desired=sum(decision.desired),
        reason=decision.reason,
        history=replace(s.decode, slo=s.slo),
        judge_targets=None if slo is None else slo.slo.judge_targets(slo.calibration),
        attainment_target=None if slo is None else slo.attainment_target,
        attainment=decision.attainment,
        attainment_requests=decision.attainment_requests,
        attainment_window_s=decision.attainment_window_s,
    )
    block = decision_to_status(dd, now, previous, decided_by, held_kind)
    p = s.prefill
    pd = PdAutoscalerStatus(
        ratio=None if s.ratio is None else round(s.ratio, 4),
        ratio_samples=s.ratio_samples,
        prefill=PdPrefillAutoscaling(
            **_role(decision.prefill, s.prefill_fresh_since),
            throughput=None if p.throughput is None else round(p.throughput, 1),
            mean_prompt=None if p.mean_prompt is None else round(p.mean_prompt, 1),
            time=_time(p.time),
            pods=[
                PodCounters.model_validate(
                    {
                        "pod": c.pod,
                        "completed": c.completed,
                        "inFlight": c.in_flight,
                        "promptTokens": c.prompt_tokens,
                    }
                )
                for c in p.counters
            ],
            rates=[RatePoint(time=_at(r.time), rate=round(r.rate, 4)) for r in p.rates],
            history=[HistoryEntry(time=_at(r.time), replicas=r.replicas) for r in p.recommendations],
            scale_events=[
                ScaleEventEntry(time=_at(e.time), from_replicas=e.from_replicas, to_replicas=e.to_replicas)
                for e in p.events
            ],
        ),
        decode=PdDecodeAutoscaling(
            **_role(decision.decode, s.decode_fresh_since),
            link_bytes_per_second=None if s.link.link_bytes_s is None else round(s.link.link_bytes_s, 1),
            time=_time(s.link.time),
            pods=[
                PullCounters(pod=c.pod, seconds=c.seconds, pulls=c.pulls, bytes=c.bytes)
                for c in s.link.counters
            ],
            rates=[RatePoint(time=_at(r.time), rate=round(r.rate, 1)) for r in s.link.rates],
            history=[HistoryEntry(time=_at(r.time), replicas=r.replicas) for r in s.link.recommendations],
        ),
        ttft=PdTtftStatus(
            decode_share=_round(s.ttft.decode_share),
            prefill_wait_seconds=_round(s.ttft.prefill_wait_s),
            transfer_wait_seconds=_round(s.ttft.transfer_wait_s),
            time=_time(s.ttft.time),
            prefill_seconds=None if s.ttft.router is None else s.ttft.router.prefill_seconds,
            prefill_legs=None if s.ttft.router is None else s.ttft.router.prefill_legs,
            no_prefill=None if s.ttft.router is None else s.ttft.router.no_prefill,
        ),
    )
    block["disaggregation"] = pd.dump()
    return block
