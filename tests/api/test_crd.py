"""The committed CRD is what the models generate, and it is a valid structural schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.api.crd import CRD_FILENAME, build_crd, render_crd_yaml

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_matches_the_models() -> None:
    committed = (ROOT / "crds" / CRD_FILENAME).read_text()
    assert committed == render_crd_yaml(), "crds/ is stale: run `kvpilot crds --output crds/`"


def test_crds_cli_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpilot.cli import main

    assert main(["crds", "--output", str(tmp_path)]) == 0
    assert main(["crds", "--output", str(tmp_path), "--check"]) == 0
    (tmp_path / CRD_FILENAME).write_text("stale")
    assert main(["crds", "--output", str(tmp_path), "--check"]) == 1
    assert main(["crds"]) == 0
    assert "kind: CustomResourceDefinition" in capsys.readouterr().out


def test_names_scope_and_subresources() -> None:
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferencemodels.kvpilot.dev"
    assert spec["group"] == "kvpilot.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceModel"
    assert spec["names"]["plural"] == "inferencemodels"
    assert spec["names"]["shortNames"] == ["im"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Model"]["jsonPath"] == ".spec.model.source"
    assert columns["Replicas"]["jsonPath"] == ".status.replicas"
    assert columns["Ready"]["jsonPath"] == ".status.readyReplicas"
    assert columns["KV"]["jsonPath"] == ".status.kvCacheUsage"
    # a disaggregated model's roles, in `kubectl get im -o wide`; Replicas and Ready count both roles
    assert columns["Prefill"]["jsonPath"] == ".status.roles.prefill.readyReplicas"
    assert columns["Decode"]["jsonPath"] == ".status.roles.decode.readyReplicas"
    assert columns["Prefill"]["priority"] == columns["Decode"]["priority"] == 1
    assert columns["Age"]["type"] == "date"


def test_schema_is_structural() -> None:
    """Every node is typed (or explicitly free-form); no JSON-Schema constructs Kubernetes rejects."""
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "$defs", "title", "const", "nullable"}
    for path, node in _walk(_schema()):
        assert not forbidden & node.keys(), f"{path}: {forbidden & node.keys()}"
        if path:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if (
            node.get("type") == "object"
            and path != ".metadata"
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            assert "properties" in node or "additionalProperties" in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "default" in node:
            assert node["default"] is not None, path


def test_spec_fields_have_descriptions_defaults_and_bounds() -> None:
    spec = _schema()["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["model"]
    for name in ("model", "replicas", "autoscaling", "resources", "runtime", "oomPolicy"):
        assert props[name].get("description"), name
    assert props["replicas"]["minimum"] == 0 and "default" not in props["replicas"]
    auto = props["autoscaling"]["properties"]
    assert auto["minReplicas"]["default"] == 1
    assert auto["maxReplicas"]["maximum"] == 1000
    assert auto["targetKVCacheUtilization"] == {
        **auto["targetKVCacheUtilization"],
        "default": 0.7,
        "minimum": 0.0,
        "exclusiveMinimum": True,
        "maximum": 1.0,
    }
    assert auto["metricsSource"]["enum"] == ["pods", "prometheus"]
    assert props["resources"]["default"] == {} and props["resources"]["properties"]["gpus"]["default"] == 1
    runtime = props["runtime"]["properties"]
    assert runtime["kvCacheDtype"]["enum"] == ["auto", "fp8", "int8"]
    assert runtime["blockSize"]["enum"] == [8, 16, 32, 64, 128, 256]
    oom = props["oomPolicy"]["properties"]
    assert (oom["adapt"]["default"], oom["minGpuMemoryUtilization"]["default"]) == (False, 0.5)
    assert (oom["minMaxNumSeqs"]["default"], oom["minMaxNumBatchedTokens"]["default"]) == (4, 256)


def test_every_rule_has_an_actionable_message() -> None:
    rules = [
        (path, rule) for path, node in _walk(_schema()) for rule in node.get("x-kubernetes-validations") or []
    ]
    assert len(rules) >= 9
    for path, rule in rules:
        message = rule["message"]
        assert message.startswith(("spec.", "metadata.name ")), (path, message)  # names the field
        assert ":" in message or " must " in message, (path, message)  # says what to do


def test_status_schema_keeps_autoscaler_fields_and_conditions_are_a_map() -> None:
    status = _schema()["properties"]["status"]["properties"]
    assert status["autoscaler"]["x-kubernetes-preserve-unknown-fields"] is True
    assert set(status["autoscaler"]["properties"]) == {
        "lastDecision",
        "history",
        "scaleEvents",
        "lastScaleTime",
        "redundancy",
        "arrivals",
        "decidedBy",
        "heldKind",
        "slo",
        "disaggregation",
    }
    pd = status["autoscaler"]["properties"]["disaggregation"]["properties"]
    assert set(pd) == {"ratio", "ratioSamples", "prefill", "decode", "ttft"}
    assert {"throughput", "pods", "history", "scaleEvents", "signal"} <= set(pd["prefill"]["properties"])
    assert {"linkBytesPerSecond", "pods", "rates", "history", "signal"} <= set(pd["decode"]["properties"])
    assert {"decodeShare", "prefillSeconds", "noPrefill"} <= set(pd["ttft"]["properties"])
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    for key in ("observedGeneration", "replicas", "readyReplicas", "selector", "endpoint", "kvCacheUsage"):
        assert key in status
    assert set(status["oomAdaptation"]["properties"]) >= {"count", "lastTime", "changes"}


def test_rendered_yaml_round_trips() -> None:
    assert yaml.safe_load(render_crd_yaml()) == build_crd()


def test_slo_tpot_tail_budget_is_an_optional_share() -> None:
    """spec.autoscaling.slo.tpotTailBudget: opt-in (no default), a share strictly between 0 and 1, and
    the models refuse what the schema refuses."""
    from pydantic import ValidationError

    from kvpilot.api.models import SloPlanner

    slo = _schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]["slo"]
    field = slo["properties"]["tpotTailBudget"]
    assert field["type"] == "number" and "default" not in field
    assert (field["minimum"], field["exclusiveMinimum"], field["maximum"], field["exclusiveMaximum"]) == (
        0.0,
        True,
        1.0,
        True,
    )
    assert "kvpilot_request_generation_tokens" in field["description"]
    assert "tpotTailBudget" not in slo.get("required", [])
    ok = SloPlanner.model_validate({"calibration": "h100/llama-3.1-8b", "tpotTailBudget": 0.005})
    assert ok.tpot_tail_budget == 0.005 and ok.dump()["tpotTailBudget"] == 0.005
    assert "tpotTailBudget" not in SloPlanner.model_validate({"calibration": "h100/llama-3.1-8b"}).dump()
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValidationError, match=r"tpotTailBudget|tpot_tail_budget"):
            SloPlanner.model_validate({"calibration": "h100/llama-3.1-8b", "tpotTailBudget": bad})


def test_declared_startup_is_an_optional_bounded_integer() -> None:
    """spec.autoscaling.startupSeconds: no default (unknown until measured), 0..3600; the models refuse
    what the schema refuses, and the autoscaler's targets carry it."""
    from pydantic import ValidationError

    from kvpilot.api.models import Autoscaling
    from kvpilot.autoscaler.spec import ScalingTargets

    auto = _schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    field = auto["startupSeconds"]
    assert field["type"] == "integer" and "default" not in field
    assert (field["minimum"], field["maximum"]) == (0, 3600)
    declared = Autoscaling.model_validate({"maxReplicas": 4, "startupSeconds": 90}).dump()
    assert declared["startupSeconds"] == 90
    assert "startupSeconds" not in Autoscaling.model_validate({"maxReplicas": 4}).dump()
    for bad in (-1, 3601):
        with pytest.raises(ValidationError, match=r"startupSeconds|startup_seconds"):
            Autoscaling.model_validate({"maxReplicas": 4, "startupSeconds": bad})
    assert ScalingTargets.from_spec(declared).startup_s == 90.0
    assert ScalingTargets.from_spec({"maxReplicas": 4}).startup_s is None
