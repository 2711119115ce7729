"""Status of a disaggregated model: each role judged as an aggregated model would be, then combined.

- status.replicas / readyReplicas / updatedReplicas: both roles' pods together (the scale subresource's
  statusReplicasPath, so `kubectl get` shows every pod of the model);
- status.roles.{prefill,decode}: each role's replicas, readyReplicas, desiredReplicas and its own
  oomAdaptation (spec.oomPolicy acts per role: each role has its own runtime settings and memory);
- Ready is True only while *each* role has at least one Ready pod (a prefill pod to run prompts and a
  decode pod to take them over); both roles at zero replicas is ScaledToZero, one role at zero while the
  other has replicas is RoleScaledToZero; otherwise the first role that has no Ready pod gives the
  reason, and the message names each role that is not serving;
- Progressing: ProgressDeadlineExceeded if a role's rollout is stuck, else True while either role rolls
  out or scales; Degraded and ScalingLimited: the first role (prefill, then decode) where it is True.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvpilot.api import disaggregation as pd
from kvpilot.api.models import InferenceModel, KvRole, OOMAdaptation
from kvpilot.operator.adapters import AdapterSync
from kvpilot.operator.builders import endpoint
from kvpilot.operator.podstate import PodProblem
from kvpilot.operator.roles import role_counts, role_model
from kvpilot.operator.status import Cond, assemble_status, compute_conditions


def _prefixed(items: list[tuple[KvRole, Cond]]) -> str:
    return "; ".join(f"{role}: {c.message}" if c.message else role for role, c in items)


def combine_conditions(
    per_role: dict[KvRole, list[Cond]], counts: dict[KvRole, tuple[int, int]], endpoint_url: str
) -> list[Cond]:
    """The model's four conditions from each role's (`counts`: role -> (ready, desired))."""
    by_type = {ctype: [(role, next(c for c in conds if c.type == ctype)) for role, conds in per_role.items()]
               for ctype in ("Ready", "Progressing", "Degraded", "ScalingLimited")}  # fmt: skip
    ready = by_type["Ready"]
    summary = (
        ", ".join(f"{role} {counts[role][0]}/{counts[role][1]}" for role in per_role) + " replicas ready"
    )
    not_ready = [(role, c) for role, c in ready if not c.status]
    if not not_ready:
        ready_c = Cond("Ready", True, "Serving", f"{summary}; endpoint {endpoint_url}")
    elif all(c.reason == "ScaledToZero" for _, c in ready):
        ready_c = Cond(
            "Ready", False, "ScaledToZero", "both roles have 0 replicas: no replica serves; scale up"
        )
    else:
        first = not_ready[0][1]
        reason = "RoleScaledToZero" if first.reason == "ScaledToZero" else first.reason
        ready_c = Cond("Ready", False, reason, f"both roles must serve; {_prefixed(not_ready)}")

    progressing = by_type["Progressing"]
    stuck = [(role, c) for role, c in progressing if c.reason == "ProgressDeadlineExceeded"]
    moving = [(role, c) for role, c in progressing if c.status]
    if stuck:
        prog_c = Cond("Progressing", False, stuck[0][1].reason, _prefixed(stuck))
    elif moving:
        prog_c = Cond("Progressing", True, moving[0][1].reason, _prefixed(moving))
    else:
        prog_c = Cond("Progressing", False, "RolloutComplete", _prefixed(progressing))
    return [ready_c, prog_c, _first_true(by_type["Degraded"]), _first_true(by_type["ScalingLimited"])]


def _first_true(items: list[tuple[KvRole, Cond]]) -> Cond:
    for role, c in items:
        if c.status:
            # A refused child is reported once for the model, not once per role.
            message = c.message if c.reason == "ApplyFailed" else f"{role}: {c.message}"
            return Cond(c.type, True, c.reason, message)
    return items[0][1]


def compute_roles_status(
    im: InferenceModel,
    deployments: dict[KvRole, dict[str, Any] | None],
    problems: dict[KvRole, list[PodProblem]],
    *,
    now: datetime,
    previous: dict[str, Any] | None = None,
    oom: dict[KvRole, OOMAdaptation | None] | None = None,
    oom_notes: dict[KvRole, str] | None = None,
    apply_error: str | None = None,
    router_endpoint: str | None = None,
    refused: frozenset[str] = frozenset(),
    adapters: AdapterSync | None = None,
    inference_pool: Cond | None = None,
    fetching: dict[KvRole, list[str]] | None = None,
) -> dict[str, Any]:
    """The operator-owned status of a disaggregated model (as status.compute_status for one Deployment)."""
    per_role: dict[KvRole, list[Cond]] = {}
    roles: dict[str, Any] = {}
    totals = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
    ready_of: dict[KvRole, tuple[int, int]] = {}
    for role in pd.ROLES:
        deployment = deployments.get(role)
        per_role[role] = compute_conditions(
            role_model(im, role),
            deployment,
            problems.get(role, []),
            oom_note=(oom_notes or {}).get(role),
            apply_error=apply_error,
            refused=refused,
            fetching=(fetching or {}).get(role, ()),
        )
        counts = role_counts(im, role, deployment)
        totals["replicas"] += counts.replicas
        totals["readyReplicas"] += counts.ready
        totals["updatedReplicas"] += counts.updated
        ready_of[role] = (counts.ready, counts.desired)
        roles[role] = counts.dump()
        state = (oom or {}).get(role)
        if state is not None:
            roles[role]["oomAdaptation"] = state.dump()
    conds = combine_conditions(per_role, ready_of, endpoint(im.name, im.namespace))
    status = assemble_status(
        im,
        totals,
        conds,
        now=now,
        previous=previous,
        router_endpoint=router_endpoint,
        refused=refused,
        adapters=adapters,
        inference_pool=inference_pool,
    )
    status["roles"] = roles
    return status
