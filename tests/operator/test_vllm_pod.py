"""spec.engine: vllm pods: every spec.runtime field mapped to vLLM's flag or refused (never dropped),
the config file read back by vLLM's own argument parser, and the pod around `vllm serve`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpilot.api.models import InferenceModel, OOMOverrides, RuntimeSettings
from kvpilot.operator.builders import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_PATH,
    DEFAULT_VLLM_CPU_IMAGE,
    DEFAULT_VLLM_IMAGE,
    OperatorSettings,
    render_children,
)
from kvpilot.operator.oom import CPU_DEFAULT_KV_BYTES
from kvpilot.operator.vllm_pod import COMPUTED_FIELDS, VLLM_FLAGS, vllm_config
from tests.operator.fakes import make_body
from tests.vllm_cpu import require_vllm

SETTINGS = OperatorSettings(image="kvpilot/kvpilot:test")
HF = {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}


def vllm_model(**spec: Any) -> InferenceModel:
    body = make_body(**{"model": HF, "engine": "vllm", **spec})
    return InferenceModel.model_validate(body)


def children(model: InferenceModel, settings: OperatorSettings = SETTINGS) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render_children(model, settings)}


def pod_template(model: InferenceModel, settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    template: dict[str, Any] = children(model, settings)["Deployment"]["spec"]["template"]
    return template


def container(model: InferenceModel, settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    c: dict[str, Any] = pod_template(model, settings)["spec"]["containers"][0]
    return c


# One case per spec.runtime field (camelCase value -> what vLLM's config file gets, or the message that
# refuses it). A field added to RuntimeSettings without a case here fails test_every_runtime_field_...
MAPPED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("max_model_len", {"maxModelLen": 2048}, {"max-model-len": 2048}),
    ("block_size", {"blockSize": 32}, {"block-size": 32}),
    ("kv_cache_dtype", {"kvCacheDtype": "fp8"}, {"kv-cache-dtype": "fp8"}),
    ("enable_prefix_caching", {"enablePrefixCaching": True}, {"enable-prefix-caching": True}),
    ("enable_prefix_caching", {"enablePrefixCaching": False}, {"no-enable-prefix-caching": True}),
    ("tensor_parallel_size", {"tensorParallelSize": 2}, {"tensor-parallel-size": 2}),
    ("enable_expert_parallel", {"enableExpertParallel": True}, {"enable-expert-parallel": True}),
    ("enable_expert_parallel", {"enableExpertParallel": False}, {"no-enable-expert-parallel": True}),
    ("max_num_seqs", {"maxNumSeqs": 8}, {"max-num-seqs": 8}),
    ("max_num_batched_tokens", {"maxNumBatchedTokens": 512}, {"max-num-batched-tokens": 512}),
    ("gpu_memory_utilization", {"gpuMemoryUtilization": 0.8}, {"gpu-memory-utilization": 0.8}),
    ("max_queue_len", {"maxQueueLen": 16, "maxNumSeqs": 8}, {"max-num-queued-reqs": 24, "max-num-seqs": 8}),
    ("shutdown_timeout_seconds", {"shutdownTimeoutSeconds": 7}, {"shutdown-timeout": 7}),
    ("max_loras", {"maxLoras": 2}, {"max-loras": 2}),
    ("max_lora_rank", {"maxLoraRank": 64}, {"max-lora-rank": 64}),
]
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "kv_cache_dtype",
        {"kvCacheDtype": "int8"},
        "spec.runtime.kvCacheDtype int8 is kvpilot's KV-cache format",
    ),
    ("max_lora_rank", {"maxLoraRank": 17}, "spec.runtime.maxLoraRank must be one of 1, 8, 16, 32"),
    ("max_queue_len", {"maxQueueLen": 16}, "spec.runtime.maxQueueLen with spec.engine vllm needs"),
]


def test_every_runtime_field_has_a_case_and_a_mapping() -> None:
    fields = set(RuntimeSettings.model_fields)
    assert {f for f, _, _ in MAPPED} == fields
    assert set(VLLM_FLAGS) | set(COMPUTED_FIELDS) == fields
    assert not set(VLLM_FLAGS) & set(COMPUTED_FIELDS)


@pytest.mark.parametrize(("field", "runtime", "expected"), MAPPED, ids=[f"{f}={r}" for f, r, _ in MAPPED])
def test_runtime_field_becomes_its_vllm_flag(
    field: str, runtime: dict[str, Any], expected: dict[str, Any]
) -> None:
    # on a CPU pod, whose tensorParallelSize is not tied to resources.gpus
    model = vllm_model(runtime=runtime, resources={"gpus": 0})
    assert model.spec.check() == []
    config = vllm_config(model)
    assert {k: config.get(k) for k in expected} == expected
    baseline = vllm_config(vllm_model(resources={"gpus": 0}))
    assert config != baseline  # the field changed what vLLM is told


@pytest.mark.parametrize(("field", "runtime", "message"), REFUSED, ids=[f"{f}={r}" for f, r, _ in REFUSED])
def test_what_vllm_cannot_do_is_refused_naming_the_field(
    field: str, runtime: dict[str, Any], message: str
) -> None:
    problems = vllm_model(runtime=runtime).spec.check()
    assert len(problems) == 1 and problems[0].startswith(message), problems
    # the same spec with kvpilot's runtime is fine
    body = make_body(model=HF, runtime=runtime)
    assert InferenceModel.model_validate(body).spec.check() == []


def test_builtin_models_are_refused_for_vllm() -> None:
    body = make_body(engine="vllm")  # builtin://smollm2-135m-instruct
    (problem,) = InferenceModel.model_validate(body).spec.check()
    assert problem.startswith("spec.model.source builtin://NAME is a model packaged with kvpilot's runtime")


def test_config_has_the_model_name_port_and_defaults() -> None:
    config = vllm_config(vllm_model(model={**HF, "servedName": "smol"}, resources={"gpus": 0}))
    assert config == {
        "model": "/models/HuggingFaceTB--SmolLM2-135M-Instruct",
        "served-model-name": "smol",
        "host": "0.0.0.0",
        "port": 8000,
        "tensor-parallel-size": 1,
        "shutdown-timeout": 30,  # kvpilot's default drain; vLLM's own 0 would abort in-flight requests
        "kv-cache-memory-bytes": CPU_DEFAULT_KV_BYTES,  # CPU pods: an explicit pool, not a node share
    }
    gpu = vllm_config(vllm_model(resources={"gpus": 4}))
    assert gpu["tensor-parallel-size"] == 4 and "kv-cache-memory-bytes" not in gpu


def test_oom_overrides_cap_the_flags() -> None:
    overrides = OOMOverrides(max_num_seqs=4, kv_cache_memory=256 << 20, gpu_memory_utilization=0.75)
    cpu = vllm_config(vllm_model(resources={"gpus": 0}, runtime={"maxNumSeqs": 16}), overrides)
    assert (cpu["max-num-seqs"], cpu["kv-cache-memory-bytes"]) == (4, 256 << 20)
    gpu = vllm_config(vllm_model(resources={"gpus": 1}), overrides)
    assert (gpu["max-num-seqs"], gpu["gpu-memory-utilization"]) == (4, 0.75)
    assert "kv-cache-memory-bytes" not in gpu  # made for a CPU pod's host memory


def test_adapters_are_loaded_at_start_but_do_not_roll_the_pods() -> None:
    one = [{"name": "sql", "source": "pvc://adapters/sql"}]
    two = [*one, {"name": "chat", "source": "hf://org/chat@v2"}]
    config = vllm_config(vllm_model(adapters=two))
    assert config["enable-lora"] is True
    assert config["lora-modules"] == ["sql=/adapters/.pvc/adapters/sql", "chat=/adapters/chat"]

    def rollout_hash(adapters: list[dict[str, str]]) -> str:
        annotations = pod_template(vllm_model(adapters=adapters))["metadata"]["annotations"]
        return str(annotations[CONFIG_HASH_ANNOTATION])

    assert rollout_hash(one) == rollout_hash(two)
    assert rollout_hash(one) != rollout_hash([])  # the first adapter turns LoRA on: that rolls
    assert (
        rollout_hash(one)
        != pod_template(vllm_model(adapters=one, runtime={"maxNumSeqs": 8}))["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION
        ]
    )


@pytest.mark.parametrize(
    ("spec", "image"),
    [
        ({"resources": {"gpus": 1}}, DEFAULT_VLLM_IMAGE),
        ({"resources": {"gpus": 0}}, DEFAULT_VLLM_CPU_IMAGE),
        ({"resources": {"gpus": 0}, "image": "registry.local/vllm-cpu:mine"}, "registry.local/vllm-cpu:mine"),
    ],
)
def test_image_is_spec_image_else_the_operators_vllm_image_for_the_pod_kind(
    spec: dict[str, Any], image: str
) -> None:
    assert container(vllm_model(**spec))["image"] == image
    custom = OperatorSettings(vllm_image="gpu:x", vllm_cpu_image="cpu:x")
    expected = spec.get("image") or ("cpu:x" if spec["resources"]["gpus"] == 0 else "gpu:x")
    assert container(vllm_model(**spec), custom)["image"] == expected


def test_pod_runs_vllm_serve_with_its_config_probes_and_environment() -> None:
    model = vllm_model(
        adapters=[{"name": "sql", "source": "hf://org/sql-lora"}],
        env=[{"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}],
        extraArgs=["--max-num-seqs", "3"],
    )
    kids = children(model)
    c = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["name"] == "vllm"
    assert c["command"] == ["vllm", "serve", "--config", CONFIG_PATH, "--max-num-seqs", "3"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_NO_USAGE_STATS"]["value"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "true"
    assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "api", "key": "key"}}
    assert env["HOME"]["value"] == "/tmp"
    # the ConfigMap carries vLLM's config file, mounted where --config reads it
    assert "served-model-name: llama" in kids["ConfigMap"]["data"]["config.yaml"]
    assert {"name": "config", "mountPath": "/etc/kvpilot", "readOnly": True} in c["volumeMounts"]
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    fetches = [i["command"][:2] for i in pod["initContainers"]]
    assert fetches == [["python3", "-c"], ["python3", "-c"]]  # the model's and the adapter's
    labels = kids["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert labels["kvpilot.dev/model"] == "llama"  # the router and autoscaler find the pods by it


def test_spec_env_wins_over_what_vllm_pods_add() -> None:
    model = vllm_model(env=[{"name": "VLLM_NO_USAGE_STATS", "value": "0"}])
    values = [e.get("value") for e in container(model)["env"] if e["name"] == "VLLM_NO_USAGE_STATS"]
    assert values == ["0"]


def test_kvpilot_pods_are_unchanged_by_the_engine_field() -> None:
    body = make_body()
    default = InferenceModel.model_validate(body)
    explicit = InferenceModel.model_validate({**body, "spec": {**body["spec"], "engine": "kvpilot"}})
    assert default.spec.engine == "kvpilot"
    assert render_children(default, SETTINGS) == render_children(explicit, SETTINGS)
    assert container(default)["command"][:2] == ["kvpilot", "serve"]


# vLLM's own parser reads the config file back (a flag it does not know fails; a value it would drop,
# as it drops `flag: false`, shows as its default).
PARSE = """
import json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
out = []
for argv in json.loads(sys.argv[1]):
    args = vars(parser.parse_args(argv))
    out.append({k: args.get(k) for k in json.loads(sys.argv[2])})
