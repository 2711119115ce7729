"""The InferenceModel API (kvpilot.dev/v1alpha1) as pydantic models.

These models are the single source of the CRD schema (`crd.py` turns them into an OpenAPI v3
structural schema) and of the operator's own parsing of a live object. Field names are the
camelCase names users write in YAML (aliases); Python code uses snake_case.

Cross-field rules live here as CEL `x-kubernetes-validations` so that the API server rejects a bad
spec at `kubectl apply` time with a message that names the field and the fix. The same rules are
mirrored in `InferenceModelSpec.check()` so that the operator never acts on a spec the API server
would have refused (for example one stored before a CRD upgrade).

See docs/crd-contract.md for the contract shared with the autoscaler.

Why one module past 600 lines: it is the declarative schema of one CRD (spec, then status), read top to
bottom as the reference of what users may write and what the controllers write; its size is field
descriptions and CEL messages, not logic. The logic that acts on it lives elsewhere.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.alias_generators import to_camel

from kvpilot.api import disaggregation as pd
from kvpilot.api import engine as engines

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"
SINGULAR = "inferencemodel"
SHORT_NAMES = ["im"]

# Labels on the objects the operator creates, which the autoscaler and the router select by.
MODEL_LABEL = f"{GROUP}/model"  # every pod of a model: kvpilot.dev/model=<metadata.name>
GPU_TYPE_LABEL = f"{GROUP}/gpu-type"  # node label that spec.resources.gpuType selects
KV_ROLE_LABEL = (
    f"{GROUP}/kv-role"  # pods of a disaggregated model: prefill or decode (docs/disaggregation.md)
)

# Defaults of spec.autoscaling (the CRD stores them; the autoscaler applies them to objects stored
# without them) and of spec.autoscaling.slo.
DEFAULT_MIN_REPLICAS = 1
DEFAULT_TARGET_KV_CACHE_UTILIZATION = 0.7
DEFAULT_TARGET_QUEUE_DEPTH = 4.0
DEFAULT_SCALE_UP_STABILIZATION_S = 0
# 240, not the HPA's 300: on the fleet battery (docs/autoscaler.md, "Thirteenth round") the fifth minute
# of holding a peak's size bought no attainment goal and cost 1-5% of the replica-hours.
DEFAULT_SCALE_DOWN_STABILIZATION_S = 240
DEFAULT_TTFT_S = 2.0
DEFAULT_TPOT_S = 0.05
DEFAULT_TTFT_PREFILL_FACTOR = 2.0
DEFAULT_ATTAINMENT_TARGET = 0.99

MAX_REPLICAS = 1000
SOURCE_PATTERN = (
    r"^(builtin://[a-z0-9][a-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?(:[A-Za-z0-9._-]+)?"
    r"|file:///.+)$"
)
SOURCE_HELP = (
    "spec.model.source must be one of builtin://NAME (e.g. builtin://smollm2-135m-instruct), "
    "pvc://CLAIM/PATH (a .gguf file or model directory inside a PersistentVolumeClaim), "
    "hf://ORG/NAME[@REVISION][:QUANT] (:QUANT picks one .gguf of a GGUF repository, e.g. :Q4_K_M) "
    "or file:///ABSOLUTE/PATH (baked into the image)"
)
# Kubernetes resource quantity (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/)
QUANTITY_PATTERN = r"^[0-9]+([.][0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
TP_HELP = (
    "spec.resources.gpus must equal spec.runtime.tensorParallelSize (the runtime uses exactly "
    "tensorParallelSize GPUs, so extra GPUs would sit idle): set gpus to tensorParallelSize, or leave "
    "tensorParallelSize unset to shard over all of resources.gpus"
)


def _rule(rule: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"rule": rule, "message": message, **extra}


def _validations(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class _Model(BaseModel):
    """Base: camelCase aliases, unknown fields ignored (the API server prunes them anyway)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        use_attribute_docstrings=True,
    )

    def dump(self) -> dict[str, Any]:
        """The object as it appears in YAML: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------
# spec
# ---------------------------------------------------------------------------------------------


class SecretKeyRef(_Model):
    """A key of a Secret in the InferenceModel's namespace."""

    name: str = Field(min_length=1, max_length=253, description="name of the Secret")
    key: str = Field("token", min_length=1, max_length=253, description="key within the Secret")


