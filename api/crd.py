"""Generate the InferenceModel CustomResourceDefinition from the pydantic models.

pydantic emits JSON Schema (2020-12); Kubernetes wants an OpenAPI v3.0 *structural* schema: every
node typed, no $ref/anyOf/oneOf for types, nullable-free optional fields, `exclusiveMinimum` as a
boolean beside `minimum`, and free-form objects marked `x-kubernetes-preserve-unknown-fields`.
`to_structural()` does that translation; `build_crd()` wraps the result with names, subresources
and printer columns. The output is deterministic so that the committed crds/ file can be compared.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpilot.api import models as m

CRD_NAME = f"{m.PLURAL}.{m.GROUP}"
CRD_FILENAME = f"{m.GROUP}_{m.PLURAL}.yaml"

# Keys that carry no meaning for Kubernetes (or that it rejects).
_DROP = {"title", "examples", "$schema"}
_KEEP_META = {"description", "default", "x-kubernetes-validations"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline $ref and collapse `anyOf: [X, null]` / single `allOf` into X, keeping annotations."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        merged = _resolve(target, defs)
        # The referencing field's own description/default/rules win over the class's.
        for key, value in node.items():
            if key == "x-kubernetes-validations":
                merged[key] = list(merged.get(key, [])) + list(value)
            else:
                merged[key] = value
        node = merged
    for combinator in ("anyOf", "oneOf", "allOf"):
        if combinator in node:
            options = [o for o in node.pop(combinator) if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(
                    f"cannot express {combinator} with {len(options)} non-null options structurally"
                )
            inner = _resolve(options[0], defs)
            for key, value in node.items():
                if key == "x-kubernetes-validations":
                    inner[key] = list(inner.get(key, [])) + list(value)
                else:
                    inner[key] = value
            node = inner
    if node.get("default", ...) is None:
        del node["default"]
    return node


def to_structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Translate one pydantic JSON Schema node (and its children) into a structural OpenAPI v3 node."""
    defs = defs if defs is not None else schema.get("$defs", {})
    node = _resolve({k: v for k, v in schema.items() if k != "$defs"}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out["properties"] = {name: to_structural(child, defs) for name, child in value.items()}
        elif key == "items":
            out["items"] = to_structural(value, defs)
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:
                out["additionalProperties"] = to_structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        if "properties" in out:
            out["type"] = "object"
        else:
            # An `Any` field: keep whatever the user wrote.
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    # A stable, readable key order: what it is first, then constraints, then rules.
    first = [k for k in ("description", "type") if k in out]
    last = [k for k in ("x-kubernetes-validations",) if k in out]
    return {k: out[k] for k in first + [k for k in out if k not in first and k not in last] + last}


def spec_schema() -> dict[str, Any]:
    return to_structural(m.InferenceModelSpec.model_json_schema(by_alias=True, mode="validation"))


def status_schema() -> dict[str, Any]:
    return to_structural(m.InferenceModelStatus.model_json_schema(by_alias=True, mode="validation"))


def openapi_schema() -> dict[str, Any]:
    spec = spec_schema()
    status = status_schema()
    status["description"] = (
        "Observed state, written by the operator (and status.autoscaler by the autoscaler)."
    )
    return {
        "type": "object",
        "description": m.InferenceModel.__doc__,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        **m.ROOT_RULES,
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source", "description": "Weights source"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Pods"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods"},
    {
        "name": "KV",
        "type": "string",
        "jsonPath": ".status.kvCacheUsage",
        "description": "Mean KV-cache usage",
    },
    {
        "name": "Status",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Reason of the Ready condition",
        "priority": 1,
    },
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".status.roles.prefill.readyReplicas",
        "description": "Ready prefill pods (spec.disaggregation)",
        "priority": 1,
    },
    {
        "name": "Decode",
        "type": "integer",
        "jsonPath": ".status.roles.decode.readyReplicas",
        "description": "Ready decode pods (spec.disaggregation)",
        "priority": 1,
    },
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object for InferenceModel."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/part-of": "kvpilot"},
        },
        "spec": {
            "group": m.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": m.KIND,
                "listKind": f"{m.KIND}List",
                "plural": m.PLURAL,
                "singular": m.SINGULAR,
                "shortNames": list(m.SHORT_NAMES),
                "categories": ["kvpilot", "all"],
            },
            "versions": [
                {
                    "name": m.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = (
    "# Generated by `kvpilot crds --output crds/` from the pydantic models in api/models.py.\n"
    "# Do not edit by hand: change the models and regenerate (tests/api/test_crd.py checks this).\n"
)


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)
