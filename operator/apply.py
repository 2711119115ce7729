"""Quiet server-side apply: write a child only when the live object differs from what we want.

Every desired child carries `kvpilot.dev/applied-hash`, a hash of the manifest itself. An apply is
skipped when the live object has the same hash (nothing we want changed, so no field we once set
needs removing) *and* every field we set still has our value (nobody edited it behind our back).
So a reconcile of an unchanged InferenceModel, or a restart of the operator, makes no write at all,
and drift is still repaired. When an apply does happen it is server-side apply under one field
manager with force, so the operator owns exactly the fields it renders.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvpilot.kube.client import Kube
from kvpilot.operator.builders import APPLIED_HASH_ANNOTATION, FIELD_MANAGER, stable_hash


def stamp(desired: dict[str, Any]) -> dict[str, Any]:
    """A copy of `desired` with its applied-hash annotation set (the hash excludes the annotation)."""
    obj = copy.deepcopy(desired)
    annotations = obj.setdefault("metadata", {}).setdefault("annotations", {})
    annotations.pop(APPLIED_HASH_ANNOTATION, None)
    if not annotations:
        del obj["metadata"]["annotations"]
    digest = stable_hash(obj)
    obj["metadata"].setdefault("annotations", {})[APPLIED_HASH_ANNOTATION] = digest
    return obj


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def is_subset(desired: Any, live: Any) -> bool:
    """True when every value in `desired` is present with the same value in `live`.

    Maps compare key by key (the server adds defaults we ignore); lists of named items (containers,
    env, volumes, ports) match by name; other lists compare item by item and must have equal length.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        if _named(desired) and _named(live):
            by_name = {i["name"]: i for i in live}
            return all(i["name"] in by_name and is_subset(i, by_name[i["name"]]) for i in desired)
        return len(desired) == len(live) and all(is_subset(d, x) for d, x in zip(desired, live, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if isinstance(desired, int | float) and isinstance(live, int | float):
        return float(desired) == float(live)
    return bool(desired == live)


def needs_apply(stamped: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether `stamped` (see `stamp`) must be applied over `live`."""
    if live is None:
        return True
    want = stamped["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
    have = (live["metadata"].get("annotations") or {}).get(APPLIED_HASH_ANNOTATION)
    if want != have:
        return True
    return not is_subset(stamped, live)


@dataclass
class ApplyResult:
    obj: dict[str, Any]
    applied: bool


def apply_child(kube: Kube, desired: dict[str, Any], live: dict[str, Any] | None = None) -> ApplyResult:
    """Apply `desired` unless `live` (fetched when not given) already matches it."""
    stamped = stamp(desired)
    md = stamped["metadata"]
    if live is None:
        live = kube.get(stamped["apiVersion"], stamped["kind"], md["namespace"], md["name"])
    if not needs_apply(stamped, live):
        assert live is not None
        return ApplyResult(live, applied=False)
    return ApplyResult(kube.apply(stamped, FIELD_MANAGER), applied=True)
