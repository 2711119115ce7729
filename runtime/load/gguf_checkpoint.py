"""A GGUF file as the loader needs it: llama.cpp's tensor and metadata names mapped to the Hugging Face
names our models use, the architecture (ModelArchConfig) read from the metadata, and the weights,
dequantized or as quantized blocks (runtime/load/gguf_blocks.py)."""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from kvpilot.kernels import qlinear
from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.load import gguf_blocks
from kvpilot.runtime.load.gguf_reader import GGUFFile
from kvpilot.runtime.models import ARCHITECTURES, ModelArchConfig, architectures
from kvpilot.runtime.models.llama import ROPE_FREQS_NAME

log = logging.getLogger(__name__)

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


# llama.cpp tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts (the stacked ffn_*_exps tensors are split per expert by iter_gguf_weights)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# llama.cpp's stacked expert tensors [E, out, in] -> the HF piece of each expert
_GGUF_EXPERT_PIECES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_SUPPORTED_ARCHS = architectures("gguf")
# llama.cpp's default for renormalizing the top-k weights when `<arch>.expert_weights_norm` is absent
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def gguf_arch_config(f: GGUFFile) -> ModelArchConfig:
    """ModelArchConfig from `<arch>.*` metadata (`llama.embedding_length`, ...)."""
    arch = f.get("general.architecture")
    if arch not in _GGUF_SUPPORTED_ARCHS:
        raise ValueError(
            f"{f.path}: GGUF architecture {arch!r} is not supported (supported: {_GGUF_SUPPORTED_ARCHS})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = f.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{f.path}: GGUF metadata {arch}.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    moe = _gguf_moe_settings(f, arch)
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = f.tensors["token_embd.weight"].shape[0]
    return ModelArchConfig(
        architecture="llama-moe" if arch == "llama" and moe else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(
            f.get(f"{arch}.attention.key_length") or f.get(f"{arch}.rope.dimension_count") or hidden // heads
        ),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(f, arch),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors,
        qk_norm={"qwen3": "head", "qwen3moe": "head", "olmoe": "full"}.get(arch),
        **moe,
        extra={"gguf_name": f.get("general.name"), "file_type": f.get("general.file_type")},
    )


def _gguf_moe_settings(f: GGUFFile, arch: str) -> dict[str, Any]:
    """The ModelArchConfig MoE fields from `<arch>.expert_*` metadata ({} for a dense model)."""
    experts = int(f.get(f"{arch}.expert_count") or 0)
    if experts == 0:
        if ARCHITECTURES[arch].moe:
            raise ValueError(f"{f.path}: GGUF metadata {arch}.expert_count is missing")
        return {}
    if arch not in _GGUF_NORM_TOPK:  # a dense-only architecture (llama's experts load as llama-moe)
        raise ValueError(
            f"{f.path}: GGUF metadata {arch}.expert_count is {experts}, but {arch} is a dense architecture"
        )
    layers = int(f.get(f"{arch}.block_count"))
    ff = f.get(f"{arch}.expert_feed_forward_length") or f.get(f"{arch}.feed_forward_length")
    settings: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(f.get(f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(ff),
        "norm_topk_prob": bool(f.get(f"{arch}.expert_weights_norm", _GGUF_NORM_TOPK[arch])),
        "shared_expert_intermediate_size": int(f.get(f"{arch}.expert_shared_feed_forward_length") or 0),
        # layers without a router have a dense MLP (Qwen MoE's mlp_only_layers / decoder_sparse_step)
        "dense_mlp_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors
        ),
    }
    clip = f.get(f"{arch}.attention.clamp_kqv")
    if clip is not None:
        settings["clip_qkv"] = float(clip)
    return settings


def _gguf_rope_scaling(f: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = f.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f.get(f"{arch}.rope.scaling.factor", 1.0))}
    raise ValueError(f"{f.path}: rope scaling type {kind!r} is not supported (supported: none, linear)")


