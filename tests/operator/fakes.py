"""Test doubles for the operator: sample InferenceModel bodies and an in-memory Kube."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from kvpilot.api.models import API_VERSION, KIND


def make_body(name: str = "llama", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }
    return body


def _selector_matches(labels: dict[str, str], selector: str) -> bool:
    if not selector:
        return True
    return all(labels.get(k) == v for k, v in (part.split("=", 1) for part in selector.split(",")))


class FakeKube:
    """An in-memory API server good enough for reconcile tests: it records every write."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []  # (verb, "Kind/name")
        self.events: list[dict[str, Any]] = []
        self.apis: set[str] = set()
        self._rv = itertools.count(1)

    def _key(self, api_version: str, kind: str, namespace: str, name: str) -> tuple[str, str, str, str]:
        return (api_version, kind, namespace, name)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        md = obj["metadata"]
        md["resourceVersion"] = str(next(self._rv))
        md.setdefault("uid", f"uid-{md['name']}")
        self.objects[self._key(obj["apiVersion"], obj["kind"], md["namespace"], md["name"])] = obj
        return copy.deepcopy(obj)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get(self._key(api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (av, k, ns, _), o in self.objects.items()
            if av == api_version
            and k == kind
            and (namespace is None or ns == namespace)
            and _selector_matches(o["metadata"].get("labels") or {}, selector)
        ]

    def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        assert field_manager == "kvpilot-operator"
        md = obj["metadata"]
        self.writes.append(("apply", f"{obj['kind']}/{md['name']}"))
        live = self.get(obj["apiVersion"], obj["kind"], md["namespace"], md["name"])
        merged = copy.deepcopy(obj)
        if live is not None and "status" in live:
            merged["status"] = live["status"]
        return self.put(merged)

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(("status", f"{kind}/{name}"))
        obj = self.objects[self._key(api_version, kind, namespace, name)]
        status = obj.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = copy.deepcopy(v)
        return self.put(obj)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("create", obj["kind"]))
        self.events.append(copy.deepcopy(obj))
        return obj

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.writes.append(("delete", f"{kind}/{name}"))
        self.objects.pop(self._key(api_version, kind, namespace, name), None)

    def has_api(self, group_version: str) -> bool:
        return group_version in self.apis