class ModelSource(_Model):
    """Which weights to serve and under which name."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _rule(
                "!has(self.hfTokenSecret) || self.source.startsWith('hf://')",
                "spec.model.hfTokenSecret is only used with hf:// sources: remove hfTokenSecret "
                "or change spec.model.source to hf://ORG/NAME",
            )
        )
    )

    source: str = Field(
        min_length=1,
        max_length=512,
        description=(
            "Where the weights come from: builtin://NAME, pvc://CLAIM/PATH, hf://ORG/NAME[@REVISION][:QUANT] "
            "or file:///ABSOLUTE/PATH. :QUANT names the one .gguf model of a GGUF repository to fetch "
            "(the file whose name ends in -QUANT.gguf or .QUANT.gguf, or every part of a split one, "
            "-QUANT-00001-of-0000N.gguf, as llama.cpp's -hf REPO:QUANT)."
        ),
        json_schema_extra=_validations(_rule(f"self.matches('{SOURCE_PATTERN}')", SOURCE_HELP)),
    )
    served_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The model name clients send in requests; defaults to metadata.name.",
    )
    hf_token_secret: SecretKeyRef | None = Field(
        None, description="Secret holding a Hugging Face token (only for hf:// sources)."
    )


ADAPTER_SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    r"|file:///.+)$"
)
ADAPTER_SOURCE_HELP = (
    "spec.adapters[].source must be one of pvc://CLAIM/PATH (a PEFT adapter folder inside a "
    "PersistentVolumeClaim), hf://ORG/NAME[@REVISION] or file:///ABSOLUTE/PATH (baked into the image)"
)
# The one rule for adapter names: spec.adapters[].name here, and in the runtime `--lora-modules NAME=...`
# and POST /v1/load_lora_adapter (kvpilot.runtime.lora.names).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ADAPTER_NAME_RULE = "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
ADAPTER_NAME_HELP = f"spec.adapters[].name must be {ADAPTER_NAME_RULE}: clients send it as `model`"
MAX_ADAPTERS = 64
ADAPTERS_UNIQUE_HELP = "spec.adapters[].name must be unique: two adapters cannot share a name"


class LoRAAdapter(_Model):
    """A PEFT LoRA adapter served next to the base model; clients select it with `model: <name>`."""

    name: str = Field(
        min_length=1,
        max_length=63,
        description="The model name clients send to use this adapter.",
        json_schema_extra=_validations(_rule(f"self.matches('{ADAPTER_NAME_PATTERN}')", ADAPTER_NAME_HELP)),
    )
    source: str = Field(
        min_length=1,
        max_length=512,
        description=(
            "Where the adapter (adapter_config.json + adapter_model.safetensors) comes from: "
            "pvc://CLAIM/PATH, hf://ORG/NAME[@REVISION] or file:///ABSOLUTE/PATH."
        ),
        json_schema_extra=_validations(
            _rule(f"self.matches('{ADAPTER_SOURCE_PATTERN}')", ADAPTER_SOURCE_HELP)
        ),
    )


class PrometheusSettings(_Model):
    """Where the autoscaler reads metrics when metricsSource is prometheus."""

    url: str = Field(
        max_length=1024,
        description="Prometheus base URL, e.g. http://prometheus.monitoring.svc:9090",
        json_schema_extra=_validations(
            _rule(
                "self.matches('^https?://.+')",
                "spec.autoscaling.prometheus.url must be an http:// or https:// URL of the Prometheus "
                "server, e.g. http://prometheus.monitoring.svc:9090",
            )
        ),
    )
    kv_query: str | None = Field(
        None,
        max_length=4096,
        description=(
            "PromQL for KV-cache usage (0..1) by pod; {namespace}, {model} (served name) and {pods} "
            "(a regex of the Ready pods' names) are filled in."
        ),
    )
    queue_query: str | None = Field(
        None, max_length=4096, description="PromQL for waiting requests by pod (same placeholders)."
    )


class SloPlanner(_Model):
    """Size the fleet for the arrival rate and token mix at what one replica serves within the SLO."""

    calibration: str = Field(
        min_length=3,
        max_length=128,
        description=(
            "The replica's performance model, GPU/MODEL[/DTYPE][/tpN], e.g. h100/llama-3.1-8b or "
            "h100/llama-3.1-70b/fp8/tp2 (`kvpilot autoscaler simulate --list-calibrations` lists them)."
        ),
        json_schema_extra=_validations(
            _rule(
                "self.matches('^[A-Za-z0-9.-]+/[A-Za-z0-9.-]+(/[A-Za-z0-9]+){0,2}$')",
                "spec.autoscaling.slo.calibration must be GPU/MODEL[/DTYPE][/tpN], e.g. h100/llama-3.1-8b",
            )
        ),
    )
    ttft_seconds: float = Field(
        DEFAULT_TTFT_S, gt=0.0, le=3600.0, description="Time-to-first-token target (base)."
    )
    tpot_seconds: float = Field(DEFAULT_TPOT_S, gt=0.0, le=60.0, description="Time-per-output-token target.")
    ttft_prefill_factor: float = Field(
        DEFAULT_TTFT_PREFILL_FACTOR,
        ge=0.0,
        le=100.0,
        description="The TTFT target grows by this many times the prompt's prefill time on an idle replica.",
    )
    attainment_target: float = Field(
        DEFAULT_ATTAINMENT_TARGET,
        ge=0.5,
        lt=1.0,
        description=(
            "Share of requests that must meet the SLO. The autoscaler measures it (the router's "
            "kvpilot_router_slo_requests_total, else the pods' latency histograms) and grows the fleet "
            "when the measured share is below it; it scales down only while the share has headroom."
        ),
    )
    tpot_tail_budget: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description=(
            "Opt-in TPOT tail rule: the share of requests (e.g. 0.005) that may miss the TPOT target "
            "because prefill steps land among the few decode steps of short outputs. The output-length "
            "distribution is read from the replicas' kvpilot_request_generation_tokens histogram "
            "(vLLM's request_generation_tokens); geometric at the observed mean until 200 requests "
            "have finished. Unset: size for the mean step only."
        ),
    )


class Autoscaling(_Model):
    """KV-cache and queue-aware autoscaling; when set, the autoscaler owns spec.replicas."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _rule(
                "self.minReplicas <= self.maxReplicas",
                "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas: lower "
                "minReplicas or raise maxReplicas",
            ),
            _rule(
                "self.metricsSource != 'prometheus' || has(self.prometheus)",
                "spec.autoscaling.prometheus (with at least url) is required when "
                "spec.autoscaling.metricsSource is prometheus: add it, or set metricsSource to pods",
            ),
        )
    )

    min_replicas: int = Field(
        DEFAULT_MIN_REPLICAS, ge=0, le=MAX_REPLICAS, description="Fewest replicas (0 allows scale to zero)."
    )
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS, description="Most replicas.")
    target_kv_cache_utilization: float = Field(
        DEFAULT_TARGET_KV_CACHE_UTILIZATION,
        gt=0.0,
        le=1.0,
        alias="targetKVCacheUtilization",
        description="Target mean KV-cache usage per replica (0..1].",
    )
    target_queue_depth: float = Field(
        DEFAULT_TARGET_QUEUE_DEPTH, gt=0.0, description="Target waiting requests per replica."
    )
    scale_up_stabilization_seconds: int = Field(
        DEFAULT_SCALE_UP_STABILIZATION_S,
        ge=0,
        le=3600,
        description="Window over which scale-up takes the lowest recommendation.",
    )
    scale_down_stabilization_seconds: int = Field(
        DEFAULT_SCALE_DOWN_STABILIZATION_S,
        ge=0,
        le=3600,
        description="Window over which scale-down takes the highest recommendation.",
    )
    startup_seconds: int | None = Field(
        None,
        ge=0,
        le=3600,
        description=(
            "Declared replica startup (pod created -> Ready), seconds: the startup-aware rules use it "
            "until one is measured from the model's Ready pods (the measurement wins). Unset: unknown "
            "until measured."
        ),
    )
    metrics_source: Literal["pods", "prometheus"] = Field(
        "pods", description="pods: scrape each pod's /metrics; prometheus: query the Prometheus HTTP API."
    )
    prometheus: PrometheusSettings | None = None
    slo: SloPlanner | None = Field(
        None,
        description="SLO planner: also size for the forecast arrival rate at the replica's capacity "
        "within these targets (docs/autoscaler.md); the KV and queue targets stay as a floor.",
    )