print("PARSED " + json.dumps(out, default=str))
"""


def test_vllms_own_parser_reads_the_config_as_meant(tmp_path: Path) -> None:
    vllm = require_vllm()
    runtime = {
        "maxModelLen": 2048,
        "blockSize": 32,
        "kvCacheDtype": "fp8",
        "enablePrefixCaching": False,
        "enableExpertParallel": False,
        "maxNumSeqs": 8,
        "maxNumBatchedTokens": 512,
        "gpuMemoryUtilization": 0.8,
        "maxQueueLen": 16,
        "shutdownTimeoutSeconds": 7,
        "maxLoras": 2,
        "maxLoraRank": 64,
    }
    adapters = [{"name": "sql", "source": "pvc://adapters/sql"}]
    model = vllm_model(runtime=runtime, adapters=adapters, resources={"gpus": 0})
    assert model.spec.check() == []
    path = tmp_path / "config.yaml"
    path.write_text(children(model)["ConfigMap"]["data"]["config.yaml"])
    keys = [
        "model", "served_model_name", "host", "port", "tensor_parallel_size", "shutdown_timeout",
        "max_model_len", "block_size", "kv_cache_dtype", "enable_prefix_caching", "enable_expert_parallel",
        "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "max_num_queued_reqs",
        "max_loras", "max_lora_rank", "enable_lora", "lora_modules", "kv_cache_memory_bytes",
    ]  # fmt: skip
    # as the pod runs it, and with spec.extraArgs after --config (they win)
    argvs = [["serve", "--config", str(path)], ["serve", "--config", str(path), "--max-num-seqs", "3"]]
    result = subprocess.run(
        [str(vllm.python), "-c", PARSE, json.dumps(argvs), json.dumps(keys)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("PARSED ")), None)
    assert line is not None, result.stderr[-3000:]
    parsed, with_extra = json.loads(line.removeprefix("PARSED "))
    assert parsed == {
        "model": "/models/HuggingFaceTB--SmolLM2-135M-Instruct",
        "served_model_name": ["llama"],
        "host": "0.0.0.0",
        "port": 8000,
        "tensor_parallel_size": 1,
        "shutdown_timeout": 7,
        "max_model_len": 2048,
        "block_size": 32,
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "enable_expert_parallel": False,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "gpu_memory_utilization": 0.8,
        "max_num_queued_reqs": 24,
        "max_loras": 2,
        "max_lora_rank": 64,
        "enable_lora": True,
        "lora_modules": [
            "LoRAModulePath(name='sql', path='/adapters/.pvc/adapters/sql', base_model_name=None, "
            "is_3d_lora_weight=False)"
        ],
        "kv_cache_memory_bytes": CPU_DEFAULT_KV_BYTES,
    }
    assert with_extra == {**parsed, "max_num_seqs": 3}


def test_docs_table_lists_every_runtime_field() -> None:
    """docs/vllm.md's spec.runtime table has a row per field (camelCase), so the docs say how each maps."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    camel = {f.alias for f in RuntimeSettings.model_fields.values()}
    assert camel <= rows, sorted(camel - rows)
