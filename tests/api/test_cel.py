"""The CRD's CEL rules, evaluated locally with cel-python: each invalid spec gets its message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.api.crd import build_crd
from kvpilot.api.models import InferenceModelSpec, name_problems
from tests.api.celcheck import apply_defaults, violations

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
BUILTIN = {"source": "builtin://smollm2-135m-instruct"}


def check(spec: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    new = apply_defaults(SPEC_SCHEMA, spec)
    old = apply_defaults(SPEC_SCHEMA, old) if old is not None else None
    return violations(SPEC_SCHEMA, new, old, "spec")


VALID = [
    {"model": BUILTIN},
    {"model": BUILTIN, "replicas": 0, "resources": {"gpus": 0}},
    {
        "model": {"source": "pvc://models/llama-3.1-8b"},
        "resources": {"gpus": 2},
        "runtime": {"tensorParallelSize": 2},
    },
    {"model": {"source": "pvc://models"}},
    {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct@main", "hfTokenSecret": {"name": "hf"}}},
    {"model": {"source": "hf://bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"}},  # one .gguf of a repository
    {"model": {"source": "hf://org/some-GGUF@refs/pr/1:Q8_0"}},
    {"model": {"source": "file:///opt/models/qwen.gguf"}, "resources": {"cpu": "500m", "memory": "16Gi"}},
    {"model": BUILTIN, "autoscaling": {"minReplicas": 0, "maxReplicas": 4}},
    {
        "model": BUILTIN,
        "autoscaling": {
            "maxReplicas": 4,
            "metricsSource": "prometheus",
            "prometheus": {"url": "http://prom:9090"},
        },
    },
    {"model": BUILTIN, "resources": {"gpus": 0}, "runtime": {"tensorParallelSize": 2}},
    {"model": BUILTIN, "resources": {"gpuType": "h100"}},
    {"model": BUILTIN, "resources": {"gpus": 4}},  # tensorParallelSize unset: shards over all 4
    {"model": BUILTIN, "oomPolicy": {"adapt": True, "maxMemory": "48Gi", "minKvCacheMemory": "256Mi"}},
    {
        "model": BUILTIN,
        "adapters": [
            {"name": "sql", "source": "pvc://adapters/sql-lora"},
            {"name": "chat.v2", "source": "hf://org/chat-lora@v2"},
            {"name": "Tone_1", "source": "file:///opt/adapters/tone"},
        ],
        "runtime": {"maxLoras": 2, "maxLoraRank": 64},
    },
    {"model": BUILTIN, "inferencePool": {"enabled": True}},
    {"model": BUILTIN, "inferencePool": {"enabled": True, "endpointPicker": {"service": "llama-epp"}}},
    {"model": BUILTIN, "inferencePool": {"enabled": False}},
]

INVALID = [
    ({"model": {"source": "s3://bucket/model"}}, "spec.model.source must be one of builtin://NAME"),
    ({"model": {"source": "hf://no-org"}}, "spec.model.source must be one of"),
    ({"model": {"source": "hf://org/name:"}}, "spec.model.source must be one of"),
    ({"model": {"source": "hf://org/name:Q4/K"}}, "spec.model.source must be one of"),
    ({"model": {"source": "pvc://Bad_Claim/x"}}, "spec.model.source must be one of"),
    (
        {"model": {**BUILTIN, "hfTokenSecret": {"name": "hf"}}},
        "spec.model.hfTokenSecret is only used with hf:// sources",
    ),
    (
        {"model": BUILTIN, "replicas": 2, "autoscaling": {"maxReplicas": 4}},
        "spec.replicas and spec.autoscaling cannot both be set when an InferenceModel is created",
    ),
    (
        {"model": BUILTIN, "autoscaling": {"minReplicas": 5, "maxReplicas": 3}},
        "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
    ),
    (
        {"model": BUILTIN, "autoscaling": {"maxReplicas": 3, "metricsSource": "prometheus"}},
        "spec.autoscaling.prometheus (with at least url) is required",
    ),
    (
        {
            "model": BUILTIN,
            "autoscaling": {
                "maxReplicas": 3,
                "metricsSource": "prometheus",
                "prometheus": {"url": "prom:9090"},
            },
        },
        "spec.autoscaling.prometheus.url must be an http:// or https:// URL",
    ),
    (
        {"model": BUILTIN, "resources": {"gpus": 3}, "runtime": {"tensorParallelSize": 2}},
        "spec.resources.gpus must equal spec.runtime.tensorParallelSize",
    ),
    (
        # A multiple is still a mismatch: the runtime would use 2 of the 4 GPUs.
        {"model": BUILTIN, "resources": {"gpus": 4}, "runtime": {"tensorParallelSize": 2}},
        "spec.resources.gpus must equal spec.runtime.tensorParallelSize",
    ),
    ({"model": BUILTIN, "resources": {"cpu": "two"}}, "spec.resources.cpu must be a Kubernetes quantity"),
    (
        {"model": BUILTIN, "resources": {"memory": "16GB"}},
        "spec.resources.memory must be a Kubernetes quantity",
    ),
    ({"model": BUILTIN, "resources": {"gpuType": "-h100"}}, "should match"),
    (
        {"model": BUILTIN, "oomPolicy": {"maxMemory": "48GB"}},
        "spec.oomPolicy.maxMemory must be a Kubernetes quantity",
    ),
    (
        {"model": BUILTIN, "adapters": [{"name": "sql", "source": "builtin://sql"}]},
        "spec.adapters[].source must be one of pvc://CLAIM/PATH",
    ),
    (
        {"model": BUILTIN, "adapters": [{"name": "-sql", "source": "pvc://a/sql"}]},
        "spec.adapters[].name must be 1-63 letters",
    ),
    (
        {
            "model": BUILTIN,
            "adapters": [{"name": "sql", "source": "pvc://a/sql"}, {"name": "sql", "source": "pvc://a/sql2"}],
        },
        "spec.adapters[].name must be unique",
    ),
    (
        {"model": BUILTIN, "inferencePool": {"endpointPicker": {"service": "epp"}}},
        "spec.inferencePool.endpointPicker is only used when spec.inferencePool.enabled is true: set "
        "enabled: true",
    ),
    (
        {"model": BUILTIN, "inferencePool": {"enabled": True, "endpointPicker": {"service": "EPP.svc"}}},
        "spec.inferencePool.endpointPicker.service must be the name of a Service in this namespace",
    ),
]


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs_pass(spec: dict[str, Any]) -> None:
    assert check(spec) == []
    assert InferenceModelSpec.model_validate(spec).check() == []


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_invalid_specs_get_their_message(spec: dict[str, Any], message: str) -> None:
    problems = check(spec)
    assert len(problems) == 1 and message in problems[0], problems


API_SERVER_ONLY = ("created", "match", "Kubernetes quantity", "http:// or https://")


@pytest.mark.parametrize(
    ("spec", "message"), [c for c in INVALID if not any(k in c[1] for k in API_SERVER_ONLY)]
)
def test_operator_mirror_agrees_with_cel(spec: dict[str, Any], message: str) -> None:
    """The operator's own check() rejects what CEL rejects (create-only rules, patterns, quantities
    and URLs are left to the API server)."""
    try:
        problems = InferenceModelSpec.model_validate(spec).check()
    except ValueError:
        return
    assert problems, message


def test_replicas_with_autoscaling_allowed_after_create() -> None:
    """The autoscaler writes spec.replicas through the scale subresource: that is an update."""
    old = {"model": BUILTIN, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    assert check({**old, "replicas": 3}, old=old) == []


def test_replicas_outside_bounds_rejected_when_replicas_change() -> None:
    old = {"model": BUILTIN, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}, "replicas": 2}
    problems = check({**old, "replicas": 9}, old=old)
    assert problems == [
        "spec.replicas must lie between spec.autoscaling.minReplicas and spec.autoscaling.maxReplicas: "
        "change replicas or widen the autoscaling bounds"
    ]


def test_lowering_max_below_current_replicas_is_allowed() -> None:
    """Ratcheting: a user may lower maxReplicas; the operator clamps and the autoscaler follows."""
    old = {"model": BUILTIN, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}, "replicas": 6}
    new = {"model": BUILTIN, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}, "replicas": 6}
    assert check(new, old=old) == []


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "InferenceModel":
            assert check(doc["spec"]) == [], path
            assert InferenceModelSpec.model_validate(doc["spec"]).check() == []


def check_object(name: str) -> list[str]:
    """The root rules (metadata.name) on a whole InferenceModel."""
    obj = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name}}
    obj["spec"] = apply_defaults(SPEC_SCHEMA, {"model": BUILTIN})
    return violations({k: v for k, v in SCHEMA.items() if k != "properties"}, obj, None, "")


@pytest.mark.parametrize("name", ["llama", "a" * 63, "llama-3-8b-instruct"])
def test_usable_names_pass(name: str) -> None:
    assert check_object(name) == []
    assert name_problems(name) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a" * 64, "metadata.name must be at most 63 characters: it becomes the kvpilot.dev/model label"),
        ("dotted.name", "metadata.name must not contain '.': it becomes the Service name"),
    ],
)
def test_unusable_names_are_refused_with_why(name: str, message: str) -> None:
    problems = check_object(name)
    assert len(problems) == 1 and problems[0].startswith(message), problems
    assert name_problems(name) == problems  # the operator's mirror says the same


def test_long_dotted_name_gets_both_messages() -> None:
    assert len(check_object("a." * 40)) == 2
