"""MoE GGUFs: llama.cpp's stacked `ffn_{gate,up,down}_exps` tensors, the router `ffn_gate_inp`,
Qwen2-MoE's shared-expert tensors (`*_shexp`, the gate stored as a vector) and q/k norms.

Each tiny random-weight family (tests/runtime/test_moe.py) is written as a GGUF the way llama.cpp's
converter lays it out (Mixtral as `llama` with q/k rows permuted for llama.cpp's rotary; Qwen MoE and
OLMoE as their own architectures, unpermuted) with the `gguf` package, loaded, and compared with the
same model loaded from its safetensors: every parameter equal (F32), the same logits; with Q8_0
experts, the experts are the dequantized Q8_0 values and the logits stay close.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.load.gguf_checkpoint import gguf_arch_config, iter_gguf_weights
from kvpilot.runtime.load.gguf_reader import GGUFFile
from kvpilot.runtime.load.loader import build_model, load_model
from kvpilot.runtime.models import CausalLM, ModelArchConfig
from tests.runtime.test_model_parity import PagedKV, rel_diff
from tests.runtime.test_moe import FAMILIES, make_tiny_moe_dir

GGUF_ARCH = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "olmoe": "olmoe"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: HF rotate-half rows -> interleaved pairs (inverse of unpermute_rotary)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """The saved checkpoint's tensors (per-expert names; transformers' in-memory layout is fused)."""
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(directory / "model.safetensors")).items()}


def write_moe_gguf(family: str, hf: Any, directory: Path, path: Path, expert_type: str = "F32") -> None:
    """`directory`: the tiny model's safetensors checkpoint; `hf`: its transformers model (config)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf.config
    arch = GGUF_ARCH[family]
    state = checkpoint(directory)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((int(m.group(1)), _EXPERT[m.group(3)]), {})[int(m.group(2))] = w
            continue
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            tensors["output.weight"] = w
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            assert m, name
            layer, piece, kind = m.groups()
            if arch == "llama" and piece == "self_attn.q_proj":
                w = permute_rotary(w, cfg.num_attention_heads)
            elif arch == "llama" and piece == "self_attn.k_proj":
                w = permute_rotary(w, cfg.num_key_value_heads)
            elif piece == "mlp.shared_expert_gate":
                w = w.reshape(-1)
            tensors[f"blk.{layer}.{_LAYER[piece]}.{kind}"] = w
    for (layer, piece), per_expert in experts.items():
        tensors[f"blk.{layer}.ffn_{piece}_exps.weight"] = np.stack(
            [per_expert[e] for e in sorted(per_expert)]
        )

    writer = gguf.GGUFWriter(str(path), arch)
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    writer.add_uint32(f"{arch}.expert_count", num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    if family in ("qwen2moe", "qwen3moe"):  # Mixtral and OLMoE experts are feed_forward_length wide
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if family == "qwen2moe":
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    if family == "olmoe":
        writer.add_float32(f"{arch}.attention.clamp_kqv", float(cfg.clip_qkv))
    for name, w in tensors.items():
        if expert_type == "Q8_0" and "_exps." in name:
            writer.add_tensor(
                name, quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_gguf_model(path: Path) -> tuple[CausalLM, ModelArchConfig]:
    with GGUFFile(path) as f:
        arch = gguf_arch_config(f)
        model = build_model(arch, torch.device("cpu"), torch.float32)
        model.load_weights(iter_gguf_weights(f, arch))
    return model.eval(), arch


def _logits(model: CausalLM, arch: ModelArchConfig) -> torch.Tensor:
    ids = torch.randint(3, 96, (25,), generator=torch.Generator().manual_seed(5)).tolist()
    kv = PagedKV(arch, num_blocks=16, block_size=8)
    return torch.cat([kv.logits(model, [(0, ids[:17])]), *(kv.logits(model, [(0, [t])]) for t in ids[17:])])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_equals_safetensors(family: str, tmp_path: Path) -> None:
    hf = make_tiny_moe_dir(family, tmp_path / "hf")
    write_moe_gguf(family, hf, tmp_path / "hf", tmp_path / "m.gguf")
    ref = load_model(EngineConfig(model=str(tmp_path / "hf")), torch.device("cpu"), torch.float32)
    model, arch = load_gguf_model(tmp_path / "m.gguf")
    assert arch.architecture == ("llama-moe" if family == "mixtral" else GGUF_ARCH[family])
    for field in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
        "dense_mlp_layers",
        "qk_norm",
        "clip_qkv",
        "qkv_bias",
    ):
        assert getattr(arch, field) == getattr(ref.arch, field), field
    ours, theirs = dict(model.named_parameters()), dict(ref.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    _, rel = rel_diff(_logits(model, arch), _logits(ref.model, ref.arch))
    assert rel <= 1e-6


def test_q8_0_experts_are_dequantized_at_load(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    hf = make_tiny_moe_dir("qwen2moe", tmp_path / "hf")
    write_moe_gguf("qwen2moe", hf, tmp_path / "hf", tmp_path / "q.gguf", expert_type="Q8_0")
    with GGUFFile(tmp_path / "q.gguf") as f:
        assert f.tensors["blk.0.ffn_up_exps.weight"].type_name == "Q8_0"
    model, arch = load_gguf_model(tmp_path / "q.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    state = checkpoint(tmp_path / "hf")
    ups = np.stack([state[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(6)])
    expected = torch.from_numpy(dequantize(quantize(ups, q8), q8).reshape(ups.shape))
    w13 = model.model.layers[0].mlp.experts.w13
    assert torch.equal(w13[:, 32:], expected)
    assert not torch.equal(w13[:, 32:], torch.from_numpy(ups))  # really quantized
    ref = load_model(EngineConfig(model=str(tmp_path / "hf")), torch.device("cpu"), torch.float32)
    _, rel = rel_diff(_logits(model, arch), _logits(ref.model, ref.arch))
    print(f"\nQ8_0 experts: logits within {rel:.2g} of scale of the float32 safetensors")
    assert rel <= 5e-2
