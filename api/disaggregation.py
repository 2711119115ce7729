"""spec.disaggregation's cross-field rules and effective values (docs/disaggregation.md, operator section).

The rules are CEL `x-kubernetes-validations` on the spec (`cel_rules()`, added to the CRD by
api/models.py) and the same rules in Python (`problems()`, part of `InferenceModelSpec.check()`), so
the operator never acts on a spec the API server would refuse. Every message names the field and says
what to do. The combinations refused, and why:

- spec.replicas with spec.disaggregation: the roles have their own replicas (and `kubectl scale`, which
  writes spec.replicas, has no meaning for two Deployments).
- a role's minReplicas / maxReplicas without spec.autoscaling: nothing would read them.
- a role's minReplicas above its maxReplicas (each defaulting to spec.autoscaling's).
- a role's runtime setting blockSize, kvCacheDtype or tensorParallelSize, and a role's resources.gpus
  other than spec.resources.gpus: a decode pod pulls the prefill pod's KV blocks as they lie (same
  block size and dtype, each tensor-parallel rank its own shard), so both roles must lay them out alike.
- create-only, as for spec.replicas: a role's replicas together with spec.autoscaling; on a change, a
  role's replicas outside its bounds (the autoscaler writes both roles within them).

The effective values the operator renders and the autoscaler scales by: `role_bounds()` and
`role_replicas()` (unset replicas: 1, or the role's minReplicas with autoscaling; clamped to the
bounds), `role_resources()` and `role_runtime()` (each field the role sets wins over spec's).

This module imports api/models.py only for types, so that api/models.py can import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.api.models import (
        DisaggregationRole,
        InferenceModelSpec,
        KvRole,
        Resources,
        RuntimeSettings,
    )

ROLES: tuple[KvRole, ...] = ("prefill", "decode")
# RuntimeSettings fields that shape the KV blocks a decode pod pulls: only spec.runtime may set them.
KV_LAYOUT_FIELDS = ("blockSize", "kvCacheDtype", "tensorParallelSize")

REPLICAS_HELP = (
    "spec.replicas cannot be set with spec.disaggregation: each role has its own replicas; remove "
    "spec.replicas and set spec.disaggregation.prefill.replicas and spec.disaggregation.decode.replicas "
    "(or leave them to the autoscaler with spec.autoscaling)"
)


def bounds_without_autoscaling_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.minReplicas and maxReplicas only apply with spec.autoscaling: add "
        f"spec.autoscaling, or remove them and set spec.disaggregation.{role}.replicas"
    )


def min_max_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.minReplicas must not exceed spec.disaggregation.{role}.maxReplicas "
        "(each defaults to spec.autoscaling's): lower minReplicas or raise maxReplicas"
    )


def kv_layout_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.runtime must not set blockSize, kvCacheDtype or tensorParallelSize: "
        "both roles must lay out KV blocks alike for the transfer; set them in spec.runtime"
    )


def gpus_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.resources.gpus must equal spec.resources.gpus: both roles shard the "
        "model and its KV cache alike (each tensor-parallel rank transfers its own shard); change "
        f"spec.resources.gpus for both roles, or remove spec.disaggregation.{role}.resources.gpus"
    )


def replicas_at_create_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.replicas and spec.autoscaling cannot both be set when an "
        f"InferenceModel is created: remove spec.disaggregation.{role}.replicas (the autoscaler starts the "
        "role at its minReplicas and owns its replicas)"
    )


def replicas_in_bounds_help(role: str) -> str:
    return (
        f"spec.disaggregation.{role}.replicas must lie between spec.disaggregation.{role}.minReplicas and "
        f"maxReplicas (each defaults to spec.autoscaling's): change replicas or widen the bounds"
    )


def _rule(rule: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"rule": rule, "message": message, **extra}


def _cel_bound(role: str, field: str) -> str:
    r = f"self.disaggregation.{role}"
    return f"(has({r}.{field}) ? {r}.{field} : self.autoscaling.{field})"


def cel_rules() -> list[dict[str, Any]]:
    """The spec-level CEL rules (self is spec; prefill and decode default to {} in the schema)."""
    d = "self.disaggregation"
    rules = [
        _rule(f"!has({d}) || !has(self.replicas)", REPLICAS_HELP),
    ]
    for role in ROLES:
        r = f"{d}.{role}"
        lo, hi = _cel_bound(role, "minReplicas"), _cel_bound(role, "maxReplicas")
        layout = " && ".join(f"!has({r}.runtime.{f})" for f in KV_LAYOUT_FIELDS)
        rules += [
            _rule(
                f"!has({d}) || has(self.autoscaling) || (!has({r}.minReplicas) && !has({r}.maxReplicas))",
                bounds_without_autoscaling_help(role),
            ),
            _rule(
                f"!has({d}) || !has(self.autoscaling) || (!has({r}.minReplicas) && !has({r}.maxReplicas))"
                f" || {lo} <= {hi}",
                min_max_help(role),
            ),
            _rule(f"!has({d}) || !has({r}.runtime) || ({layout})", kv_layout_help(role)),
            _rule(
                f"!has({d}) || !has({r}.resources) || !has({r}.resources.gpus)"
                f" || {r}.resources.gpus == self.resources.gpus",
                gpus_help(role),
            ),
            _rule(
                f"oldSelf.hasValue() || !has({d}) || !has(self.autoscaling) || !has({r}.replicas)",
                replicas_at_create_help(role),
                optionalOldSelf=True,
            ),
            _rule(
                f"!has({d}) || !has(self.autoscaling) || !has({r}.replicas)"
                f" || (oldSelf.hasValue() && has(oldSelf.value().disaggregation)"
                f" && has(oldSelf.value().disaggregation.{role})"
                f" && has(oldSelf.value().disaggregation.{role}.replicas)"
                f" && oldSelf.value().disaggregation.{role}.replicas == {r}.replicas)"
                f" || ({r}.replicas >= {lo} && {r}.replicas <= {hi})",
                replicas_in_bounds_help(role),
                optionalOldSelf=True,
            ),
        ]
    return rules


def role_bounds(spec: InferenceModelSpec, role: KvRole) -> tuple[int, int] | None:
    """(minReplicas, maxReplicas) of a role with spec.autoscaling (each the role's, else
    spec.autoscaling's); None without autoscaling or disaggregation."""
    a, d = spec.autoscaling, spec.disaggregation
    if a is None or d is None:
        return None
    r = d.role(role)
    lo = a.min_replicas if r.min_replicas is None else r.min_replicas
    hi = a.max_replicas if r.max_replicas is None else r.max_replicas
    return lo, hi


def role_replicas(spec: InferenceModelSpec, role: KvRole) -> int:
    """A role Deployment's replicas: the role's replicas, else 1 (with autoscaling: else the role's
    minReplicas, and clamped to the role's bounds)."""
    d = spec.disaggregation
    assert d is not None, "role_replicas of an aggregated model"
    replicas = d.role(role).replicas
    bounds = role_bounds(spec, role)
    if bounds is None:
        return 1 if replicas is None else replicas
    lo, hi = bounds
    return max(lo, min(hi, lo if replicas is None else replicas))


def _role(spec: InferenceModelSpec, role: KvRole) -> DisaggregationRole:
    assert spec.disaggregation is not None
    return spec.disaggregation.role(role)


def role_resources(spec: InferenceModelSpec, role: KvRole) -> Resources:
    """spec.resources with each field the role's resources set over it."""
    own = _role(spec, role).resources
    if own is None:
        return spec.resources
    return spec.resources.model_copy(update=own.model_dump(exclude_none=True))


def role_runtime(spec: InferenceModelSpec, role: KvRole) -> RuntimeSettings:
    """spec.runtime with each field the role's runtime sets over it."""
    own = _role(spec, role).runtime
    if own is None:
        return spec.runtime
    return spec.runtime.model_copy(update=own.model_dump(exclude_none=True))


def role_spec(spec: InferenceModelSpec, role: KvRole) -> InferenceModelSpec:
    """The spec one role's pods are rendered from: its resources and runtime merged in, replicas its own,
    no disaggregation (so everything that renders an aggregated model renders the role alike)."""
    return spec.model_copy(
        update={
            "resources": role_resources(spec, role),
            "runtime": role_runtime(spec, role),
            "replicas": role_replicas(spec, role),
            "autoscaling": None,
            "disaggregation": None,
        }
    )


def problems(spec: InferenceModelSpec) -> list[str]:
    """cel_rules() in Python, but for the create-only and transition rules (the operator clamps)."""
    d = spec.disaggregation
    if d is None:
        return []
    out = [REPLICAS_HELP] if spec.replicas is not None else []
    for role in ROLES:
        r = d.role(role)
        has_bounds = r.min_replicas is not None or r.max_replicas is not None
        bounds = role_bounds(spec, role)
        if has_bounds and bounds is None:
            out.append(bounds_without_autoscaling_help(role))
        if has_bounds and bounds is not None and bounds[0] > bounds[1]:
            out.append(min_max_help(role))
        if r.runtime is not None and any(
            getattr(r.runtime, name) is not None
            for name, info in type(r.runtime).model_fields.items()
            if info.alias in KV_LAYOUT_FIELDS
        ):
            out.append(kv_layout_help(role))
        if (
            r.resources is not None
            and r.resources.gpus is not None
            and r.resources.gpus != spec.resources.gpus
        ):
            out.append(gpus_help(role))
    return out