class Resources(_Model):
    """What each replica asks of its node."""

    gpus: int = Field(1, ge=0, le=16, description="nvidia.com/gpu per replica; 0 runs on CPU.")
    gpu_type: str | None = Field(
        None,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="Schedule only on nodes labelled kvpilot.dev/gpu-type=<gpuType>, e.g. h100.",
    )
    cpu: str | None = Field(
        None,
        max_length=32,
        description="CPU request, a Kubernetes quantity such as '4' or '500m'.",
        json_schema_extra=_validations(
            _rule(
                f"self.matches('{QUANTITY_PATTERN}')",
                "spec.resources.cpu must be a Kubernetes quantity such as '4' or '500m'",
            )
        ),
    )
    memory: str | None = Field(
        None,
        max_length=32,
        description="Memory request and limit, a Kubernetes quantity such as '32Gi'.",
        json_schema_extra=_validations(
            _rule(
                f"self.matches('{QUANTITY_PATTERN}')",
                "spec.resources.memory must be a Kubernetes quantity such as '32Gi' or '512Mi'",
            )
        ),
    )


class Routing(_Model):
    """How `kvpilot router` spreads this model's requests over its pods."""

    policy: Literal["round-robin", "least-loaded", "prefix-affinity", "kv-aware"] | None = Field(
        None,
        description=(
            "round-robin, least-loaded, prefix-affinity (consistent hashing with bounded load on the "
            "prompt's leading blocks or a session header) or kv-aware; the router's --policy by default."
        ),
    )
    fallback_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description=(
            "Served name of another model in the namespace that takes this model's requests when they "
            "would get 429 (queue full or waited too long) and it has a pod with room."
        ),
    )


# spec.disaggregation: prefill/decode (P/D) roles, one Deployment each (docs/disaggregation.md).
KvRole = Literal["prefill", "decode"]
KV_ROLES: tuple[KvRole, ...] = ("prefill", "decode")
DEFAULT_PD_MIN_PROMPT_TOKENS = 512
DEFAULT_KV_TRANSFER_TIMEOUT_S = 10.0


class RoleResources(Resources):
    """What each pod of one role asks of its node; each set field over spec.resources."""

    gpus: int | None = Field(  # type: ignore[assignment]  # unset: spec.resources.gpus (no default here)
        None, ge=0, le=16, description="Must equal spec.resources.gpus when set (both roles shard alike)."
    )


class DisaggregationRole(_Model):
    """One role's pods: how many, what each asks of its node, and engine settings over spec.runtime."""

    replicas: int | None = Field(
        None,
        ge=0,
        le=MAX_REPLICAS,
        description="Replicas of this role (default 1). Leave unset with autoscaling: the autoscaler owns it.",
    )
    min_replicas: int | None = Field(
        None,
        ge=0,
        le=MAX_REPLICAS,
        description="Fewest replicas with autoscaling; spec.autoscaling's by default.",
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        le=MAX_REPLICAS,
        description="Most replicas with autoscaling; spec.autoscaling's by default.",
    )
    resources: RoleResources | None = Field(
        None, description="What each pod of the role asks, each set field over spec.resources."
    )
    runtime: RuntimeSettings | None = Field(
        None, description="Engine settings for this role, each set field over spec.runtime's."
    )


class Disaggregation(_Model):
    """Prefill/decode disaggregation: prefill pods run prompts and hand their KV blocks to decode pods."""

    prefill: DisaggregationRole = Field(
        default_factory=lambda: DisaggregationRole.model_validate({}), json_schema_extra={"default": {}}
    )
    decode: DisaggregationRole = Field(
        default_factory=lambda: DisaggregationRole.model_validate({}), json_schema_extra={"default": {}}
    )
    min_prompt_tokens: int = Field(
        DEFAULT_PD_MIN_PROMPT_TOKENS,
        ge=0,
        le=1 << 20,
        description="Prompts shorter than this many tokens skip the prefill pool and run on a decode pod.",
    )
    transfer_timeout_seconds: float = Field(
        DEFAULT_KV_TRANSFER_TIMEOUT_S,
        gt=0.0,
        le=600.0,
        description="Deadline of one KV transfer (past it the decode pod recomputes the prompt) and of "
        "the router's wait for a prefill pod with room; the prompt's run on it may take this plus 4x what "
        "the prefill pool's measured speed gives the prompt.",
    )

    def role(self, name: KvRole) -> DisaggregationRole:
        return self.prefill if name == "prefill" else self.decode


# spec.inferencePool: a Gateway API Inference Extension InferencePool for the model's pods.
DNS1035_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
EPP_SERVICE_HELP = (
    "spec.inferencePool.endpointPicker.service must be the name of a Service in this namespace "
    "(a DNS-1035 label: lowercase letters, digits and '-', starting with a letter)"
)
INFERENCE_POOL_ENABLED_HELP = (
    "spec.inferencePool.endpointPicker is only used when spec.inferencePool.enabled is true: set "
    "enabled: true to create the InferencePool, or remove endpointPicker"
)


class EndpointPicker(_Model):
    """The endpoint picker (EPP) a gateway asks which pod of the pool takes each request."""

    service: str = Field(
        max_length=63,
        description="Name of the endpoint picker's Service in this namespace (the pool's endpointPickerRef).",
        json_schema_extra=_validations(_rule(f"self.matches('{DNS1035_PATTERN}')", EPP_SERVICE_HELP)),
    )
    port: int = Field(
        9002,
        ge=1,
        le=65535,
        description="The Service port of the picker's ext-proc gRPC server (9002: the GIE default).",
    )


