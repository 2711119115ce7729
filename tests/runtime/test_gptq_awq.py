"""GPTQ and AWQ checkpoints (runtime/load/quant_formats.py, runtime/load/quantized_checkpoint.py).

Tiny random-weight Llama checkpoints are quantized and packed here in the formats' own layouts,
by runtime/load/quant_pack.py (its docstring describes the layouts and where they were read).

Published layout: a Llama-2-7B q_proj (4096 x 4096) in a 4-bit group-128 GPTQ checkpoint (the
settings TheBloke/Llama-2-7B-GPTQ's model card lists for its main branch: bits 4, GS 128) holds
`qweight` I32 [512, 4096], `qzeros` I32 [32, 512], `scales` F16 [32, 4096], `g_idx` I32 [4096]
(the shapes a public checkpoint-scanner's test fixture lists for `model.layers.0.self_attn.q_proj`);
in AWQ GEMM 4-bit group 128, `qweight` I32 [4096, 512], `qzeros` I32 [32, 512], `scales`
F16 [32, 4096]. `test_the_packers_give_the_published_layouts` packs such layers here and checks them.

Checked: the converted QuantizedWeight dequantizes to the packer's weights (exactly with symmetric
zero points, within float16 rounding of the min otherwise), the engine's logits and greedy tokens
equal a float32 model holding the dequantized weights, tensor-parallel shards equal the dense
loader's, and the settings the runtime cannot take are refused naming them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load import loader, quant_formats
from kvpilot.runtime.load.loader import LoadedModel, load_model
from kvpilot.runtime.load.quant_formats import AWQ_ORDER, CheckpointQuantization, UnsupportedQuantization
from kvpilot.runtime.load.quant_pack import (
    PROJECTIONS,
    dequantize,
    pack_columns,
    pack_rows,
    quantize_layer,
    to_int32,
)
from kvpilot.runtime.load.quantized_checkpoint import linear_modules
from kvpilot.runtime.models import layers as L
from tests.runtime.test_model_parity import TINY_VOCAB, PagedKV, _write_tiny_tokenizer, rel_diff

# Logit differences, as a fraction of the largest reference logit, float32: symmetric checkpoints give
# the same weights (only the matmul order differs: C kernel vs torch); asymmetric ones differ by the
# float16 rounding of each group's min = -zero * scale (2^-11 relative; measured 5e-4).
REL_TOL = {True: 1e-4, False: 2e-3}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# The packer (runtime/load/quant_pack.py) with act-order


def pack_layer(
    w: torch.Tensor, cq: CheckpointQuantization, act_order: bool, seed: int
) -> tuple[dict, torch.Tensor]:
    """One linear layer's checkpoint tensors in cq's format, and the packer's dequantized [N, K] weight."""
    # desc_act: groups follow an input order of decreasing Hessian diagonal (random here)
    order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed)) if act_order else None
    return quantize_layer(w, cq, order)


# ---------------------------------------------------------------------------------------------
# Tiny checkpoints


def tiny_llama(hidden: int = 128, intermediate: int = 256, qwen2: bool = False) -> Any:
    """A 2-layer Llama (or Qwen2: q/k/v biases, which GPTQ/AWQ keep as 16-bit `bias` tensors)."""
    import transformers as tf

    torch.manual_seed(99)
    cls, config_cls = (
        (tf.Qwen2ForCausalLM, tf.Qwen2Config) if qwen2 else (tf.LlamaForCausalLM, tf.LlamaConfig)
    )
    cfg = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
        # all-positive rows: their asymmetric zero points are 0, which v1 stores as -1 (a borrow)
        model.model.layers[0].self_attn.q_proj.weight[:4].abs_()
    return model


def quantization_config(cq: CheckpointQuantization) -> dict[str, Any]:
    if cq.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": cq.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    return {
        "quant_method": "gptq",
        "bits": cq.bits,
        "group_size": cq.group_size,
        "sym": cq.sym,
        "desc_act": cq.desc_act,
        "checkpoint_format": cq.checkpoint_format,
    }


