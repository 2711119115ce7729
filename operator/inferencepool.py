"""A model's Gateway API Inference Extension InferencePool (spec.inferencePool): the object, and the
condition that says what became of it.

The pool is named after the model, selects the pods the model's Deployment selects (kvpilot.dev/model)
and targets the runtime's HTTP port, where every pod serves the OpenAI API and the Model Server
Protocol's metrics (runtime/serving/metrics.py), so any GIE-conformant gateway with an endpoint picker
can front the model. The API is inference.networking.k8s.io/v1, what GIE v1.0 and later serve
(api/v1/inferencepool_types.go in kubernetes-sigs/gateway-api-inference-extension); the manifest sets
only fields every v1 release knows (selector.matchLabels, targetPorts, endpointPickerRef), so the
quiet apply sees no pruned field as drift.
"""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import InferenceModel
from kvpilot.operator.builders import HTTP_PORT, OperatorSettings, child_metadata, selector_labels
from kvpilot.operator.status import Cond

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
CONDITION = "InferencePoolReady"


def pool_enabled(im: InferenceModel) -> bool:
    return im.spec.inference_pool is not None and im.spec.inference_pool.enabled


def render_inference_pool(im: InferenceModel, settings: OperatorSettings) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(im.name)},
        "targetPorts": [{"number": HTTP_PORT}],
    }
    picker = im.spec.inference_pool.endpoint_picker if im.spec.inference_pool else None
    if picker is not None:
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": picker.service,
            "port": {"number": picker.port},
        }
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": INFERENCE_POOL_KIND,
        "metadata": child_metadata(im, im.name, settings),
        "spec": spec,
    }


def owned_by(obj: dict[str, Any], im: InferenceModel) -> bool:
    """Whether `obj` is this InferenceModel's child (its controller owner reference), so the operator
    may change or delete it; a pool someone else made under the same name is left alone."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("controller") and r.get("uid") == im.uid for r in refs)


# -- the condition (only while spec.inferencePool.enabled) ---------------------------------------


def pool_ready(im: InferenceModel) -> Cond:
    return Cond(
        CONDITION,
        True,
        "Created",
        f"InferencePool {im.name} selects the pods labelled {', '.join(f'{k}={v}' for k, v in selector_labels(im.name).items())} "
        f"on port {HTTP_PORT}",
    )


def pool_api_missing() -> Cond:
    return Cond(
        CONDITION,
        False,
        "CRDNotInstalled",
        f"spec.inferencePool.enabled is true, but the cluster serves no {INFERENCE_POOL_API} "
        f"{INFERENCE_POOL_KIND}: install the Gateway API Inference Extension CRDs (v1.0 or later), or set "
        "spec.inferencePool.enabled: false (the operator looks for the API again every few minutes)",
    )


def pool_name_in_use(im: InferenceModel) -> Cond:
    return Cond(
        CONDITION,
        False,
        "NameInUse",
        f"an InferencePool named {im.name} exists and is not this InferenceModel's: delete or rename it",
    )


def pool_refused(im: InferenceModel, api_message: str) -> Cond:
    hint = ""
    if im.spec.inference_pool is not None and im.spec.inference_pool.endpoint_picker is None:
        hint = " (GIE releases before v1.6 require an endpoint picker: set spec.inferencePool.endpointPicker)"
    return Cond(CONDITION, False, "Refused", f"the InferencePool was rejected: {api_message}{hint}")


def pool_forbidden() -> Cond:
    return Cond(
        CONDITION,
        False,
        "Forbidden",
        "the operator may not manage InferencePools: enable the chart's rbac.inferencePools (or grant get, "
        "create, patch and delete on inferencepools.inference.networking.k8s.io)",
    )
