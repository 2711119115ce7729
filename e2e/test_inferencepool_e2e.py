"""spec.inferencePool against the local control plane: without the InferencePool CRD the model says so
in a condition (and still serves); with Gateway API Inference Extension v1.6.0's CRD installed (vendored
in e2e/crds/, so nothing is downloaded), the operator creates an InferencePool that selects exactly the
model's pods on the runtime's port, validated by the real CRD schema, and deletes it when disabled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.harness import Cluster, Kubectl, wait_until
from e2e.processes import OperatorProcess
from e2e.test_operator import condition, crds, get, model, wait_condition  # noqa: F401  (crds: a fixture)

POOL_CRD = Path(__file__).resolve().parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
CRD = "crd/inferencepools.inference.networking.k8s.io"
POOL = "inferencepools.inference.networking.k8s.io"  # the resource, unambiguous for kubectl


def pods_of(kubectl: Kubectl, match_labels: dict[str, str]) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in match_labels.items())
    return list(kubectl.json("get", "pods", "-l", selector)["items"])


@pytest.mark.usefixtures("crds")  # kvpilot's own CRD (the fixture imported above)
def test_inference_pool_is_created_for_an_enabled_model_when_its_crd_exists(
    cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    ns = kubectl.namespace or ""
    spec = {"replicas": 2, "inferencePool": {"enabled": True, "endpointPicker": {"service": "pooled-epp"}}}
    installed_here = not cluster.kubectl.exists(CRD)
    try:
        if installed_here:  # first without the API: a condition says so, the model is served anyway
            op = OperatorProcess(cluster, ns, tmp_path, "--no-leader-elect").start()
            try:
                kubectl.apply(model("pooled", **spec))
                missing = wait_condition(kubectl, "pooled", "InferencePoolReady", status="False")
                assert missing["reason"] == "CRDNotInstalled"
                assert "install the Gateway API Inference Extension CRDs" in missing["message"]
                wait_condition(kubectl, "pooled", "Ready")
            finally:
                op.stop()
            cluster.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
        cluster.kubectl("wait", "--for=condition=Established", CRD, "--timeout=60s")

        op = OperatorProcess(cluster, ns, tmp_path, "--no-leader-elect").start()
        try:
            kubectl.apply(model("pooled", **spec))
            kubectl.apply(model("plain", replicas=1))
            pool = wait_until(lambda: get(kubectl, POOL, "pooled"), timeout=60, what="InferencePool")
            ready = wait_condition(kubectl, "pooled", "InferencePoolReady")
            assert ready["reason"] == "Created"
            im = get(kubectl, "im", "pooled")
            assert im is not None
            owner = pool["metadata"]["ownerReferences"]
            assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owner] == [
                ("InferenceModel", "pooled", im["metadata"]["uid"], True)
            ]
            # The selector is the Deployment's, and selects its two pods and no other model's.
            dep = get(kubectl, "deployment", "pooled")
            assert dep is not None
            selector = pool["spec"]["selector"]["matchLabels"]
            assert selector == dep["spec"]["selector"]["matchLabels"] == {"kvpilot.dev/model": "pooled"}
            pods = wait_until(lambda: len(pods_of(kubectl, selector)) == 2 and pods_of(kubectl, selector),
                              timeout=60, what="the pool's two pods")  # fmt: skip
            assert {p["metadata"]["labels"]["kvpilot.dev/model"] for p in pods} == {"pooled"}
            wait_until(
                lambda: pods_of(kubectl, {"kvpilot.dev/model": "plain"}), timeout=60, what="plain's pod"
            )
            # targetPorts: the port the runtime container serves on (the OpenAI API and /metrics)
            ports = {
                p["name"]: p["containerPort"]
                for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]
            }
            assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}] == [{"number": 8000}]
            ref = pool["spec"]["endpointPickerRef"]
            assert (ref["kind"], ref["name"], ref["port"]) == ("Service", "pooled-epp", {"number": 9002})
            assert get(kubectl, POOL, "plain") is None  # not enabled: no pool

            # Turning it off removes the pool and the condition.
            kubectl("patch", "im", "pooled", "--type=merge", "-p",
                    '{"spec": {"inferencePool": {"enabled": false, "endpointPicker": null}}}')  # fmt: skip
            wait_until(lambda: get(kubectl, POOL, "pooled") is None, timeout=60, what="InferencePool deleted")
            wait_until(lambda: not condition(get(kubectl, "im", "pooled"), "InferencePoolReady"),
                       timeout=60, what="condition removed")  # fmt: skip
        finally:
            op.stop()
    finally:
        if installed_here:
            cluster.kubectl.run("delete", CRD, "--wait=false", check=False)
