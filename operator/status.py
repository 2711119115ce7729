"""Status computed purely from what exists: the Deployment, the pods, the OOM decision.

`compute_status()` returns the part of `.status` the operator owns (never status.autoscaler or
status.kvCacheUsage, which the autoscaler writes); `status_patch()` says what, if anything, differs
from the live object, so an unchanged world causes no write. `condition_events()` turns condition
transitions into the Events a person should see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.api.models import InferenceModel, OOMAdaptation
from kvpilot.kube.times import format_time
from kvpilot.operator.adapters import AdapterSync, adapters_status
from kvpilot.operator.builders import desired_replicas, endpoint, selector_string
from kvpilot.operator.podstate import PodProblem

OPERATOR_STATUS_KEYS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "selector",
    "endpoint",
    "routerEndpoint",
    "conditions",
    "oomAdaptation",
    "adapters",
    "roles",
)
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ScalingLimited")
# Degraded reasons, most important first.
DEGRADED_ORDER = (  # after InvalidSpec and ApplyFailed
    "OOMKilled",
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool
    reason: str
    message: str = ""


def _deployment_condition(deployment: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in (deployment or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _summarize(problems: list[PodProblem], reason: str, limit: int = 3) -> str:
    msgs = list(dict.fromkeys(p.message for p in problems if p.reason == reason))
    extra = f" (and {len(msgs) - limit} more)" if len(msgs) > limit else ""
    return "; ".join(msgs[:limit]) + extra


def compute_conditions(
    im: InferenceModel,
    deployment: dict[str, Any] | None,
    problems: list[PodProblem],
    oom_note: str | None = None,
    apply_error: str | None = None,
    refused: frozenset[str] = frozenset(),
    fetching: Sequence[str] = (),
) -> list[Cond]:
    """The four conditions, from the Deployment and the pods' problems (no timestamps).

    `fetching`: pods whose init container downloads the weights (podstate.fetching), named while no
    replica is ready.

    `refused`: kinds of children the API server refused in this reconcile. A refused Service means
    clients have no endpoint, so the model is not Ready whatever its pods say.
    """
    want = desired_replicas(im)
    st = (deployment or {}).get("status", {})
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    total = int(st.get("replicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    dep_gen = int((deployment or {}).get("metadata", {}).get("generation") or 0)
    observed = int(st.get("observedGeneration") or 0)
    progressing = _deployment_condition(deployment, "Progressing")
    deadline = progressing is not None and progressing.get("reason") == "ProgressDeadlineExceeded"
    counts = f"{ready}/{want} replicas ready"

    # Ready: at least one replica serves, through the Service.
    if "Service" in refused:
        ready_c = Cond(
            "Ready", False, "ApplyFailed", f"the Service was refused, so no endpoint serves ({counts})"
        )
    elif deployment is None and "Deployment" in refused:
        ready_c = Cond("Ready", False, "ApplyFailed", "the Deployment was refused")
    elif deployment is None:
        ready_c = Cond("Ready", False, "Creating", "the Deployment does not exist yet")
    elif want == 0:
        ready_c = Cond("Ready", False, "ScaledToZero", "replicas is 0: no replica serves; scale up to serve")
    elif ready > 0:
        ready_c = Cond("Ready", True, "Serving", f"{counts}; endpoint {endpoint(im.name, im.namespace)}")
    else:
        waiting = "waiting for a replica to load the model"
        if fetching:
            waiting = f"waiting for the weights: {', '.join(fetching)} downloading them"
        ready_c = Cond("Ready", False, "NoReplicaReady", f"{counts}: {waiting}")

    # Progressing: a rollout or scale is under way.
    if deadline:
        prog_c = Cond(
            "Progressing", False, "ProgressDeadlineExceeded", str((progressing or {}).get("message", ""))
        )
    elif deployment is None:
        prog_c = Cond("Progressing", True, "Creating", "creating the Deployment")
    elif observed < dep_gen or updated < total:  # pods of an older template remain
        prog_c = Cond("Progressing", True, "RollingOut", f"{updated}/{want} replicas updated, {counts}")
    elif total != want:
        prog_c = Cond("Progressing", True, "Scaling", f"scaling from {total} to {want} replicas, {counts}")
    elif ready < want or available < want:
        prog_c = Cond("Progressing", True, "WaitingForReplicas", counts)
    else:
        prog_c = Cond("Progressing", False, "RolloutComplete", f"{counts} and up to date")

    # Degraded: something a person must look at.
    degraded_c = Cond("Degraded", False, "AsExpected")
    if apply_error:
        # The API server refused a child (e.g. a nodeSelector value it does not accept).
        return [
            ready_c,
            prog_c,
            Cond("Degraded", True, "ApplyFailed", apply_error),
            _scaling(deployment, problems),
        ]
    for reason in DEGRADED_ORDER:
        if any(p.reason == reason for p in problems):
            message = _summarize(problems, reason)
            if reason == "OOMKilled" and oom_note:
                message = f"{message}; {oom_note}"
            degraded_c = Cond("Degraded", True, reason, message)
            break
    else:
        if deadline:
            degraded_c = Cond("Degraded", True, "ProgressDeadlineExceeded", prog_c.message)

    return [ready_c, prog_c, degraded_c, _scaling(deployment, problems)]


def _scaling(deployment: dict[str, Any] | None, problems: list[PodProblem]) -> Cond:
    """ScalingLimited: pods that cannot be placed (not enough GPUs, quota)."""
    unschedulable = [p for p in problems if p.reason == "Unschedulable"]
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if unschedulable:
        n = len({p.pod for p in unschedulable})
        scaling_c = Cond(
            "ScalingLimited",
            True,
            "Unschedulable",
            f"{_plural(n, 'pod')} cannot be scheduled: {_summarize(problems, 'Unschedulable', 1)}",
        )
    elif failure is not None and failure.get("status") == "True":
        scaling_c = Cond(
            "ScalingLimited",
            True,
            str(failure.get("reason") or "ReplicaFailure"),
            str(failure.get("message", "")),
        )
    else:
        scaling_c = Cond("ScalingLimited", False, "AsExpected")
    return scaling_c


def merge_conditions(
    new: list[Cond], previous: list[dict[str, Any]] | None, now: datetime, generation: int
) -> list[dict[str, Any]]:
    """Conditions as status dicts; lastTransitionTime only moves when the status flips."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in new:
        status = "True" if c.status else "False"
        old = before.get(c.type)
        ltt = old.get("lastTransitionTime") if old and old.get("status") == status else None
        out.append(
            {
                "type": c.type,
                "status": status,
                "reason": c.reason,
                "message": c.message[:4096],
                "lastTransitionTime": ltt or format_time(now),
                "observedGeneration": generation,
            }
        )
    return out


