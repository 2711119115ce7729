"""spec.inferencePool: the InferencePool object, and reconciles that create it only when asked and when
the cluster serves the API, say so in a condition otherwise, and remove it when disabled."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpilot.api.models import InferenceModel, InferenceModelSpec
from kvpilot.operator.builders import HTTP_PORT, OperatorSettings, render_deployment, render_service
from kvpilot.operator.inferencepool import INFERENCE_POOL_API, render_inference_pool
from kvpilot.operator.reconcile import Reconciler
from tests.operator.fakes import FakeKube, make_body
from tests.operator.test_reconcile import NOW, body

POOL = ("inference.networking.k8s.io/v1", "InferencePool", "ml", "llama")
SETTINGS = OperatorSettings(image="img")


def model(**spec: Any) -> InferenceModel:
    b = make_body(**spec)
    return InferenceModel(metadata=b["metadata"], spec=InferenceModelSpec.model_validate(b["spec"]))


def reconciler(kube: FakeKube, api: bool = True, **spec: Any) -> Reconciler:
    kube.put(make_body(**spec))
    if api:
        kube.apis.add(INFERENCE_POOL_API)
    return Reconciler(kube, SETTINGS, clock=lambda: NOW)


def condition(kube: FakeKube, ctype: str = "InferencePoolReady") -> dict[str, Any] | None:
    for c in body(kube)["status"]["conditions"]:
        if c["type"] == ctype:
            return dict(c)
    return None


def test_the_pool_selects_the_deployment_s_pods_on_the_runtime_port() -> None:
    im = model(inferencePool={"enabled": True})
    pool = render_inference_pool(im, SETTINGS)
    deployment = render_deployment(im, SETTINGS, "")
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["metadata"]["name"] == "llama" and pool["metadata"]["namespace"] == "ml"
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    port = next(
        p for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http"
    )
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}] == [{"number": HTTP_PORT}]
    assert render_service(im, SETTINGS)["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert "endpointPickerRef" not in pool["spec"]
    picked = render_inference_pool(
        model(inferencePool={"enabled": True, "endpointPicker": {"service": "llama-epp"}}), SETTINGS
    )
    assert picked["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
    }


def test_disabled_or_unset_makes_no_pool_and_no_condition(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube)
    rec.reconcile(body(fake_kube))
    assert fake_kube.get(*POOL) is None and condition(fake_kube) is None
    assert condition(fake_kube, "Ready") is not None


def test_enabled_creates_it_once_and_reports_it(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube, inferencePool={"enabled": True})
    out = rec.reconcile(body(fake_kube))
    assert "InferencePool/llama" in out.applied
    pool = fake_kube.get(*POOL)
    assert pool is not None and pool["spec"]["selector"]["matchLabels"] == {"kvpilot.dev/model": "llama"}
    cond = condition(fake_kube)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "Created")
    assert "kvpilot.dev/model=llama" in cond["message"] and f"port {HTTP_PORT}" in cond["message"]
    again = rec.reconcile(body(fake_kube))
    assert not again.wrote and "InferencePool/llama" in again.skipped


def test_enabled_without_the_api_says_so_and_creates_nothing(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube, api=False, inferencePool={"enabled": True})
    out = rec.reconcile(body(fake_kube))
    assert fake_kube.get(*POOL) is None and not any(
        w[1].startswith("InferencePool") for w in fake_kube.writes
    )
    cond = condition(fake_kube)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
    assert "install the Gateway API Inference Extension CRDs" in cond["message"]
    assert [(e.type, e.reason) for e in out.events if "InferencePool" in e.reason] == [
        ("Warning", "InferencePoolCRDNotInstalled")
    ]
    ready = condition(fake_kube, "Ready")
    assert ready is not None and ready["reason"] != "ApplyFailed"  # the model itself is unaffected


def test_disabling_deletes_the_pool_it_made(fake_kube: FakeKube) -> None:
    rec = reconciler(fake_kube, inferencePool={"enabled": True})
    rec.reconcile(body(fake_kube))
    b = body(fake_kube)
    b["spec"]["inferencePool"] = {"enabled": False}
    fake_kube.put(b)
    out = rec.reconcile(body(fake_kube))
    assert out.deleted == ["InferencePool/llama"] and fake_kube.get(*POOL) is None
    assert condition(fake_kube) is None
    assert not rec.reconcile(body(fake_kube)).wrote


def test_a_pool_of_the_same_name_that_is_not_ours_is_left_alone(fake_kube: FakeKube) -> None:
    theirs = {
        "apiVersion": POOL[0],
        "kind": POOL[1],
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"selector": {"matchLabels": {"app": "other"}}, "targetPorts": [{"number": 9000}]},
    }
    fake_kube.put(theirs)
    rec = reconciler(fake_kube, inferencePool={"enabled": True})
    rec.reconcile(body(fake_kube))
    pool = fake_kube.get(*POOL)
    assert pool is not None and pool["spec"]["selector"]["matchLabels"] == {"app": "other"}
    cond = condition(fake_kube)
    assert cond is not None and cond["reason"] == "NameInUse"
    b = body(fake_kube)
    b["spec"]["inferencePool"] = {"enabled": False}
    fake_kube.put(b)
    rec.reconcile(body(fake_kube))
    assert fake_kube.get(*POOL) is not None  # not deleted either


class RefusingKube(FakeKube):
    """An API server whose InferencePool CRD is one of GIE v1.0 to v1.5 (endpointPickerRef required)."""

    def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        if obj["kind"] == "InferencePool" and "endpointPickerRef" not in obj["spec"]:
            e = ApiException(status=422, reason="Unprocessable Entity")
            e.body = json.dumps({"message": 'InferencePool.inference.networking.k8s.io "llama" is invalid: '
                                 "spec.endpointPickerRef: Required value"})  # fmt: skip
            raise e
        return super().apply(obj, field_manager)


def test_a_refused_pool_is_a_condition_with_the_api_s_message_and_a_hint() -> None:
    kube = RefusingKube()
    rec = reconciler(kube, inferencePool={"enabled": True})
    rec.reconcile(body(kube))
    cond = condition(kube)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Refused")
    assert "spec.endpointPickerRef: Required value" in cond["message"]
    assert "set spec.inferencePool.endpointPicker" in cond["message"]
    b = body(kube)
    b["spec"]["inferencePool"] = {"enabled": True, "endpointPicker": {"service": "epp"}}
    kube.put(b)
    out = rec.reconcile(body(kube))
    cond = condition(kube)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "Created")
    assert ("Normal", "InferencePoolCreated") in [(e.type, e.reason) for e in out.events]