def write_quantized(
    hf: Any, directory: Path, cq: CheckpointQuantization, qc: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """Save `hf` quantized by cq; returns the packer's dequantized weight of every checkpoint linear."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            # act-order follows the layer input's Hessian: q/k/v (and gate/up) share one order
            seed = hash((module.split(".")[2], w.shape[1], "o_proj" in module)) % 2**31
            packed, deq = pack_layer(w, cq, cq.desc_act, seed=seed)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            dequantized[module] = deq
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    config = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    config["quantization_config"] = qc if qc is not None else quantization_config(cq)
    (directory / "config.json").write_text(json.dumps(config))
    _write_tiny_tokenizer(directory)
    return dequantized


def write_dequantized(hf: Any, directory: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """The same model with the packer's dequantized weights, as a plain float32 checkpoint."""
    with torch.no_grad():
        for module, w in dequantized.items():
            hf.get_submodule(module).weight.copy_(w)
    hf.save_pretrained(directory)
    _write_tiny_tokenizer(directory)


def cpu_load(directory: Path, **settings: Any) -> LoadedModel:
    return load_model(EngineConfig(model=str(directory), **settings), torch.device("cpu"), torch.float32)


CASES = {
    "gptq4-g32-sym-v1": CheckpointQuantization("gptq", 4, 32, True, False, "gptq"),
    "gptq4-g128-asym-v2-act-order": CheckpointQuantization("gptq", 4, 128, False, True, "gptq_v2"),
    "gptq4-per-channel-asym-v1": CheckpointQuantization("gptq", 4, -1, False, False, "gptq"),
    "gptq8-g64-sym-v1-act-order": CheckpointQuantization("gptq", 8, 64, True, True, "gptq"),
    "awq4-g64": CheckpointQuantization("awq", 4, 64, False, False, "gemm"),
    "qwen2-gptq4-g64-asym-v2": CheckpointQuantization("gptq", 4, 64, False, False, "gptq_v2"),
    "qwen2-awq4-g32": CheckpointQuantization("awq", 4, 32, False, False, "gemm"),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cq = CASES[request.param]
    base = tmp_path_factory.mktemp(request.param)
    hf = tiny_llama(qwen2=request.param.startswith("qwen2"))
    dequantized = write_quantized(hf, base / "quantized", cq)
    write_dequantized(hf, base / "dense", dequantized)
    return {"cq": cq, "dir": base / "quantized", "dense": base / "dense", "dequantized": dequantized}


def _fused_dequantized(dequantized: dict[str, torch.Tensor], target: str) -> torch.Tensor:
    """The packer's weight of one of our (fused) layers: q/k/v and gate/up stacked along the rows."""
    pieces = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    prefix, _, last = target.rpartition(".")
    return torch.cat([dequantized[f"{prefix}.{p}"] for p in pieces.get(last, (last,))])


def test_converted_weights_are_the_packers_weights(pair: dict[str, Any]) -> None:
    cq: CheckpointQuantization = pair["cq"]
    loaded = cpu_load(pair["dir"])
    modules = linear_modules(loaded.model)
    assert len(modules) == 2 * 4 and all(m.weight is None for m in modules.values())  # no 16-bit copy
    for name, mod in modules.items():
        qw = mod.qweight
        assert qw is not None and qw.bits == (8 if cq.bits == 8 else 4)
        assert qw.group == {32: 32, 64: 64, 128: 128, -1: 128}[cq.group_size]  # per channel: 128 repeated
        ours = qw.dequantize(torch.float32)
        # act-order permutes the weight's input features, unless one group spans them all
        assert (mod.input_perm is not None) == (cq.desc_act and qw.in_features > cq.group_size > 0), name
        if mod.input_perm is not None:
            unpermuted = torch.empty_like(ours)
            unpermuted[:, mod.input_perm] = ours
            ours = unpermuted
        ref = _fused_dequantized(pair["dequantized"], name)
        if cq.sym:  # zero 2^(bits-1): min = -zero * scale is exact in float16
            assert torch.equal(ours, ref), name
        else:  # min rounded to float16: within half an ulp of |zero * scale| (2^-11 relative)
            bound = ref.abs().max() * 2**-10
            assert float((ours - ref).abs().max()) <= bound, name


def _prefill_decode(loaded: LoadedModel, ids: list[int], steps: int = 6) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits (many rows: dequantize + torch) then greedy decode steps (1 row: the C kernel)."""
    kv = PagedKV(loaded.arch, num_blocks=16, block_size=8)
    rows = [kv.logits(loaded.model, [(0, ids)])]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(kv.logits(loaded.model, [(0, [tokens[-1]])]))
    return torch.cat(rows), tokens


@pytest.mark.usefixtures("exact_qmatmul")  # the loader's conversion, not the kernel's int8 activations
def test_logits_and_greedy_tokens_match_the_dequantized_model(pair: dict[str, Any]) -> None:
    quantized, dense = cpu_load(pair["dir"]), cpu_load(pair["dense"])
    ids = torch.randint(3, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ours, our_tokens = _prefill_decode(quantized, ids)
        ref, ref_tokens = _prefill_decode(dense, ids)
    _, rel = rel_diff(ours, ref)
    assert rel <= REL_TOL[pair["cq"].sym], rel
    assert our_tokens == ref_tokens

    settings = {"dtype": "float32", "kv_cache_memory": 32 * 2**20}
    prompts = [ids[:9], ids[4:], ids[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [
        s.output_token_ids
        for s in engine_from_loaded(quantized, EngineConfig(**settings)).generate(prompts, params)
    ]
    want = [
        s.output_token_ids
        for s in engine_from_loaded(dense, EngineConfig(**settings)).generate(prompts, params)
    ]
    assert all(len(tokens) == 12 for tokens in got)
    if pair["cq"].sym:  # the very weights: the same tokens
        assert got == want
    else:  # mins rounded to float16 (2^-11 relative; bounded above) can flip a near-tie later in 12
        # greedy steps, depending on the summation order of the run (threads): the first token holds
        assert [tokens[0] for tokens in got] == [tokens[0] for tokens in want]


def test_auto_takes_the_checkpoints_own_and_int8_is_refused(pair: dict[str, Any]) -> None:
    cq: CheckpointQuantization = pair["cq"]
    assert loader.check_checkpoint_quantization("auto", pair["dir"]) == CheckpointQuantization(
        cq.method,
        cq.bits,
        cq.group_size,
        cq.sym,
        cq.desc_act,
        cq.checkpoint_format,
        "config.json quantization_config",
    )
    assert loader.quantization_method("auto", pair["dir"]) is None  # nothing left to apply after loading
    assert cpu_load(pair["dir"], quantization="auto").model.model.layers[0].mlp.down_proj.qweight is not None
    for flag in ("int8", "int4"):
        with pytest.raises(UnsupportedQuantization, match=rf"--quantization {flag}: .* {cq.method.upper()}"):
            cpu_load(pair["dir"], quantization=flag)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel shards


def _load_as_rank(monkeypatch: pytest.MonkeyPatch, directory: Path, rank: int, world: int) -> Any:
    monkeypatch.setattr(L, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(L, "get_tp_world_size", lambda: world)
    model, _, _ = loader.load_hf_dir(directory, torch.device("cpu"), torch.float32)
    return model


def test_tensor_parallel_shards_equal_the_dense_loaders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cq = CheckpointQuantization("gptq", 4, 32, True, False, "gptq")
    hf = tiny_llama()
    write_dequantized(hf, tmp_path / "dense", write_quantized(hf, tmp_path / "q", cq))
    for rank in range(2):
        quantized = linear_modules(_load_as_rank(monkeypatch, tmp_path / "q", rank, 2))
        dense = linear_modules(_load_as_rank(monkeypatch, tmp_path / "dense", rank, 2))
        for name, mod in quantized.items():
            assert mod.qweight is not None and mod.tp_size == 2
            w = dense[name].weight
            assert w is not None and torch.equal(mod.qweight.dequantize(), w.data), (rank, name)


def test_tensor_parallel_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hf = tiny_llama()
    write_quantized(hf, tmp_path / "g128", CheckpointQuantization("gptq", 4, 128, True, False, "gptq"))
    with pytest.raises(
        UnsupportedQuantization, match=r"--tensor-parallel-size 2: layer .*o_proj.*\(64\).*\(128\)"
    ):
        _load_as_rank(monkeypatch, tmp_path / "g128", 0, 2)
    write_quantized(hf, tmp_path / "act", CheckpointQuantization("gptq", 4, 32, True, True, "gptq"))
    with pytest.raises(
        UnsupportedQuantization, match=r"desc_act with --tensor-parallel-size 2: layer .*(o|down)_proj"
    ):
        _load_as_rank(monkeypatch, tmp_path / "act", 0, 2)


# ---------------------------------------------------------------------------------------------
# Settings the runtime refuses


def test_the_packers_give_the_published_layouts() -> None:
    w = torch.randn(4096, 4096) * 0.02
    gptq, _ = pack_layer(w, CheckpointQuantization("gptq", 4, 128, True, False, "gptq"), False, 0)
    assert {k: (tuple(v.shape), v.dtype) for k, v in gptq.items()} == {
        "qweight": ((512, 4096), torch.int32),
        "qzeros": ((32, 512), torch.int32),
        "scales": ((32, 4096), torch.float16),
        "g_idx": ((4096,), torch.int32),
    }
    awq, _ = pack_layer(w, CheckpointQuantization("awq", 4, 128, False, False, "gemm"), False, 0)
    assert {k: (tuple(v.shape), v.dtype) for k, v in awq.items()} == {
        "qweight": ((4096, 512), torch.int32),
        "qzeros": ((32, 512), torch.int32),
        "scales": ((32, 4096), torch.float16),
    }


def test_v1_zero_points_of_zero_round_trip() -> None:
    """A zero of 0 is stored as -1 in v1 (a borrow from the next field); reading adds it back."""
    zeros = torch.tensor([[0, 15, 8, 0, 1, 0, 7, 3]])
    v1 = to_int32(pack_columns(zeros, 4).long() - 0x11111111)
    back = quant_formats.unpack_int32(quant_formats.gptq_v1_to_v2_zeros(v1, 4), 4, dim=1)
    assert back.tolist() == zeros.tolist()


def test_unpacking_is_the_inverse_of_packing() -> None:
    g = torch.Generator().manual_seed(3)
    for bits in (4, 8):
        v = torch.randint(0, 2**bits, (64, 40), generator=g)
        assert torch.equal(quant_formats.unpack_int32(pack_rows(v, bits), bits, dim=0).long(), v)
        assert torch.equal(quant_formats.unpack_int32(pack_columns(v, bits), bits, dim=1).long(), v)
    v = torch.randint(0, 16, (8, 32), generator=g)
    assert torch.equal(quant_formats.unpack_awq(pack_columns(v, 4, AWQ_ORDER)).long(), v)


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3 is not supported for gptq"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, r"group_size 48 is not supported for 4 bits"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"checkpoint_format 'marlin'",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version 'gemv'"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"bits 8 is not supported for awq"),
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, r"lm_head true"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"},
            r"pack_dtype 'int16'",
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["down_proj"]},
            r"modules_to_not_convert",
        ),
    ],
)
def test_unsupported_settings_are_refused_at_start(qc: dict[str, Any], message: str, tmp_path: Path) -> None:
    cq = CheckpointQuantization("gptq", 4, 32, True, False, "gptq")
    write_quantized(tiny_llama(), tmp_path, cq, qc)
    with pytest.raises(UnsupportedQuantization, match=message):
        cpu_load(tmp_path)


def test_a_group_the_widths_do_not_divide_is_refused_naming_it(tmp_path: Path) -> None:
    hf = tiny_llama(hidden=192, intermediate=384)  # GPTQ packs ceil(192 / 128) = 2 groups per row
    write_quantized(hf, tmp_path, CheckpointQuantization("gptq", 4, 128, True, False, "gptq"))
    with pytest.raises(UnsupportedQuantization, match=r"group_size 128: .*hidden_size 192 is not a multiple"):
        cpu_load(tmp_path)


def test_8_bit_weights_int8_cannot_hold_are_refused_naming_the_layer(tmp_path: Path) -> None:
    cq = CheckpointQuantization("gptq", 8, 64, False, False, "gptq_v2")  # asymmetric 8-bit
    hf = tiny_llama()
    with torch.no_grad():  # all-positive weights: zero point 0, q up to 255 -> q - zero > 127
        hf.model.layers[0].mlp.down_proj.weight.abs_()
    write_quantized(hf, tmp_path, cq)
    with pytest.raises(
        UnsupportedQuantization,
        match=r"layer model\.layers\.0\.mlp\.down_proj: .*not exactly representable as int8",
    ):
        cpu_load(tmp_path)


def test_asymmetric_8_bit_weights_that_fit_int8_are_taken_exactly() -> None:
    """Every q - zero in -128..127 (here zeros 100..130, q within 100 of them): int8, exact."""
    g = torch.Generator().manual_seed(4)
    k, n, group = 128, 16, 64
    zeros = torch.randint(100, 131, (k // group, n), generator=g)
    q = (zeros.repeat_interleave(group, 0) + torch.randint(-100, 101, (k, n), generator=g)).clamp(0, 255)
    scales = (torch.rand(k // group, n, generator=g) / 50).half()
    tensors = {"qweight": pack_rows(q, 8), "qzeros": pack_columns(zeros, 8), "scales": scales}
    cq = CheckpointQuantization("gptq", 8, group, False, False, "gptq_v2")
    qw, perm = quant_formats.convert_gptq("layer", tensors, cq)
    assert qw.bits == 8 and perm is None
    assert torch.equal(qw.dequantize(), dequantize(q, zeros, scales, torch.arange(k) // group))


def test_auto_gptq_quantize_config_json_beside_the_config(tmp_path: Path) -> None:
    """Older auto-gptq checkpoints keep the settings in quantize_config.json, not in config.json."""
    cq = CheckpointQuantization("gptq", 4, 64, True, False, "gptq")
    deq = write_quantized(tiny_llama(), tmp_path, cq)
    config = json.loads((tmp_path / "config.json").read_text())
    settings = config.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings.pop("quant_method")
    (tmp_path / "quantize_config.json").write_text(json.dumps(settings))
    mod = cpu_load(tmp_path).model.model.layers[1].mlp.down_proj
    assert mod.qweight is not None and mod.qweight.group == 64
    assert torch.equal(mod.qweight.dequantize(), deq["model.layers.1.mlp.down_proj"])


def test_a_layer_stored_unquantized_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf = tiny_llama()
    write_quantized(hf, tmp_path, CheckpointQuantization("gptq", 4, 32, True, False, "gptq"))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"model.layers.1.self_attn.v_proj.{suffix}"]
    tensors["model.layers.1.self_attn.v_proj.weight"] = hf.model.layers[1].self_attn.v_proj.weight.detach()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        UnsupportedQuantization, match=r"layer model\.layers\.1\.self_attn\.v_proj is stored unquantized"
    ):
        cpu_load(tmp_path)


def test_fused_pieces_with_different_act_orders_are_refused(tmp_path: Path) -> None:
    """q/k/v share their input, so GPTQ gives them one act-order; a checkpoint that does not is refused."""
    cq = CheckpointQuantization("gptq", 4, 32, True, True, "gptq")
    hf = tiny_llama()
    write_quantized(hf, tmp_path, cq)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    module = "model.layers.0.self_attn.k_proj"
    packed, _ = pack_layer(hf.get_submodule(module).weight.detach(), cq, True, seed=12345)
    tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedQuantization, match=r"desc_act: the pieces of fused layer .*qkv_proj"):
        cpu_load(tmp_path)


def test_all_zero_biases_of_bias_free_layers_are_skipped(tmp_path: Path) -> None:
    """GPTQ-for-LLaMa and early auto-gptq wrote a zero `bias` for every layer; a non-zero one is an error."""
    from safetensors.torch import load_file

    hf = tiny_llama()
    cq = CheckpointQuantization("gptq", 4, 32, True, False, "gptq")
    deq = write_quantized(hf, tmp_path, cq)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(".qweight"):
            tensors[name.replace(".qweight", ".bias")] = torch.zeros(
                tensors[name].shape[1], dtype=torch.float16
            )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mod = cpu_load(tmp_path).model.model.layers[0].self_attn.o_proj
    assert mod.bias is None and mod.qweight is not None
    assert torch.equal(mod.qweight.dequantize(), deq["model.layers.0.self_attn.o_proj"])
    tensors["model.layers.0.self_attn.o_proj.bias"][3] = 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj\.bias: a non-zero bias"):
        cpu_load(tmp_path)


def test_serve_refuses_int8_on_a_gptq_checkpoint_exiting_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kvpilot.net import free_port
    from kvpilot.runtime import cli

    write_quantized(tiny_llama(), tmp_path, CheckpointQuantization("gptq", 4, 32, True, False, "gptq"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = [str(tmp_path), "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1"]
    argv += [
        "--port",
        str(free_port()),
        "--kv-cache-memory",
        "4MiB",
        "--threads",
        "1",
        "--quantization",
        "int8",
    ]
    assert cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "--quantization int8:" in err and "GPTQ 4-bit, group 32" in err and "Traceback" not in err
