"""spec.engine: which model server a model's pods run, kvpilot's runtime or vLLM (`vllm serve`).

With `engine: vllm` the operator renders `vllm serve` pods (operator/vllm_pod.py) with every
spec.runtime field mapped to vLLM's flag. What vLLM cannot do as written is refused here, once for
the API server (CEL rules on spec, each message naming the field and the fix) and once in Python
(`problems`, which InferenceModelSpec.check() adds), from the same table, so the two never disagree.
No field is dropped silently: a field is either mapped (docs/vllm.md has the table) or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from kvpilot.api.models import InferenceModelSpec

Engine = Literal["kvpilot", "vllm"]
ENGINES: tuple[str, ...] = get_args(Engine)
DEFAULT_ENGINE: Engine = "kvpilot"
# vLLM's --max-lora-rank takes only these values (vllm serve --help).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class EngineRule:
    """One thing vLLM pods cannot do: the CEL rule on spec, its message, and its Python mirror."""

    cel: str
    message: str
    broken: Callable[[InferenceModelSpec], bool]


def _vllm(spec: InferenceModelSpec) -> bool:
    return spec.engine == "vllm"


_RANKS = ", ".join(str(r) for r in VLLM_LORA_RANKS)

VLLM_RULES = (
    EngineRule(
        "self.engine != 'vllm' || !self.model.source.startsWith('builtin://')",
        "spec.model.source builtin://NAME is a model packaged with kvpilot's runtime, which vLLM cannot "
        "load: with spec.engine vllm use hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH",
        lambda s: _vllm(s) and s.model.source.startswith("builtin://"),
    ),
    EngineRule(
        "self.engine != 'vllm' || !self.model.source.matches('^hf://.*:')",
        "spec.model.source hf://ORG/NAME:QUANT picks one .gguf file of a repository for kvpilot's runtime, "
        "which vLLM pods do not fetch: with spec.engine vllm use hf://ORG/NAME (a safetensors repository), "
        "or the .gguf file as pvc://CLAIM/PATH or file:///PATH with --tokenizer in extraArgs",
        lambda s: _vllm(s) and s.model.source.startswith("hf://") and ":" in s.model.source[len("hf://") :],
    ),
    EngineRule(
        "self.engine != 'vllm' || !has(self.runtime.kvCacheDtype) || self.runtime.kvCacheDtype != 'int8'",
        "spec.runtime.kvCacheDtype int8 is kvpilot's KV-cache format, which vLLM does not have: with "
        "spec.engine vllm set kvCacheDtype to auto or fp8",
        lambda s: _vllm(s) and s.runtime.kv_cache_dtype == "int8",
    ),
    EngineRule(
        f"self.engine != 'vllm' || !has(self.runtime.maxLoraRank) || self.runtime.maxLoraRank in [{_RANKS}]",
        f"spec.runtime.maxLoraRank must be one of {_RANKS} with spec.engine vllm (the values vLLM's "
        "--max-lora-rank takes): round it up to the next one",
        lambda s: _vllm(s) and s.runtime.max_lora_rank not in (None, *VLLM_LORA_RANKS),
    ),
    EngineRule(
        "self.engine != 'vllm' || !has(self.runtime.maxQueueLen) || has(self.runtime.maxNumSeqs)",
        "spec.runtime.maxQueueLen with spec.engine vllm needs spec.runtime.maxNumSeqs: vLLM caps waiting "
        "plus running requests (--max-num-queued-reqs is set to maxQueueLen + maxNumSeqs), so set "
        "maxNumSeqs too, or remove maxQueueLen",
        lambda s: _vllm(s) and s.runtime.max_queue_len is not None and s.runtime.max_num_seqs is None,
    ),
    EngineRule(
        "self.engine != 'vllm' || !has(self.disaggregation)",
        "spec.disaggregation runs kvpilot's prefill/decode roles and KV transfer, which vLLM pods do not "
        "speak: with spec.engine vllm remove spec.disaggregation (or use engine kvpilot)",
        lambda s: _vllm(s) and s.disaggregation is not None,
    ),
)


def cel_rules() -> list[dict[str, Any]]:
    """The rules as x-kubernetes-validations entries (on spec)."""
    return [{"rule": r.cel, "message": r.message} for r in VLLM_RULES]


def problems(spec: InferenceModelSpec) -> list[str]:
    """The rules in Python: the message of every rule `spec` breaks."""
    return [r.message for r in VLLM_RULES if r.broken(spec)]
