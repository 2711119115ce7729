"""The control loop's shell for a disaggregated InferenceModel (spec.disaggregation): read each role's
pods, decide both roles at once (pd_policy.decide_pd), write both sizes in one merge patch
(kube.roles_patch), record status.autoscaler (pd_state). ScalingController.sync_model hands such a
model here; everything else (leader election, observers, Events) is the controller's.

Each role's pods are the model's pods with its kvpilot.dev/kv-role label; the metric source is asked
about one role's pods at a time, so every per-pod signal (the pod scrape, or the Prometheus queries,
which select by pod name) is split by role. The router scrape (router_source.py) adds what the
routers report of the model's two legs (pd_signals.py): the prefill leg's seconds and the long
prompts served direct for lack of a prefill pod.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvpilot.api.models import KV_ROLE_LABEL, MODEL_LABEL
from kvpilot.autoscaler.controller import (
    STAGE_EVENT,
    SyncResult,
    condition_is_true,
    hold_kind,
    pod_is_ready,
    runtime_max_num_seqs,
)
from kvpilot.autoscaler.election import is_leader
from kvpilot.autoscaler.kube import Obj
from kvpilot.autoscaler.pd_policy import DECODE, PREFILL, PdDecision, PdSnapshot, PdTargets, decide_pd
from kvpilot.autoscaler.pd_signals import RouterPdCounts
from kvpilot.autoscaler.pd_state import pd_decision_to_status, pd_state_from_status
from kvpilot.autoscaler.sources import ModelRef, PodTarget, PrometheusSource
from kvpilot.autoscaler.startup import measured_startup_s, pod_startup_seconds
from kvpilot.autoscaler.state import kv_cache_usage_text

if TYPE_CHECKING:
    from kvpilot.autoscaler.controller import ScalingController

log = logging.getLogger(__name__)


def pd_targets(spec: dict[str, Any], status: dict[str, Any], ctl: ScalingController, where: str) -> PdTargets:
    autoscaling, disaggregation = spec["autoscaling"], spec.get("disaggregation") or {}
    max_seqs = runtime_max_num_seqs(spec, status)
    try:
        return PdTargets.from_spec(autoscaling, disaggregation, ctl.config.behavior, max_seqs)
    except ValueError as exc:
        if not autoscaling.get("slo"):
            raise
        log.warning("%s: spec.autoscaling.slo ignored: %s", where, exc)
        without = {k: v for k, v in autoscaling.items() if k != "slo"}
        return PdTargets.from_spec(without, disaggregation, ctl.config.behavior, max_seqs)


def role_of(pod: Obj) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(KV_ROLE_LABEL)


async def sync_disaggregated(ctl: ScalingController, obj: Obj) -> SyncResult | None:
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    ns, name = meta["namespace"], meta["name"]
    targets = pd_targets(spec, status, ctl, f"{ns}/{name}")
    roles = spec.get("disaggregation") or {}
    lows = {PREFILL: targets.prefill_min, DECODE: targets.decode_min}
    current = {}
    for role in (PREFILL, DECODE):
        value = (roles.get(role) or {}).get("replicas")
        current[role] = int(value) if value is not None else lows[role]

    pods = await ctl.api.list_pods(ns, f"{MODEL_LABEL}={name}")
    ready = [p for p in pods if pod_is_ready(p)]
    served = (spec.get("model") or {}).get("servedName") or name
    source = ctl._source_for(spec["autoscaling"])
    ref = ModelRef(ns, name, served)
    snaps = {}
    for role in (PREFILL, DECODE):
        targets_ = [
            PodTarget(p["metadata"]["name"], p["status"]["podIP"], ctl.config.pod_port)
            for p in ready
            if role_of(p) == role
        ]
        snaps[role] = await source.collect(ref, targets_)
    snapshot = PdSnapshot(
        prefill=snaps[PREFILL],
        decode=snaps[DECODE],
        startup_s=measured_startup_s(pod_startup_seconds(ready)),
        scaling_limited=condition_is_true(status, "ScalingLimited"),
    )
    if ctl._router is not None:
        snapshot = replace(snapshot, router_queue=await ctl._router.queue_depth(served))
        slo = (ctl._router.last_slo or {}).get(served)
        if slo is not None:
            snapshot = replace(snapshot, router_slo=slo)
        if ctl._router.last_pd is not None:  # the routers answered: no P/D series is zero of each
            snapshot = replace(snapshot, router_pd=ctl._router.last_pd.get(served, RouterPdCounts()))
    else:  # a Prometheus source reads the routers' series
        if snaps[DECODE].router_slo is not None:
            snapshot = replace(snapshot, router_slo=snaps[DECODE].router_slo)
        if isinstance(source, PrometheusSource):
            snapshot = replace(snapshot, router_pd=await source.router_pd(ref))

    previous = status.get("autoscaler") or {}
    now = ctl.clock()
    decision = decide_pd(
        (current[PREFILL], current[DECODE]), snapshot, targets, pd_state_from_status(previous), now
    )
    return await _write(ctl, obj, decision, targets, snapshot, ready, previous, now)


async def _write(
    ctl: ScalingController,
    obj: Obj,
    decision: PdDecision,
    targets: PdTargets,
    snapshot: PdSnapshot,
    ready: list[Obj],
    previous: dict[str, Any],
    now: float,
) -> SyncResult | None:
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    if not is_leader(ctl.elector):  # the metric queries took long enough to lose the Lease
        return None
    for role, rd in ((PREFILL, decision.prefill), (DECODE, decision.decode)):
        if rd.desired < rd.current:
            snap = snapshot.prefill if role == PREFILL else snapshot.decode
            await ctl._mark_deletion_costs(ns, [p for p in ready if role_of(p) == role], snap)
    before, after = sum(decision.current), sum(decision.desired)
    event_reason: str | None = None
    if decision.desired != decision.current:
        p, d = decision.desired
        await ctl.api.patch_roles(ns, name, p, d)
        ctl._notify("scaled", ns, name, before, after)
        grew = any(w > c for w, c in zip(decision.desired, decision.current, strict=True))
        event_reason = "ScaledUp" if grew else "ScaledDown"
        log.info("%s/%s: P/D %s -> %s: %s", ns, name, decision.current, decision.desired, decision.reason)
    summary = replace(decision.decode_decision, current=before, desired=after, reason=decision.reason)
    kind = hold_kind(summary) if decision.desired == decision.current else None
    if kind and previous.get("heldKind") != kind:
        event_reason = "ScalingHeld"
    block = pd_decision_to_status(decision, targets, now, previous, ctl.config.identity or None, kind or None)
    kv = decision.decode_decision.avg_kv_cache_usage
    await ctl.api.patch_status(ns, name, {"autoscaler": block, "kvCacheUsage": kv_cache_usage_text(kv)})
    if event_reason:
        etype = "Warning" if kind in ("no-metrics", "not-reporting", "scaling-limited") else "Normal"
        try:
            await ctl.api.create_event(ns, obj, event_reason, decision.reason[:1024], etype)
        except Exception as exc:  # an Event is best effort; the scale already happened
            ctl._notify("sync_error", STAGE_EVENT)
            log.warning("%s/%s: could not record Event %s: %s", ns, name, event_reason, exc)
    return SyncResult(ns, name, summary, decision.desired != decision.current, event_reason)