class InferencePoolSettings(_Model):
    """Create a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) for this
    model, so a GIE-conformant gateway can front it."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _rule("self.enabled || !has(self.endpointPicker)", INFERENCE_POOL_ENABLED_HELP)
        )
    )

    enabled: bool = Field(
        False,
        description=(
            "Create an InferencePool named after the model that selects its pods (kvpilot.dev/model) on the "
            "runtime's port 8000, when the cluster serves the InferencePool API (condition InferencePoolReady "
            "says when it does not); false removes the pool the operator created."
        ),
    )
    endpoint_picker: EndpointPicker | None = Field(
        None,
        description=(
            "The pool's endpointPickerRef (a Service). Optional from GIE v1.6; the InferencePool CRDs of "
            "v1.0 to v1.5 require it and refuse a pool without it (condition InferencePoolReady says so)."
        ),
    )


class RuntimeSettings(_Model):
    """Engine settings rendered into the runtime's config file; unset fields use the runtime's defaults."""

    max_model_len: int | None = Field(
        None, ge=16, le=1 << 20, description="Context length; model's own by default."
    )
    block_size: Literal[8, 16, 32, 64, 128, 256] | None = Field(
        None,
        description=(
            "Tokens per KV-cache block. Unset: the runtime picks (256 on GPUs with flash-attn, whose "
            "paged kernel needs it; 16 otherwise)."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8", "int8"] | None = Field(None, description="KV-cache storage dtype.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks across shared prefixes.")
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        le=16,
        description=(
            "GPUs one model copy is sharded over; must equal resources.gpus on GPU pods. "
            "Default: resources.gpus (1 on CPU)."
        ),
    )
    enable_expert_parallel: bool | None = Field(
        None,
        description="Mixture-of-Experts models: whole experts per GPU of a tensor-parallel group "
        "instead of every expert split across them.",
    )
    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="Most sequences in one batch.")
    max_num_batched_tokens: int | None = Field(None, ge=16, le=1 << 20, description="Token budget per step.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="Fraction of GPU memory for weights plus KV cache."
    )
    max_queue_len: int | None = Field(
        None, ge=1, le=1 << 20, description="Waiting requests beyond this get 429."
    )
    shutdown_timeout_seconds: int | None = Field(
        None, ge=0, le=3600, description="Seconds in-flight requests get to finish after SIGTERM."
    )
    max_loras: int | None = Field(
        None, ge=1, le=256, description="LoRA adapters resident on the device at once (runtime default 4)."
    )
    max_lora_rank: int | None = Field(
        None, ge=1, le=512, description="The largest LoRA adapter rank accepted (runtime default 16)."
    )


class OOMAdaptationPolicy(_Model):
    """What the operator does when a replica runs out of memory."""

    adapt: bool = Field(
        False,
        description=(
            "Adapt the setting that matches the cause after an out-of-memory kill, within the bounds "
            "below. GPU out-of-memory (the runtime exits on it): lower gpuMemoryUtilization (0.05 a "
            "step) and halve maxNumSeqs and maxNumBatchedTokens. The container's memory limit "
            "(OOMKilled): on CPU pods halve the KV-cache pool and the batch limits (they live in host "
            "memory); on GPU pods, or once those are at their floors, raise resources.memory by half, "
            "up to maxMemory."
        ),
    )
    min_gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="Floor for gpuMemoryUtilization."
    )
    min_max_num_seqs: int = Field(4, ge=1, le=4096, description="Floor for maxNumSeqs.")
    min_max_num_batched_tokens: int = Field(
        256, ge=16, le=1 << 20, description="Floor for maxNumBatchedTokens."
    )
    min_kv_cache_memory: str = Field(
        "128Mi",
        max_length=32,
        description="Floor for the KV-cache pool of a CPU pod (a Kubernetes quantity).",
        json_schema_extra=_validations(
            _rule(
                f"self.matches('{QUANTITY_PATTERN}')",
                "spec.oomPolicy.minKvCacheMemory must be a Kubernetes quantity such as '128Mi'",
            )
        ),
    )
    max_memory: str | None = Field(
        None,
        max_length=32,
        description=(
            "Ceiling for resources.memory when an OOMKilled pod raises it (a Kubernetes quantity); "
            "default twice resources.memory. Without resources.memory nothing is raised."
        ),
        json_schema_extra=_validations(
            _rule(
                f"self.matches('{QUANTITY_PATTERN}')",
                "spec.oomPolicy.maxMemory must be a Kubernetes quantity such as '64Gi'",
            )
        ),
    )


class Toleration(_Model):
    """A core/v1 Toleration."""

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Model):
    """A core/v1 EnvVar (valueFrom is passed through as written)."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="core/v1 EnvVarSource")


_SPEC_RULES = _validations(
    _rule(
        "oldSelf.hasValue() || !(has(self.replicas) && has(self.autoscaling))",
        "spec.replicas and spec.autoscaling cannot both be set when an InferenceModel is created: "
        "remove spec.replicas (the autoscaler starts at autoscaling.minReplicas and owns replicas)",
        optionalOldSelf=True,
    ),
    _rule(
        "!has(self.autoscaling) || !has(self.replicas)"
        " || (oldSelf.hasValue() && has(oldSelf.value().replicas)"
        " && oldSelf.value().replicas == self.replicas)"
        " || (self.replicas >= self.autoscaling.minReplicas"
        " && self.replicas <= self.autoscaling.maxReplicas)",
        "spec.replicas must lie between spec.autoscaling.minReplicas and spec.autoscaling.maxReplicas: "
        "change replicas or widen the autoscaling bounds",
        optionalOldSelf=True,
    ),
    _rule(
        "!has(self.runtime) || !has(self.runtime.tensorParallelSize) || !has(self.resources)"
        " || !has(self.resources.gpus) || self.resources.gpus == 0"
        " || self.resources.gpus == self.runtime.tensorParallelSize",
        TP_HELP,
    ),
    *pd.cel_rules(),
)

