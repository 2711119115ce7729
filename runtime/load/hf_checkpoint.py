"""A Hugging Face-style model directory as the loader needs it: config.json -> ModelArchConfig for the
supported architectures, and the safetensors weights (sharded or not)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvpilot.runtime.models import ModelArchConfig, architectures

log = logging.getLogger(__name__)

HF_DIR_FILES = "config.json, *.safetensors, tokenizer.json and tokenizer_config.json"


_HF_ARCHS = architectures("hf")
_HF_MOE_ARCHS = architectures("hf", moe=True)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found (a model directory holds {HF_DIR_FILES})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def hf_arch_config(directory: Path) -> ModelArchConfig:
    """ModelArchConfig from a transformers config.json (Llama, Mistral, Qwen2, Qwen3; SmolLM is Llama;
    the MoE families Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    cfg = read_json(directory / "config.json")
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _HF_ARCHS:
        raise ValueError(
            f"{directory / 'config.json'}: architecture {arch!r} is not supported (supported: {_HF_ARCHS})"
        )
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5 keeps rope settings here
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    qwen_window = arch in (
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    )
    qkv_bias = bool(cfg.get("qkv_bias", True)) if qwen2 else bool(cfg.get("attention_bias", False))
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=not qwen2 and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=_hf_sliding_window(cfg, qwen_window),
        # RMSNorm on q and k: per head (Qwen3, dense and MoE) or over the whole projection (OLMoE)
        qk_norm={"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(
            arch
        ),
        **(_hf_moe_settings(arch, cfg) if arch in _HF_MOE_ARCHS else {}),
        extra={
            "model_type": cfg.get("model_type"),
            "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
        },
    )


def _hf_moe_settings(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchConfig MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE config.json."""
    layers = int(cfg["num_hidden_layers"])
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    settings: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "norm_topk_prob": True if arch == "MixtralForCausalLM" else bool(cfg.get("norm_topk_prob", False)),
    }
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        settings["dense_mlp_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    if arch == "Qwen2MoeForCausalLM":
        settings["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
    if arch == "OlmoeForCausalLM":
        clip = cfg.get("clip_qkv")
        settings["clip_qkv"] = float(clip) if clip is not None else None
    return settings


def _hf_sliding_window(cfg: dict[str, Any], qwen2: bool) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or (qwen2 and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint shards: those the index names, else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [directory / s for s in shards]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: shards missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory}: no *.safetensors files (a model directory holds {HF_DIR_FILES})"
        )
    return files


def iter_safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(directory)
    with tqdm(desc=f"loading {directory.name}", unit="tensor", file=sys.stderr, leave=False) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    bar.update(1)
                    yield name, f.get_tensor(name)
