"""Runtime configuration: one pydantic model shared by the CLI flags, `--config FILE` (YAML) and the
operator, which renders exactly this schema into a ConfigMap.

Field names are the vLLM flag names with underscores (`--max-num-seqs` -> `max_num_seqs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpilot.kernels.switches import Activations

DEFAULT_MODEL = "smollm2-135m-instruct"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "float32", "bfloat16", "fp8", "int8"]
SpeculativeMethod = Literal["ngram", "draft"]
MAX_SPECULATIVE_TOKENS = 16
Quantization = Literal["int8", "int4", "auto", "none"]
KVRole = Literal["prefill", "decode", "both"]
# `kvpilot serve` ends at most this many seconds after --shutdown-timeout has run out, even with its
# engine stuck (runtime/serving/lifecycle.py); the operator's terminationGracePeriodSeconds leaves room for it
EXIT_GRACE_S = 10.0


class ConfigError(ValueError):
    """Settings that cannot work with this model or machine (found while loading): `kvpilot serve`
    prints the message, which names the flag, on one line and exits 2."""


class EngineConfig(BaseModel):
    """Everything `kvpilot serve` accepts. Unknown keys in a config file are an error."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    model: str = Field(
        DEFAULT_MODEL, description="builtin name, a .gguf file or a Hugging Face-style directory"
    )
    served_model_name: str | None = Field(None, description="name clients use; defaults to the model name")
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Dtype = "auto"
    max_model_len: int | None = Field(None, ge=16, description="defaults to the model's context length")
    max_num_seqs: int = Field(64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(2048, ge=16)
    block_size: int | None = Field(
        None,
        ge=1,
        le=256,
        description="tokens per KV block; default: 256 on CUDA with flash-attn installed (its paged kernel "
        "reads pages of a multiple of 256), else 16 (see runtime.engine.plan.resolve_block_size)",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto",
        description="KV cache storage: auto (the model's dtype; bfloat16 on the CPU under float32 "
        "activations), float32 or bfloat16 (the CPU, or the model's dtype on a GPU), fp8 or int8 (a "
        "scale per token and head)",
    )
    enable_prefix_caching: bool = True
    quantization: Quantization | None = Field(
        None,
        description="weight-only quantization of every linear layer and the LM head: int8 (per "
        "output channel; the head group-wise), int4 (group-wise), auto (the checkpoint's own: a GGUF's "
        "Q8_0/Q4_0/Q4_1/Q4_K layers run from their blocks, a GPTQ/AWQ directory), none (the weights "
        "dequantized to the model dtype at load); default: the default path picks (auto with float "
        "activations for a GGUF stored in those blocks on an AVX2/AVX-512 CPU, else none: "
        "runtime/load/defaults.py)",
    )
    quantization_group_size: Literal[32, 64, 128] = Field(
        32, description="int4 weights per scale and min (along the input dimension)"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    enable_expert_parallel: bool = Field(
        False,
        description="MoE models: place whole experts on the tensor-parallel ranks instead of splitting each",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory: int | None = Field(
        None, ge=1 << 16, description="KV pool budget in bytes (CPU default 1 GiB)"
    )
    max_queue_len: int = Field(1024, ge=1, description="waiting requests beyond this get 429")
    shutdown_timeout: float = Field(
        30.0,
        ge=0.0,
        description="seconds to let in-flight requests finish on SIGTERM; the process ends at most "
        "EXIT_GRACE_S (10 s) later, even if the engine is stuck",
    )
    engine_stall_timeout: float = Field(
        60.0,
        ge=0.0,
        description="seconds the engine loop may go without progress (a step or an idle wait) while "
        "it has work before /health and /ready answer 503 (a floor: a step may take 4x what the "
        "measured pace gives its tokens); 0: never (runtime/engine/health.py)",
    )
    # structured output: limits on compiling a request's grammar (docs/runtime.md, "Structured output")
    grammar_compile_timeout: float = Field(
        10.0, gt=0.0, le=3600.0, description="seconds a grammar may take to compile; longer is a 400"
    )
    grammar_compile_memory: int = Field(
        2 * 2**30, ge=64 * 2**20, description="bytes a grammar's compile may use (RLIMIT_AS); more is a 400"
    )
    grammar_compile_workers: int = Field(
        2, ge=1, le=64, description="grammar worker processes: grammars compiled at once"
    )
    grammar_compile_queue: int = Field(
        64, ge=0, description="distinct grammars waiting for a worker; beyond this, 429"
    )
    grammar_max_bytes: int = Field(
        256 * 2**10,
        ge=1024,
        description="largest schema, regex, grammar or choice list (bytes); larger is a 400",
    )
    api_key: str | None = Field(None, description="bearer key; prefer KVPILOT_API_KEY or api_key_file")
    api_key_file: str | None = None
    threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU")
    enforce_eager: bool = Field(False, description="disable CUDA graphs")
    seed: int = 0
    # speculative decoding (docs/runtime.md, "Speculative decoding")
    speculative_method: SpeculativeMethod | None = Field(
        None, description="ngram (prompt lookup) or draft (a smaller model, --speculative-model)"
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=MAX_SPECULATIVE_TOKENS, description="tokens proposed per step (at most)"
    )
    speculative_model: str | None = Field(
        None, description="the draft model (builtin name, .gguf, directory)"
    )
    prompt_lookup_min: int = Field(1, ge=1, le=64, description="ngram: shortest n-gram to match")
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="ngram: longest n-gram to match")
    speculative_adaptive: bool = Field(
        True, description="propose fewer tokens (or none) when acceptance or the batch load says so"
    )
    speculative_disable_by_batch_size: int | None = Field(
        None, ge=1, description="no speculation while this many sequences or more are running"
    )
    # LoRA adapters (docs/runtime.md, "LoRA adapters")
    enable_lora: bool = Field(
        False, description="serve PEFT LoRA adapters (implied by lora_modules or runtime updates)"
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="adapters loaded at start: name -> PEFT adapter folder"
    )
    max_loras: int = Field(4, ge=1, le=256, description="adapters resident on the device at once")
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank accepted")
    enable_lora_runtime_updates: bool = Field(
        False,
        description="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they need the API key)",
    )
    allow_lora_updates_without_api_key: bool = Field(
        False,
        description="let those endpoints answer when no API key is set (implies enable_lora_runtime_updates)",
    )
    # kernel switches (kernels/switches.py; docs/runtime.md, "Kernel switches"): the environment
    # variables named there override these, read once when the engine is built
    cpu_isa: Literal["auto", "avx512", "avx2", "generic"] = Field(
        "auto", description="ISA level the CPU kernels are built for; auto: the best this CPU runs"
    )
    cpu_kernels: bool = Field(True, description="use the C kernels on CPU (off: the torch paths)")
    qmatmul_activations: Activations | None = Field(
        None,
        description="quantized matmuls on CPU: int8 activations (per block of 32, integer dot products), "
        "int16 (per block of 32 to 16 bits, the weights exact), bf16 (each activation rounded to "
        "bfloat16, the weights exact) or float (the exact product); "
        "default: int8 under an explicit --quantization, else the default path's",
    )
    cpu_decoder_stack: bool = Field(
        True, description="run a CPU decode step's decoder layers in one C call where the model allows"
    )
    kernel_cache_dir: str | None = Field(
        None, description="where built CPU kernels are cached (default ~/.cache/kvpilot/kernels)"
    )
    # prefill/decode disaggregation (docs/disaggregation.md)
    kv_role: KVRole = Field(
        "both",
        description="prefill: runs prompts and hands their KV blocks over; decode: admits requests whose "
        "KV arrives from a prefill pod; both: an aggregated pod that accepts either",
    )
    kv_transfer_timeout: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        description="decode side: seconds a KV pull may take before the prompt is recomputed locally",
    )
    kv_transfer_ttl: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="prefill side: seconds a transfer's pinned blocks wait for the decode pod to release them",
    )
    kv_transfer_pin_fraction: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="prefill side: the share of the KV pool pinned transfers may hold; beyond it a "
        "prefill answers without kv_transfer_params (the decode pod then recomputes)",
    )

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, modules: dict[str, str]) -> dict[str, str]:
        from kvpilot.runtime.lora.names import adapter_name_problem

        for name in modules:
            problem = adapter_name_problem(name)
            if problem is not None:
                raise ValueError(problem)
        return modules

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.allow_lora_updates_without_api_key:
            self.enable_lora_runtime_updates = True
        if self.lora_modules or self.enable_lora_runtime_updates:
            self.enable_lora = True
        if self.max_model_len is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")
        method = self.speculative_method
        if method is None:
            if self.num_speculative_tokens is not None:
                raise ValueError("--num-speculative-tokens needs --speculative-method (ngram or draft)")
            if self.speculative_model is not None:
                raise ValueError("--speculative-model needs --speculative-method draft")
            return self
        if self.num_speculative_tokens is None:
            raise ValueError(
                f"--speculative-method {method} needs --num-speculative-tokens (1..{MAX_SPECULATIVE_TOKENS})"
            )
        if method == "draft" and self.speculative_model is None:
            raise ValueError("--speculative-method draft needs --speculative-model PATH")
        if method == "ngram" and self.speculative_model is not None:
            raise ValueError("--speculative-model is only used with --speculative-method draft")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--prompt-lookup-min ({self.prompt_lookup_min}) is above --prompt-lookup-max "
                f"({self.prompt_lookup_max})"
            )
        if method == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-method draft does not run with --tensor-parallel-size > 1")
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).stem if self.model != DEFAULT_MODEL else DEFAULT_MODEL

    def resolved_api_key(self) -> str | None:
        import os

        if self.api_key:
            return self.api_key
        if self.api_key_file:
            return Path(self.api_key_file).read_text().strip() or None
        return os.environ.get("KVPILOT_API_KEY") or None

    @classmethod
    def from_file(cls, path: str | Path) -> EngineConfig:
        data: Any = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings at the top level")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(exclude_none=True), sort_keys=True)
