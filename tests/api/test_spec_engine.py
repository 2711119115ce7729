"""spec.engine's CEL rules (api/engine.py), as the API server evaluates them, and their Python mirror
agree: each spec vLLM cannot serve as written gets its one message from both, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.api.engine import ENGINES, VLLM_RULES
from kvpilot.api.models import InferenceModelSpec
from tests.api.test_cel import SPEC_SCHEMA, check

HF = {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}

VALID = [
    {"model": HF, "engine": "vllm"},
    {"model": {"source": "pvc://models/llama-3.1-8b"}, "engine": "vllm", "resources": {"gpus": 2}},
    {"model": {"source": "file:///opt/smollm2"}, "engine": "vllm", "resources": {"gpus": 0}},
    {
        "model": HF,
        "engine": "vllm",
        "runtime": {"kvCacheDtype": "fp8", "maxLoraRank": 64, "maxQueueLen": 32, "maxNumSeqs": 8},
        "adapters": [{"name": "sql", "source": "pvc://adapters/sql"}],
    },
    {"model": HF, "engine": "vllm", "runtime": {"kvCacheDtype": "auto", "maxLoraRank": 320}},
    # kvpilot's runtime takes all of these
    {"model": {"source": "builtin://smollm2-135m-instruct"}, "runtime": {"kvCacheDtype": "int8"}},
    {"model": HF, "engine": "kvpilot", "runtime": {"maxLoraRank": 17, "maxQueueLen": 32}},
    {"model": HF, "engine": "kvpilot", "disaggregation": {"prefill": {}, "decode": {}}},
    {"model": {"source": "hf://org/tiny-GGUF:Q4_K_M"}, "engine": "kvpilot"},
]

INVALID = [
    (
        {"model": {"source": "builtin://smollm2-135m-instruct"}, "engine": "vllm"},
        "spec.model.source builtin://NAME is a model packaged with kvpilot's runtime, which vLLM cannot "
        "load: with spec.engine vllm use hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH",
    ),
    (
        {"model": {"source": "hf://org/tiny-GGUF@v2:Q4_K_M"}, "engine": "vllm"},
        "spec.model.source hf://ORG/NAME:QUANT picks one .gguf file of a repository for kvpilot's runtime",
    ),
    (
        {"model": HF, "engine": "vllm", "runtime": {"kvCacheDtype": "int8"}},
        "spec.runtime.kvCacheDtype int8 is kvpilot's KV-cache format",
    ),
    (
        {"model": HF, "engine": "vllm", "runtime": {"maxLoraRank": 17}},
        "spec.runtime.maxLoraRank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512 with spec.engine vllm",
    ),
    (
        {"model": HF, "engine": "vllm", "runtime": {"maxQueueLen": 32}},
        "spec.runtime.maxQueueLen with spec.engine vllm needs spec.runtime.maxNumSeqs",
    ),
    (
        {"model": HF, "engine": "vllm", "disaggregation": {"prefill": {}, "decode": {}}},
        "spec.disaggregation runs kvpilot's prefill/decode roles and KV transfer, which vLLM pods do not",
    ),
]


def test_engine_field_defaults_to_kvpilot_and_lists_the_engines() -> None:
    prop = SPEC_SCHEMA["properties"]["engine"]
    assert prop["enum"] == list(ENGINES) == ["kvpilot", "vllm"]
    assert prop["default"] == "kvpilot" and prop["description"]
    rules = {r["rule"] for r in SPEC_SCHEMA["x-kubernetes-validations"]}
    assert {r.cel for r in VLLM_RULES} <= rules


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs_pass(spec: dict[str, Any]) -> None:
    assert check(spec) == []
    assert InferenceModelSpec.model_validate(spec).check() == []


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_cel_and_the_mirror_refuse_with_the_same_message(spec: dict[str, Any], message: str) -> None:
    problems = check(spec)
    assert len(problems) == 1 and problems[0].startswith(message), problems
    assert InferenceModelSpec.model_validate(spec).check() == problems


def test_every_rule_is_exercised() -> None:
    messages = {m for _, m in INVALID}
    for rule in VLLM_RULES:
        assert any(rule.message.startswith(m) for m in messages), rule.message