# spec.engine: vllm refuses what vLLM cannot do as written (api/engine.py holds the rules).
_SPEC_RULES["x-kubernetes-validations"].extend(engines.cel_rules())

# metadata.name becomes the kvpilot.dev/model label value (at most 63 characters) and the Service name
# (a DNS-1035 label: no dots). The API server only checks that it is a DNS subdomain, so without these
# rules such a model would be stored and then every reconcile would fail.
MAX_NAME_LENGTH = 63
NAME_LENGTH_HELP = (
    "metadata.name must be at most 63 characters: it becomes the kvpilot.dev/model label value and "
    "the Service name; choose a shorter name"
)
NAME_DOT_HELP = (
    "metadata.name must not contain '.': it becomes the Service name, which must be a DNS-1035 label "
    "(lowercase letters, digits and '-'); use '-' instead"
)
ROOT_RULES = _validations(
    _rule(f"size(self.metadata.name) <= {MAX_NAME_LENGTH}", NAME_LENGTH_HELP),
    _rule("!self.metadata.name.contains('.')", NAME_DOT_HELP),
)


def name_problems(name: str) -> list[str]:
    """The root CEL rules on metadata.name, in Python (for objects stored before a CRD upgrade)."""
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(NAME_LENGTH_HELP)
    if "." in name:
        problems.append(NAME_DOT_HELP)
    return problems


class InferenceModelSpec(_Model):
    """Desired state of an InferenceModel."""

    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    model: ModelSource
    engine: engines.Engine = Field(
        engines.DEFAULT_ENGINE,
        description=(
            "The model server the pods run: kvpilot (`kvpilot serve`) or vllm (`vllm serve`, with "
            "spec.runtime mapped to its flags; what vLLM cannot do is refused, docs/vllm.md)."
        ),
    )
    replicas: int | None = Field(
        None,
        ge=0,
        le=MAX_REPLICAS,
        description="Replica count (default 1). Leave unset with autoscaling: the autoscaler owns it.",
    )
    autoscaling: Autoscaling | None = None
    resources: Resources = Field(
        default_factory=lambda: Resources.model_validate({}), json_schema_extra={"default": {}}
    )
    runtime: RuntimeSettings = Field(
        default_factory=lambda: RuntimeSettings.model_validate({}), json_schema_extra={"default": {}}
    )
    routing: Routing | None = Field(None, description="Request routing through kvpilot router.")
    inference_pool: InferencePoolSettings | None = Field(
        None, description="A Gateway API Inference Extension InferencePool for this model (opt-in)."
    )
    disaggregation: Disaggregation | None = Field(
        None,
        description="Prefill/decode disaggregation: a prefill and a decode Deployment behind the model's "
        "router entry (docs/disaggregation.md).",
    )
    adapters: list[LoRAAdapter] | None = Field(
        None,
        max_length=MAX_ADAPTERS,
        description="PEFT LoRA adapters every replica serves next to the base model (requests pick one "
        "by name in `model`).",
        json_schema_extra=_validations(
            _rule("self.all(a, self.exists_one(b, b.name == a.name))", ADAPTERS_UNIQUE_HELP)
        ),
    )
    oom_policy: OOMAdaptationPolicy = Field(
        default_factory=lambda: OOMAdaptationPolicy.model_validate({}), json_schema_extra={"default": {}}
    )
    image: str | None = Field(
        None,
        max_length=512,
        description="Runtime image; the operator's --image by default (engine vllm: --vllm-image on GPU "
        "pods, --vllm-cpu-image on CPU pods).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    node_selector: dict[str, str] | None = Field(None, description="Extra node labels the pods require.")
    tolerations: list[Toleration] | None = Field(None, max_length=64)
    affinity: dict[str, Any] | None = Field(None, description="core/v1 Affinity, passed through as written.")
    priority_class_name: str | None = Field(None, max_length=253)
    env: list[EnvVar] | None = Field(
        None,
        max_length=128,
        description="Extra environment for the runtime, and for the init containers that fetch hf:// "
        "weights and adapters (HF_ENDPOINT names a Hub mirror; HTTPS_PROXY, NO_PROXY, REQUESTS_CA_BUNDLE).",
    )
    extra_args: list[str] | None = Field(
        None,
        max_length=64,
        description="Extra flags of the model server, appended last: `kvpilot serve` flags (after "
        "--config), or `vllm serve` flags with engine vllm.",
    )

    def effective_gpus(self) -> int:
        return self.resources.gpus

    def effective_tensor_parallel_size(self) -> int:
        """GPUs one model copy is sharded over: spec.runtime's, else all of resources.gpus (1 on CPU)."""
        return self.runtime.tensor_parallel_size or max(1, self.resources.gpus)

    def check(self) -> list[str]:
        """The CEL rules, in Python: messages for every rule this spec breaks (create rules excluded)."""
        problems: list[str] = []
        if not re.match(SOURCE_PATTERN, self.model.source):
            problems.append(SOURCE_HELP)
        if self.model.hf_token_secret is not None and not self.model.source.startswith("hf://"):
            problems.append("spec.model.hfTokenSecret is only used with hf:// sources")
        a = self.autoscaling
        if a is not None:
            if a.min_replicas > a.max_replicas:
                problems.append("spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas")
            if a.metrics_source == "prometheus" and a.prometheus is None:
                problems.append("spec.autoscaling.prometheus is required when metricsSource is prometheus")
        tp = self.runtime.tensor_parallel_size
        if tp and self.resources.gpus and self.resources.gpus != tp:
            problems.append(TP_HELP)
        names = [a.name for a in self.adapters or []]
        for adapter in self.adapters or []:
            if not re.match(ADAPTER_SOURCE_PATTERN, adapter.source):
                problems.append(ADAPTER_SOURCE_HELP)
            if not re.match(ADAPTER_NAME_PATTERN, adapter.name):
                problems.append(ADAPTER_NAME_HELP)
        if len(set(names)) != len(names):
            problems.append(ADAPTERS_UNIQUE_HELP)
        pool = self.inference_pool
        if pool is not None and pool.endpoint_picker is not None:
            if not pool.enabled:
                problems.append(INFERENCE_POOL_ENABLED_HELP)
            if not re.match(DNS1035_PATTERN, pool.endpoint_picker.service):
                problems.append(EPP_SERVICE_HELP)
        problems += pd.problems(self)
        problems.extend(engines.problems(self))
        return problems


# ---------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------

ConditionType = Literal["Ready", "Progressing", "Degraded", "ScalingLimited"]


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str = Field(
        max_length=64,
        description="Ready, Progressing, Degraded, ScalingLimited, AdaptersLoaded or InferencePoolReady.",
    )
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=128, description="CamelCase reason.")
    message: str = Field("", max_length=4096, description="What happened, for a person.")
    last_transition_time: datetime | None = None
    observed_generation: int | None = Field(None, ge=0)


