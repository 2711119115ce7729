"""spec.engine: vllm — the pieces of a model's pods that differ from kvpilot's: `vllm serve` with its
config file, the image, the probes and the environment. Pure functions, like builders.py, which
calls them; everything else of the pod (volumes, model fetch, resources, security, scheduling) is
the kvpilot path's, unchanged.

The config file (`vllm serve --config /etc/kvpilot/config.yaml`, vLLM's own YAML of long flag names)
lives in the model's ConfigMap, as kvpilot's does, so a change rolls the pods through the same
config-hash annotation and spec.extraArgs (appended after --config) win over it. Each spec.runtime
field maps to one vLLM flag (VLLM_FLAGS and the few computed ones below); what vLLM cannot do as
written is refused by the CRD (api/engine.py), so nothing is dropped. docs/vllm.md has the table.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpilot.api.models import InferenceModel, OOMOverrides
from kvpilot.operator.builders import (
    API_KEY_ENV,
    CONFIG_PATH,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    HTTP_PORT,
    adapter_path,
    effective_runtime,
    model_path,
    sets_api_key,
)
from kvpilot.operator.oom import CPU_DEFAULT_KV_BYTES

CONTAINER_NAME = "vllm"

# spec.runtime field (snake_case) -> vLLM flag, for the fields that map one to one.
VLLM_FLAGS = {
    "max_model_len": "max-model-len",
    "block_size": "block-size",
    "kv_cache_dtype": "kv-cache-dtype",  # auto, fp8 (int8 is refused)
    "enable_prefix_caching": "enable-prefix-caching",  # false: no-enable-prefix-caching
    "enable_expert_parallel": "enable-expert-parallel",  # false: no-enable-expert-parallel
    "max_num_seqs": "max-num-seqs",
    "max_num_batched_tokens": "max-num-batched-tokens",
    "gpu_memory_utilization": "gpu-memory-utilization",
    "max_loras": "max-loras",
    "max_lora_rank": "max-lora-rank",
}
# The fields mapped by computation: tensorParallelSize (unset: every GPU of the pod),
# shutdownTimeoutSeconds (unset: kvpilot's default, vLLM's own is 0 = abort in-flight requests) and
# maxQueueLen (vLLM caps waiting plus running: maxQueueLen + maxNumSeqs).
COMPUTED_FIELDS = ("tensor_parallel_size", "shutdown_timeout_seconds", "max_queue_len")


def vllm_config(
    im: InferenceModel, overrides: OOMOverrides | None = None, adapters: bool = True
) -> dict[str, Any]:
    """vLLM's config file for this model: spec.runtime, capped by the OOM overrides, as vLLM flags.
    `adapters=False` leaves out the adapter list (the operator brings running pods in line with it
    through the pods' API, so it does not roll them)."""
    spec = im.spec
    cpu = spec.resources.gpus == 0
    rt = effective_runtime(spec.runtime, overrides)
    kv_bytes = rt.pop("kv_cache_memory", None)
    shutdown = rt.pop("shutdown_timeout_seconds", None)
    queue = rt.pop("max_queue_len", None)
    rt.pop("tensor_parallel_size", None)
    config: dict[str, Any] = {
        "model": model_path(spec.model.source),
        "served-model-name": spec.model.served_name or im.name,
        "host": "0.0.0.0",
        "port": HTTP_PORT,
        "tensor-parallel-size": spec.effective_tensor_parallel_size(),
        "shutdown-timeout": DEFAULT_SHUTDOWN_TIMEOUT_S if shutdown is None else shutdown,
    }
    for key, value in rt.items():
        flag = VLLM_FLAGS[key]  # a KeyError here is a spec.runtime field nobody mapped
        if value is False:
            # vLLM's config file turns `flag: false` into --no-flag only for flags its top-level parser
            # knows, which the serve flags are not: it would drop it. `no-flag: true` is --no-flag.
            config[f"no-{flag}"] = True
        else:
            config[flag] = value
    if queue is not None:
        config["max-num-queued-reqs"] = queue + rt["max_num_seqs"]  # the CRD requires maxNumSeqs
    if cpu:
        # vLLM's CPU backend sizes its KV cache from --gpu-memory-utilization times the *node's* memory,
        # which the pod's memory limit does not bound: CPU pods get an explicit pool, the size kvpilot's
        # runtime takes on a CPU, which the OOM adaptation halves from (a GPU pod sizes its pool from
        # gpuMemoryUtilization, and the override is made for host memory).
        config["kv-cache-memory-bytes"] = CPU_DEFAULT_KV_BYTES if kv_bytes is None else kv_bytes
    if spec.adapters:
        config["enable-lora"] = True
        if adapters:
            config["lora-modules"] = [f"{a.name}={adapter_path(a)}" for a in spec.adapters]
    return config


def vllm_config_yaml(im: InferenceModel, overrides: OOMOverrides | None = None, adapters: bool = True) -> str:
    return yaml.safe_dump(vllm_config(im, overrides, adapters), sort_keys=True)


def vllm_image(im: InferenceModel, gpu_image: str, cpu_image: str) -> str:
    """spec.image, else the operator's vLLM image for the pod's kind (GPU or CPU)."""
    return im.spec.image or (cpu_image if im.spec.resources.gpus == 0 else gpu_image)


def vllm_env(im: InferenceModel, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kvpilot container's environment (`env`, spec.env last) plus what vLLM reads: no usage
    reports to vLLM's servers, runtime LoRA loading when the model has adapters (the operator loads
    and unloads them in running pods, operator/adapters.py), and the API key spec.env gives kvpilot's
    runtime (KVPILOT_API_KEY) as vLLM's VLLM_API_KEY, so the same key guards both engines' /v1."""
    extra: list[dict[str, Any]] = [{"name": "VLLM_NO_USAGE_STATS", "value": "1"}]
    if im.spec.adapters:
        extra.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"})
    if sets_api_key(im):
        key = next(v for v in reversed(im.spec.env or []) if v.name == API_KEY_ENV)
        extra.append({**key.dump(), "name": "VLLM_API_KEY"})
    names = {e["name"] for e in env}
    # spec.env comes last and wins: what it sets itself is not added again.
    return [*[e for e in extra if e["name"] not in names], *env]


def vllm_command(im: InferenceModel) -> list[str]:
    return ["vllm", "serve", "--config", CONFIG_PATH, *(im.spec.extra_args or [])]