def compute_status(
    im: InferenceModel,
    deployment: dict[str, Any] | None,
    problems: list[PodProblem],
    *,
    now: datetime,
    previous: dict[str, Any] | None = None,
    oom: OOMAdaptation | None = None,
    oom_note: str | None = None,
    apply_error: str | None = None,
    router_endpoint: str | None = None,
    refused: frozenset[str] = frozenset(),
    adapters: AdapterSync | None = None,
    inference_pool: Cond | None = None,
    fetching: Sequence[str] = (),
) -> dict[str, Any]:
    """The operator-owned status of `im` (camelCase keys, as written to the API).

    No `endpoint` when the Service was refused: it would name a Service that does not exist.
    """
    st = (deployment or {}).get("status", {})
    conds = compute_conditions(
        im,
        deployment,
        problems,
        oom_note=oom_note,
        apply_error=apply_error,
        refused=refused,
        fetching=fetching,
    )
    counts = {key: int(st.get(key) or 0) for key in ("replicas", "readyReplicas", "updatedReplicas")}
    status = assemble_status(
        im,
        counts,
        conds,
        now=now,
        previous=previous,
        router_endpoint=router_endpoint,
        refused=refused,
        adapters=adapters,
        inference_pool=inference_pool,
    )
    if oom is not None:
        status["oomAdaptation"] = oom.dump()
    return status


def assemble_status(
    im: InferenceModel,
    counts: dict[str, int],
    conds: list[Cond],
    *,
    now: datetime,
    previous: dict[str, Any] | None,
    router_endpoint: str | None,
    refused: frozenset[str],
    adapters: AdapterSync | None,
    inference_pool: Cond | None,
) -> dict[str, Any]:
    """The status dict from the replica counts and the four conditions (shared with operator/rolestatus.py)."""
    conds = list(conds)
    if adapters is not None:
        conds.append(adapters_condition(adapters))
    if inference_pool is not None:  # only with spec.inferencePool.enabled (operator/inferencepool.py)
        conds.append(inference_pool)
    status: dict[str, Any] = {
        "observedGeneration": im.generation,
        **counts,
        "selector": selector_string(im.name),
        "conditions": merge_conditions(conds, (previous or {}).get("conditions"), now, im.generation),
    }
    if "Service" not in refused:
        status["endpoint"] = endpoint(im.name, im.namespace)
    if router_endpoint:
        status["routerEndpoint"] = router_endpoint
    if adapters is not None:
        status["adapters"] = adapters_status(im, adapters)
    return status