def _none_if_invalid(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


def _valid_items(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if not isinstance(value, list):
        return None
    kept = []
    for item in value:
        try:
            kept.append(handler([item])[0])
        except ValidationError:
            continue
    return kept


# status.autoscaler is the autoscaler's memory, read back on every sync: a value that does not parse
# (an older writer, a hand edit) is dropped, never guessed, and never fails the rest of the status.
T = TypeVar("T")
Lenient = Annotated[T | None, WrapValidator(_none_if_invalid)]
ValidItems = Annotated[list[T] | None, WrapValidator(_valid_items)]


def _whole_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number), Field(strict=True)]  # 3 or 3.0; not True, "3", 3.5
Real = Annotated[float, Field(strict=True)]


def _non_negative(value: T) -> T:
    if value < 0:  # type: ignore[operator]
        raise ValueError("must be >= 0")
    return value


# Checked when read back, not in the schema: the API server must never refuse the autoscaler's
# status patch over a value that reading back would merely skip.
Count = Annotated[Int, AfterValidator(_non_negative)]
Amount = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(_non_negative)]


def _rfc3339(digits: int) -> PlainSerializer:
    """How status.autoscaler's times are written: RFC 3339 UTC with `digits` (0 or 3) fractional digits,
    the format of kube/times.format_time (spelled out here: the API layer imports no other layer)."""

    def write(t: datetime) -> str:
        when = t.astimezone(UTC) if t.tzinfo is not None else t
        if digits == 0:
            return when.strftime("%Y-%m-%dT%H:%M:%SZ")
        return when.strftime("%Y-%m-%dT%H:%M:%S.%f")[: 20 + digits] + "Z"

    return PlainSerializer(write, return_type=str, when_used="json")


Time = Annotated[datetime, _rfc3339(0)]  # as Kubernetes writes Time
MilliTime = Annotated[datetime, _rfc3339(3)]  # the arrival counters' times: rates are differences over them


def _whole_as_int(value: float) -> float | int:
    return int(value) if value.is_integer() else value


class DecisionMetrics(_Model):
    """The metrics a scaling decision was based on."""

    kv_cache_usage: Lenient[Real] = Field(None, alias="kvCacheUsage")
    # a count, written as a whole number (the policy keeps it a float)
    queue_depth: Lenient[Annotated[Real, PlainSerializer(_whole_as_int, when_used="json")]] = None
    ready_replicas: Lenient[Int] = None
    reporting: Lenient[Int] = Field(None, description="Replicas whose metrics were read.")


class ScalingDecision(_Model):
    """The autoscaler's last decision."""

    time: Lenient[Time] = None
    from_replicas: Lenient[Int] = None
    to_replicas: Lenient[Int] = None
    reason: str | None = Field(None, max_length=1024)
    metrics: Lenient[DecisionMetrics] = None


class HistoryEntry(_Model):
    """One past recommendation."""

    time: Time
    replicas: Count
    backlog: Lenient[bool] = None
    """Sized for a backlog (startup-aware queue rule): holds the scale-down window only while it queues."""


class RedundancyFloorStatus(_Model):
    """When the redundancy floor last applied (the load needed it), held for the scale-down window."""

    time: Time
    replicas: Count
    rate: Amount = Field(description="Requests/s arriving then.")
    per_replica: Amount = Field(description="Requests/s one replica served within the SLO then.")


class ScaleEventEntry(_Model):
    """One change of spec.replicas by the autoscaler (its rate limits count them)."""

    time: Time
    from_replicas: Int
    to_replicas: Int


class PodCounters(_Model):
    """One pod's counters at the previous sync, which the next one differences against."""

    pod: Annotated[str, Field(strict=True)]
    completed: Amount | None = Field(
        None, description="Finished requests (a counter); absent: a rate was read."
    )
    in_flight: Count = Field(description="Waiting plus running requests.")
    prompt_tokens: Amount | None = None
    generation_tokens: Amount | None = None
    finished_lengths: Amount | None = Field(
        None, description="Generations the length histograms counted (a counter; aborted ones are not)."
    )
    admitted: Amount | None = Field(
        None, description="Generations admitted (a counter: the admitted-prompt histogram's count)."
    )
    admitted_prompt_tokens: Amount | None = Field(
        None, description="Their prompt tokens (a counter: the admitted-prompt histogram's sum)."
    )
    # The pod's own latency histograms, as cumulative counts at the SLO targets' bucket bounds (the
    # measured-attainment fallback without a router; autoscaler/attainment.py).
    ttft_within: Amount | None = Field(None, description="First tokens within the TTFT target (a counter).")
    ttft_count: Amount | None = Field(None, description="First tokens (a counter).")
    itl_within: Amount | None = Field(
        None, description="Inter-token gaps within the TPOT target (a counter)."
    )
    itl_count: Amount | None = Field(None, description="Inter-token gaps (a counter).")


class RatePoint(_Model):
    """The fleet's arrival rate (requests/s) at a sync."""

    time: MilliTime
    rate: Amount


class TokenMix(_Model):
    """Mean prompt and output tokens per request (smoothed)."""

    prompt: Amount
    output: Amount