def gguf_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name (None for tensors the model does not use)."""
    if name == "rope_freqs.weight":
        return ROPE_FREQS_NAME
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        layer, piece, kind = m.groups()
        hf = _GGUF_LAYER_NAMES.get(piece)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        hf = _GGUF_GLOBAL_NAMES.get(m.group(1))
        return f"{hf}.{m.group(2)}" if hf else None
    return None


def gguf_expert_piece(name: str) -> tuple[int, str] | None:
    """`blk.N.ffn_{gate,up,down}_exps.weight` -> (N, HF piece); None for any other tensor."""
    if m := re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight", name):
        return int(m.group(1)), _GGUF_EXPERT_PIECES[m.group(2)]
    return None


def unpermute_rotary(w: ArrayT, n_heads: int) -> ArrayT:
    """Undo llama.cpp's q/k row permutation, back to the HF rotate-half layout.

    HF keeps each head's rotary pairs as (first half, second half) of the head; the HF->GGUF
    converter interleaves them (row h*D + 2j + s holds HF row h*D + s*D/2 + j), the layout of
    llama.cpp's rope kernel. Reshaping the rows to (heads, D/2, 2) and swapping the last two axes
    puts them back. Works for weights [rows, in] and biases [rows], numpy arrays and torch tensors
    (the parts of a QuantizedWeight: packed, scales and mins share the rows).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_blocks_weight(f: GGUFFile, name: str, bits: int) -> QuantizedWeight:
    """A quantized matrix as a `bits` QuantizedWeight from its blocks (gguf_blocks.to_qweight_as:
    as stored, or requantized to int8). Blocks whose float16 scales or mins cannot be formed
    (runtime/load/gguf_blocks.py) are dequantized and quantized again to the same format, with a
    warning: the layer still gets the format it was prepared for."""
    info = f.tensors[name]
    try:
        return gguf_blocks.to_qweight_as(f.raw(name), info.ggml_type, info.shape[-1], bits)
    except ValueError as err:
        log.warning("%s: %s; requantizing it from its dequantized values", name, err)
        w = torch.from_numpy(f.load(name))
        return qlinear.quantize_int8(w, gguf_blocks.GROUP) if bits == 8 else qlinear.quantize_int4(w)


def iter_gguf_weights(
    f: GGUFFile, arch: ModelArchConfig, blocks: Mapping[str, int] | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor) for every tensor the model uses, with tqdm progress on stderr;
    the tensors named in `blocks` come as QuantizedWeights of the bits given there instead.

    Stacked expert tensors [E, out, in] are dequantized whole and handed out one expert at a time
    under the HF per-expert names. Only the `llama` converter permutes q/k rows for llama.cpp's
    rotary layout; qwen2, qwen3, qwen2moe, qwen3moe and olmoe keep HF's rotate-half rows (llama.cpp's
    NEOX rope).
    """
    names = [n for n in f.tensors if gguf_hf_name(n) is not None or gguf_expert_piece(n) is not None]
    permuted = f.get("general.architecture") == "llama"
    for name in tqdm(names, desc=f"loading {f.path.name}", unit="tensor", file=sys.stderr, leave=False):
        if blocks and name in blocks:
            qw = gguf_blocks_weight(f, name, blocks[name])
            heads = arch.num_attention_heads if ".attn_q." in name else arch.num_key_value_heads
            if permuted and (".attn_q." in name or ".attn_k." in name):
                qw = gguf_blocks.map_rows(qw, functools.partial(unpermute_rotary, n_heads=heads))
            hf = gguf_hf_name(name)
            assert hf is not None
            yield hf, qw
            continue
        w = f.load(name)
        if (expert := gguf_expert_piece(name)) is not None:
            layer, piece = expert
            for e in range(w.shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{e}.{piece}.weight", torch.from_numpy(w[e])
            continue
        hf_name = gguf_hf_name(name)
        assert hf_name is not None
        if permuted and ".attn_q." in name:
            w = unpermute_rotary(w, arch.num_attention_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rotary(w, arch.num_key_value_heads)
        elif name.endswith(".ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores the shared-expert gate as a vector
        yield hf_name, torch.from_numpy(np.ascontiguousarray(w))