def adapters_condition(sync: AdapterSync) -> Cond:
    """AdaptersLoaded: every Ready replica serves every spec adapter (only with spec.adapters)."""
    if sync.failures:
        more = f" (and {len(sync.failures) - 4} more)" if len(sync.failures) > 4 else ""
        return Cond("AdaptersLoaded", False, "AdapterLoadFailed", "; ".join(sync.failures[:4]) + more)
    if sync.pending:
        waiting = "; ".join(f"pod {pod}: {', '.join(names)}" for pod, names in sorted(sync.pending.items()))
        return Cond(
            "AdaptersLoaded",
            False,
            "WaitingForRollout",
            f"adapters that need a new pod (a new claim or an hf:// download): {waiting}",
        )
    if not sync.loaded:
        return Cond("AdaptersLoaded", False, "NoReadyReplicas", "no Ready replica to load adapters into")
    return Cond(
        "AdaptersLoaded", True, "AllLoaded", f"every Ready replica ({len(sync.loaded)}) serves every adapter"
    )


def status_patch(live: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch for the operator-owned keys that differ, or None when nothing does."""
    live = live or {}
    patch = {k: v for k, v in desired.items() if k in OPERATOR_STATUS_KEYS and live.get(k) != v}
    for key in OPERATOR_STATUS_KEYS:
        if key not in desired and live.get(key) is not None:
            patch[key] = None  # merge patch: remove
    return patch or None


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


def condition_events(previous: list[dict[str, Any]] | None, current: list[dict[str, Any]]) -> list[EventSpec]:
    """Events for transitions a person should know about (never for an unchanged condition)."""
    before = {c.get("type"): c for c in previous or []}
    events: list[EventSpec] = []
    for c in current:
        old = before.get(c["type"], {})
        changed = old.get("status") != c["status"] or old.get("reason") != c["reason"]
        if not changed:
            continue
        if c["type"] in ("Degraded", "ScalingLimited") and c["status"] == "True":
            events.append(EventSpec("Warning", c["reason"], c["message"]))
        elif c["type"] in ("Degraded", "ScalingLimited") and old.get("status") == "True":
            events.append(
                EventSpec("Normal", f"{c['type']}Cleared", f"{c['type']} cleared (was {old.get('reason')})")
            )
        elif c["type"] == "AdaptersLoaded" and c["reason"] == "AdapterLoadFailed":
            events.append(EventSpec("Warning", "AdapterLoadFailed", c["message"]))
        elif (
            c["type"] == "AdaptersLoaded"
            and old.get("reason") == "AdapterLoadFailed"
            and c["status"] == "True"
        ):
            events.append(EventSpec("Normal", "AdaptersLoaded", c["message"]))
        elif c["type"] == "InferencePoolReady" and c["status"] == "False":
            events.append(EventSpec("Warning", f"InferencePool{c['reason']}", c["message"]))
        elif c["type"] == "InferencePoolReady" and old.get("status") == "False":
            events.append(EventSpec("Normal", "InferencePoolCreated", c["message"]))
        elif c["type"] == "Ready" and c["status"] == "True" and old.get("status") != "True":
            events.append(EventSpec("Normal", "Ready", c["message"]))
        elif c["type"] == "Ready" and old.get("status") == "True":
            # The way down, once per transition (a later False -> False reason change posts nothing).
            if c["reason"] == "ScaledToZero":
                events.append(EventSpec("Normal", "ScaledToZero", c["message"]))
            else:
                events.append(
                    EventSpec(
                        "Warning", "NotReady", f"the model stopped serving ({c['reason']}): {c['message']}"
                    )
                )
    return events


def invalid_status(
    name: str,
    namespace: str,
    generation: int,
    message: str,
    *,
    now: datetime,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """Status for a spec the operator cannot act on (replica counts are left as they were).

    No children are rendered, so the endpoint is only kept where an earlier reconcile made one.
    """
    msg = message if message.startswith("metadata.") else f"spec is invalid: {message}"
    conds = [
        Cond("Ready", False, "InvalidSpec", msg),
        Cond("Progressing", False, "InvalidSpec", msg),
        Cond("Degraded", True, "InvalidSpec", msg),
        Cond("ScalingLimited", False, "AsExpected"),
    ]
    prev = previous or {}
    kept = ("replicas", "readyReplicas", "updatedReplicas", "oomAdaptation", "endpoint", "roles")
    status: dict[str, Any] = {k: prev[k] for k in kept if k in prev}
    status.update(
        {
            "observedGeneration": generation,
            "selector": selector_string(name),
            "conditions": merge_conditions(conds, prev.get("conditions"), now, generation),
        }
    )
    return status