class ArrivalsStatus(_Model):
    """The arrival-rate estimate's counters and trend (times with milliseconds)."""

    time: Lenient[MilliTime] = None
    pods: ValidItems[PodCounters] = None
    rates: ValidItems[RatePoint] = None
    service_rate: Lenient[Amount] = Field(None, description="Requests/s one replica sustains at the target.")
    token_mix: Lenient[TokenMix] = None
    levels: ValidItems[RatePoint] = None
    """Mean arrival rate of every minute of the surge headroom's window (autoscaler/surge.py)."""
    shift_at: Lenient[MilliTime] = None
    """When the arrival rate last shifted level (the surge headroom holds capacity after one)."""
    router_queue: Lenient[Count] = None
    """Requests the router held for the model at `time` (their change counts as arrivals)."""


class SloCountsStatus(_Model):
    """Requests judged by api/slo.judge, by outcome."""

    met: Amount = 0.0
    missed_ttft: Amount = 0.0
    missed_tpot: Amount = 0.0
    failed: Amount = 0.0


class SloInterval(_Model):
    """The requests judged between two syncs (ending at `time`) and the load then."""

    time: MilliTime
    seconds: Amount
    counts: SloCountsStatus
    load_per_replica: Amount | None = Field(
        None,
        description="Arrivals/s per Ready replica over the interval (the capacity estimator's evidence).",
    )


class SloStatus(_Model):
    """The SLO as measured, and the numbers the router judges requests with."""

    prefill_seconds_per_token: Lenient[Amount] = Field(
        None,
        description=(
            "The TTFT target's prefill floor, linear term: ttft target = ttftSeconds + ttftPrefillFactor x "
            "(this x prompt tokens + prefillSecondsPerTokenSquared x prompt tokens^2). Fitted to the "
            "calibration's idle prefill time; the router judges with it (api/slo.py)."
        ),
    )
    prefill_seconds_per_token_squared: Lenient[Amount] = Field(
        None, description="The prefill floor's quadratic term (attention over long prompts)."
    )
    attainment: Lenient[Amount] = Field(
        None, description="Share of the requests judged in the window that met the SLO; absent: unknown."
    )
    window_seconds: Lenient[Amount] = None
    requests: Lenient[Amount] = Field(None, description="Requests judged in the window.")
    source: str | None = Field(
        None,
        description="router (kvpilot_router_slo_requests_total) or pods (the pods' histograms: a bound).",
    )
    target: Lenient[Amount] = None
    capacity_factor: Lenient[Amount] = Field(
        None,
        description=(
            "The per-replica capacity the planner uses over the replica model's at the current token "
            "mix (the measured bounds below at work; 1: the model's)."
        ),
    )
    capacity_floor: Lenient[Amount] = Field(
        None,
        description="Requests/s per Ready replica sustained with attainment headroom: the planner's floor.",
    )
    floor_model_capacity: Lenient[Amount] = Field(
        None,
        description=(
            "The replica model's requests/s per replica at the token mix capacityFloor was measured at: "
            "where the mix is heavier now, the floor counts in proportion to the model's capacity."
        ),
    )
    capacity_ceiling: Lenient[Amount] = Field(
        None,
        description="Requests/s per Ready replica below a load that missed the SLO: the planner's ceiling.",
    )
    fresh_since: Lenient[MilliTime] = Field(
        None,
        description="The last feedback step takes effect from here: measurements before it do not count.",
    )
    last_backlog: Lenient[MilliTime] = Field(
        None, description="The last sync with requests waiting beyond the queue target."
    )
    miss_load: Lenient[Amount] = Field(
        None,
        description=(
            "Requests/s per Ready replica at the last capacity cut: the ceiling is not probed past it "
            "while it is remembered (missAt)."
        ),
    )
    miss_ceiling: Lenient[Amount] = Field(
        None,
        description="The ceiling that cut set: a floor a probe step past it ends the memory early.",
    )
    miss_at: Lenient[MilliTime] = Field(None, description="When the last capacity cut was made.")
    router_time: Lenient[MilliTime] = Field(None, description="When the router counters below were read.")
    router_counts: Lenient[SloCountsStatus] = Field(
        None, description="The routers' cumulative counters at the last sync (differenced at the next)."
    )
    intervals: ValidItems[SloInterval] = None


class PdRoleAutoscaling(_Model):
    """One P/D role in the autoscaler's last decision."""

    from_replicas: Lenient[Int] = None
    to_replicas: Lenient[Int] = None
    signal: str | None = Field(None, max_length=64, description="The signal that set the role's size.")
    demand: Lenient[Amount] = Field(
        None, description="Replicas of the role its measured load needs at its target (fractional)."
    )
    fresh_since: Lenient[MilliTime] = Field(
        None, description="The role's last measured-attainment step takes effect from here."
    )


class PdPrefillAutoscaling(PdRoleAutoscaling):
    """The prefill role's estimate (autoscaler/pd_prefill.py): its counters, token-rate trend, learned
    throughput and its own recommendations and scale events."""

    throughput: Lenient[Amount] = Field(
        None, description="Prompt tokens/s one prefill replica sustains, measured at saturation."
    )
    mean_prompt: Lenient[Amount] = Field(None, description="Prompt tokens per request (smoothed).")
    time: Lenient[MilliTime] = None
    pods: ValidItems[PodCounters] = None
    rates: ValidItems[RatePoint] = Field(None, description="Prompt tokens/s arriving, by sync.")
    history: ValidItems[HistoryEntry] = Field(None, max_length=10000)
    scale_events: ValidItems[ScaleEventEntry] = None


class PullCounters(_Model):
    """One decode pod's KV-pull counters at the previous sync (kvpilot_kv_transfer_seconds' sum and
    count, bytes received)."""

    pod: Annotated[str, Field(strict=True)]
    seconds: Amount
    pulls: Amount
    bytes: Amount


class PdDecodeAutoscaling(PdRoleAutoscaling):
    """The decode role's KV-link estimate (autoscaler/pd_decode.py): its pods' pull counters, the
    link bandwidth it measured, the bytes/s received by sync and the link's own recommendations."""

    link_bytes_per_second: Lenient[Amount] = Field(
        None, description="One decode pod's KV link, bytes/s, measured from its pulls."
    )
    time: Lenient[MilliTime] = None
    pods: ValidItems[PullCounters] = None
    rates: ValidItems[RatePoint] = Field(None, description="KV bytes/s the decode pods received, by sync.")
    history: ValidItems[HistoryEntry] = Field(None, max_length=10000)


class PdTtftStatus(_Model):
    """The TTFT breakdown of disaggregated requests (autoscaler/pd_decode.py) and the routers' P/D
    counters it differences."""

    decode_share: Lenient[Amount] = Field(
        None, description="Share of TTFT misses the decode role answers for (KV pull waits), smoothed."
    )
    prefill_wait_seconds: Lenient[Amount] = None
    transfer_wait_seconds: Lenient[Amount] = None
    time: Lenient[MilliTime] = None
    prefill_seconds: Lenient[Amount] = Field(
        None, description="The routers' prefill-leg seconds (a counter)."
    )
    prefill_legs: Lenient[Amount] = None
    no_prefill: Lenient[Amount] = Field(
        None,
        description="Long prompts the routers served on a decode pod for lack of a prefill pod (a counter).",
    )


class PdAutoscalerStatus(_Model):
    """A disaggregated model's P/D decision (autoscaler/pd_policy.py); the aggregated fields of
    status.autoscaler hold the decode role's history, lastDecision both roles' totals."""

    ratio: Lenient[Amount] = Field(
        None, description="P:D ratio (prefill replicas per decode replica) learned from measured saturation."
    )
    ratio_samples: Lenient[Count] = None
    prefill: Lenient[PdPrefillAutoscaling] = None
    decode: Lenient[PdDecodeAutoscaling] = None
    ttft: Lenient[PdTtftStatus] = None


class AutoscalerStatus(_Model):
    """Written by the autoscaler (field manager kvpilot-autoscaler), never by the operator."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    last_decision: Lenient[ScalingDecision] = None
    history: ValidItems[HistoryEntry] = Field(None, max_length=10000)
    scale_events: ValidItems[ScaleEventEntry] = Field(
        None, description="Replica changes inside the longest rate-limit period."
    )
    last_scale_time: Lenient[Time] = None
    redundancy: Lenient[RedundancyFloorStatus] = None
    arrivals: Lenient[ArrivalsStatus] = None
    decided_by: str | None = Field(None, description="Identity of the autoscaler replica that decided.")
    slo: Lenient[SloStatus] = None
    held_kind: str | None = Field(
        None,
        description="Why the last hold is noteworthy: no-metrics, not-reporting, scaling-limited, stabilization.",
    )
    # Both roles of a disaggregated model (spec.disaggregation), decided together.
    disaggregation: Lenient[PdAutoscalerStatus] = None


class OOMOverrides(_Model):
    """The adapted settings currently in force: the runtime's cap spec.runtime, memory floors
    spec.resources.memory."""

    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = Field(None, description="KV-cache pool in bytes (CPU pods).")
    memory: str | None = Field(None, description="resources.memory request and limit (raised).")


class OOMAdaptation(_Model):
    """What the operator changed after out-of-memory kills (spec.oomPolicy.adapt)."""

    count: int = Field(0, ge=0, description="Adaptations so far.")
    last_time: datetime | None = None
    changes: dict[str, str] | None = Field(None, description='The last step, field -> "old -> new".')
    overrides: OOMOverrides | None = None
    runtime_hash: str | None = Field(
        None,
        description=(
            "Hash of spec.runtime and spec.oomPolicy the overrides were made for; a spec change resets them."
        ),
    )


class AdapterStatus(_Model):
    """One spec.adapters entry as the Ready replicas serve it (the operator asks each pod's /v1/models)."""

    name: str = Field(max_length=63)
    loaded_replicas: int = Field(0, ge=0, description="Ready replicas that serve this adapter.")
    missing_on: list[str] | None = Field(
        None, max_length=16, description="Ready pods that do not serve it (yet); the first 16."
    )


class RoleStatus(_Model):
    """One P/D role's pods (spec.disaggregation)."""

    replicas: int = Field(0, ge=0, description="Pods of this role.")
    ready_replicas: int = Field(0, ge=0, description="Ready pods of this role.")
    desired_replicas: int | None = Field(None, ge=0, description="Replicas the spec asks for this role.")
    oom_adaptation: OOMAdaptation | None = Field(
        None,
        alias="oomAdaptation",
        description="What the operator changed after this role's out-of-memory kills (spec.oomPolicy, per role).",
    )


class RolesStatus(_Model):
    """Per-role replicas of a disaggregated model."""

    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class InferenceModelStatus(_Model):
    """Observed state of an InferenceModel."""

    observed_generation: int | None = None
    replicas: int | None = Field(
        None, description="Pods of this model (scale subresource statusReplicasPath)."
    )
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    selector: str | None = Field(None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(None, description="OpenAI-compatible base URL inside the cluster.")
    router_endpoint: str | None = Field(
        None,
        description="OpenAI-compatible base URL through kvpilot router (send model=<servedName>), when one serves the namespace.",
    )
    conditions: list[Condition] | None = Field(
        None,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    kv_cache_usage: str | None = Field(
        None, alias="kvCacheUsage", description='Mean KV-cache usage, e.g. "42%".'
    )
    autoscaler: AutoscalerStatus | None = None
    roles: RolesStatus | None = Field(None, description="Per-role replicas when spec.disaggregation is set.")
    oom_adaptation: OOMAdaptation | None = Field(None, alias="oomAdaptation")
    adapters: list[AdapterStatus] | None = Field(
        None,
        max_length=MAX_ADAPTERS,
        description="Each spec adapter and how many Ready replicas serve it (condition AdaptersLoaded says why not).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class InferenceModel(_Model):
    """kvpilot.dev/v1alpha1 InferenceModel: one model served by N replicas behind a Service."""

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceModelSpec
    status: InferenceModelStatus = Field(default_factory=lambda: InferenceModelStatus.model_validate({}))

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def uid(self) -> str:
        return str(self.metadata.get("uid", ""))

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation") or 0)
