"""Weight-only quantization of whole models (runtime/load/quantization.py, `--quantization`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.kernels import isa, qlinear, switches
from kvpilot.runtime.config import DEFAULT_MODEL, ConfigError, EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.load.loader import LoadedModel, load_model, quantization_method
from kvpilot.runtime.load.quantization import fitting_int4_groups, linear_layers, quantize_model, tile_for_cpu
from kvpilot.runtime.models import ModelArchConfig, get_model_class
from tests.needs import missing
from tests.runtime.test_model_parity import PagedKV

PROMPT = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks of"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prefill_then_decode(loaded: LoadedModel, ids: list[int], fed: list[int] | None = None) -> torch.Tensor:
    """Logits of a prefill (torch matmuls over many rows: a 20-odd-token prompt takes the C kernel
    too) and 3 decode steps (the C kernel), fed `fed` (teacher forcing: both models see the same
    tokens, so a near-tie argmax cannot send them down different continuations) or their own argmax."""
    kv = PagedKV(loaded.arch)
    rows = [kv.logits(loaded.model, [(0, ids)])[-1]]
    for i in range(3):
        token = fed[i] if fed is not None else int(rows[-1].argmax())
        rows.append(kv.logits(loaded.model, [(0, [token])])[-1])
    return torch.stack(rows)


# The builtin SmolLM2 GGUF stores its linear weights as Q4_1 (groups of 32, scale and min): int4 with
# group 32 is that format, so it gets the same weights back (up to float32 rounding); int8 per output
# channel re-rounds them. At the avx512/avx2 levels the C kernels also round the activations to int8
# blocks (kernels/qlinear.py: the tiled kernel, the row-layout kernel or the GEMM, by level and rows).
# Measured max |logit diff| / max |logit| (the 16-bit model's tokens fed to both): int8 4.8%, int4
# 3.0-5.5% depending on which kernel took the prompt: the same arithmetic to float rounding, but
# activation rounding is discontinuous, and scaling one norm weight by 1 + 1e-6 moves these logits by
# 2-2.8% of the largest: the bound covers the rounding noise, not one realization.
@pytest.mark.parametrize(("method", "max_rel"), [("int8", 0.08), ("int4", 0.08)])
def test_int8_and_int4_models_stay_close_to_the_16_bit_one(
    smollm2_fp32: LoadedModel, method: str, max_rel: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization=method, quantization_group_size=32)  # type: ignore[arg-type]
    quant = load_model(cfg, torch.device("cpu"), torch.float32)
    layers = list(linear_layers(quant.model))
    assert len(layers) == 4 * smollm2_fp32.arch.num_hidden_layers  # qkv, o, gate_up, down
    assert all(
        m.weight is None and m.qweight is not None and m.qweight.bits == int(method[3:]) for _, m in layers
    )
    before = sum(m.weight.numel() * 4 for _, m in linear_layers(smollm2_fp32.model) if m.weight is not None)
    after = sum(m.qweight.nbytes for _, m in layers if m.qweight is not None)
    assert after < before / (3.9 if method == "int8" else 6.3)  # float32 -> 1 or 5/8 bytes a weight
    ids = smollm2_fp32.tokenizer.encode(PROMPT)
    assert qlinear.kernel_applies(torch.zeros(1, 576), layers[0][1].qweight)  # type: ignore[arg-type]
    want = _prefill_then_decode(smollm2_fp32, ids)
    fed = want.argmax(-1).tolist()
    got = _prefill_then_decode(quant, ids, fed)
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"\n{method}: max |logit diff| / max |logit| over prefill + 3 decode steps = {rel:.4f}")
    assert rel < max_rel
    assert int(got[0].argmax()) == fed[0]  # the prompt's next token
    if method == "int4":  # the same weights: with float activations the kernel gives the same logits
        switches.use(switches.changed(qmatmul_activations="float"))
        exact = _prefill_then_decode(quant, ids, fed)
        assert float((exact - want).abs().max() / want.abs().max()) < 1e-3


def _tiny(hidden: int, tie: bool = False) -> Any:
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=hidden, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    return get_model_class("LlamaForCausalLM")(arch)


def test_quantized_weights_follow_the_model_to_a_device_and_stay_shared() -> None:
    """`.to(device)` moves the quantized weights (attributes, not parameters) with the parameters: the
    first GPU run found `model.cuda()` after quantizing left them on the CPU. They move in place, so the
    tied head and embedding still share one; a dtype change leaves their float16 scales alone; and
    resident_bytes counts the shared one once. (The meta device stands in for a GPU.)"""
    from kvpilot.runtime.load.quantization import quantize_lm_head
    from kvpilot.runtime.models.layers import resident_bytes

    model = _tiny(64, tie=True)
    quantize_model(model, "int4", 32)
    quantize_lm_head(model)
    head, embed = model.lm_head, model.model.embed_tokens
    assert embed.qweight is head.qweight
    proj = model.model.layers[0].self_attn.o_proj
    proj.input_perm = torch.arange(proj.qweight.in_features)  # as a GPTQ act-order weight has
    layers = [q for _, q in linear_layers(model)] + [head]
    quantized = sum(m.qweight.nbytes for m in layers[:-1]) + head.qweight.nbytes
    others = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert resident_bytes(model) == quantized + others + proj.input_perm.numel() * 8
    dtypes = [[t.dtype for t in m.qweight.tensors()] for m in layers]
    assert all(m.qweight.scales.dtype == torch.float16 for m in layers)
    model.to(torch.bfloat16)
    assert [[t.dtype for t in m.qweight.tensors()] for m in layers] == dtypes
    model.to("meta")
    assert all(t.device.type == "meta" for m in layers for t in m.qweight.tensors())
    assert proj.input_perm.device.type == "meta"
    assert embed.qweight is head.qweight and all(p.device.type == "meta" for p in model.parameters())
    assert resident_bytes(model) == 0  # nothing left on a real device


def test_a_layer_that_cannot_take_the_method_is_refused_naming_the_flag() -> None:
    model = _tiny(48)  # 48 inputs: not a multiple of any int4 group
    with pytest.raises(
        ConfigError,
        match=r"--quantization int4: layer model.layers.0.*not a multiple of the int4 group size 32; "
        r"no int4 group size \(32, 64, 128\) divides .*--quantization int8",
    ):
        quantize_model(model, "int4", 32)
    assert all(m.weight is not None and m.qweight is None for _, m in linear_layers(model))  # untouched
    report = quantize_model(model, "int8")  # per channel takes any width
    assert report.layers == 4 and report.bytes_after < report.bytes_before / 3
    with pytest.raises(ValueError, match="already quantized") as exc:
        quantize_model(model, "int8")
    assert not isinstance(exc.value, ConfigError)  # no flag makes this call: a programming error


def test_an_int4_group_the_widths_do_not_divide_names_the_groups_that_fit(tmp_path: Path) -> None:
    """hidden 96 with group 64: refused at load as a configuration error naming the group sizes that
    fit every layer (96 and the intermediate 64 take 32 only)."""
    model = _tiny(96)
    with pytest.raises(
        ConfigError,
        match=r"--quantization int4: layer .*in_features 96 is not a multiple of the int4 group size 64; "
        r"--quantization-group-size 32 fits every layer of this model$",
    ):
        quantize_model(model, "int4", 64)
    assert quantize_model(model, "int4", 32).layers == 4  # the size it named works
    assert fitting_int4_groups([256, 512]) == [32, 64, 128]
    assert fitting_int4_groups([192, 256]) == [32, 64]
    assert fitting_int4_groups([48]) == []


def test_tiny_quantized_model_matches_its_dequantized_weights() -> None:
    """The quantized layers compute what float weights equal to the dequantized ones would: exactly on
    the float paths, and up to the kernel's int8 activation rounding (its specification,
    qlinear.reference_q8_matmul) where the C kernel takes the decode rows."""
    torch.manual_seed(0)
    model = _tiny(64)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    ref = _tiny(64)
    ref.load_state_dict(model.state_dict())
    quantize_model(model, "int4", 32)
    for (_, q), (_, r) in zip(linear_layers(model), linear_layers(ref), strict=True):
        assert q.qweight is not None and r.weight is not None
        r.weight.data = q.qweight.dequantize(torch.float32)
    x = torch.randn(2, 64)
    for (_, q), (_, r) in zip(linear_layers(model), linear_layers(ref), strict=True):
        qw = q.qweight
        assert qw is not None
        xin = torch.randn(2, qw.in_features)
        want = r(xin)
        if qlinear.kernel_applies(xin, qw) and qlinear.q8_path_applies(qw):
            spec = qlinear.reference_q8_matmul(xin, qw, r.bias)
            assert float((spec - want).norm() / want.norm()) < 0.02
            want = spec
        torch.testing.assert_close(q(xin), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.layers[0].mlp(x), ref.model.layers[0].mlp(x), rtol=0.03, atol=0.02)


def test_auto_follows_the_checkpoint(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    assert quantization_method("auto", smollm2_gguf_path) == "int4"  # the builtin GGUF stores Q4_1
    assert quantization_method("auto", tmp_path) is None  # a 16-bit HF directory stays as it is
    assert quantization_method("int8", smollm2_gguf_path) == "int8"
    assert quantization_method(None, smollm2_gguf_path) is None


def test_config_schema_takes_and_checks_the_settings() -> None:
    cfg = EngineConfig.model_validate({"quantization": "int4", "quantization_group_size": 64})
    assert cfg.quantization == "int4" and cfg.quantization_group_size == 64
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.model_validate({"quantization": "fp4"})
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineConfig.model_validate({"quantization": "int4", "quantization_group_size": 48})


def test_serve_flags_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvpilot.runtime import cli

    def args(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        return parser.parse_args(argv)

    assert cli.build_config(args([])).quantization is None
    path = tmp_path / "serve.yaml"
    path.write_text("quantization: int8\nquantization_group_size: 128\n")
    cfg = cli.build_config(args(["--config", str(path)]))
    assert (cfg.quantization, cfg.quantization_group_size) == ("int8", 128)
    cfg = cli.build_config(
        args(["--config", str(path), "--quantization", "int4", "--quantization-group-size", "64"])
    )
    assert (cfg.quantization, cfg.quantization_group_size) == ("int4", 64)
    with pytest.raises(SystemExit):
        args(["--quantization", "gptq"])
    assert "--quantization" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# GGUF blocks kept as they are, and the quantized LM head


@pytest.mark.usefixtures("exact_qmatmul")
def test_auto_runs_the_builtin_gguf_from_its_own_blocks(smollm2_fp32: LoadedModel) -> None:
    """`auto` on the builtin GGUF: every linear layer is its Q4_1 blocks (int4 group 32), the tied LM
    head and embedding its Q8_0 blocks (int8 group 32), no 16-bit copy of any of them; those are the
    very values the float model was dequantized to, so greedy decoding picks the same tokens (with
    the kernel's exact float activations: int8 activation rounding moves near-ties)."""
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="auto", dtype="float32", kv_cache_memory=64 << 20)
    quant = load_model(cfg, torch.device("cpu"), torch.float32)
    model: Any = quant.model
    assert all(m.weight is None and m.qweight is not None for _, m in linear_layers(model))
    assert {(m.qweight.bits, m.qweight.group) for _, m in linear_layers(model)} == {(4, 32)}  # type: ignore[union-attr]
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight is None and embed.weight is None and embed.qweight is head.qweight
    assert (head.qweight.bits, head.qweight.group, head.qweight.out_features) == (8, 32, 49152)
    assert not any(p.dtype.is_floating_point and p.dim() == 2 for p in model.parameters())
    # the same values as the dequantized float model, layer by layer
    ref: Any = smollm2_fp32.model
    torch.testing.assert_close(head.qweight.dequantize(), ref.lm_head.weight, rtol=0, atol=0)
    for (_, q), (_, r) in zip(linear_layers(model), linear_layers(ref), strict=True):
        torch.testing.assert_close(q.qweight.dequantize(), r.weight, rtol=0, atol=0)

    tok = smollm2_fp32.tokenizer
    prompts = [tok.encode(p) for p in (PROMPT, "def fibonacci(n):", "The capital of France is")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = engine_from_loaded(smollm2_fp32, cfg.model_copy(update={"quantization": None}))
    got = engine_from_loaded(quant, cfg)
    ref_tokens = [s.output_token_ids for s in want.generate(prompts, params)]
    assert [s.output_token_ids for s in got.generate(prompts, params)] == ref_tokens


@pytest.mark.usefixtures("exact_qmatmul")  # the head's values; int8 activations are bounded above
def test_the_lm_head_of_a_16_bit_model_becomes_int8() -> None:
    """A float LM head becomes int8 with a scale per 32 weights; the tied embedding shares it and a
    lookup dequantizes just the rows it reads. (The float model here holds the GGUF's dequantized
    Q8_0 head, which group 32 reproduces; the bound below is the quantizer's, whatever the input.)"""
    from kvpilot.runtime.load.quantization import quantize_lm_head

    loaded = load_model(EngineConfig(model=DEFAULT_MODEL), torch.device("cpu"), torch.float32)
    model: Any = loaded.model
    w = model.lm_head.weight.detach().clone()
    ids = loaded.tokenizer.encode(PROMPT)
    want = _prefill_then_decode(loaded, ids)
    before, after = quantize_lm_head(model) or (0, 0)
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight is None and embed.weight is None and embed.qweight is head.qweight
    assert (head.qweight.bits, head.qweight.group) == (8, 32) and after < before / 3.7
    assert quantize_lm_head(model) is None  # already quantized: nothing to do
    rows = torch.tensor([[5, 49151], [0, 12345]])
    torch.testing.assert_close(embed(rows), head.qweight.dequantize()[rows], rtol=0, atol=0)
    groups = w.reshape(w.shape[0], -1, 32)
    err = (head.qweight.dequantize().reshape(groups.shape) - groups).abs()
    assert (err <= groups.abs().amax(-1, keepdim=True) / 254 * 1.01 + 1e-9).all()  # half a step
    got = _prefill_then_decode(loaded, ids)
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"\nint8 LM head: max |logit diff| / max |logit| over prefill + 3 decode steps = {rel:.2e}")
    assert rel < 1e-4
    assert int(got[0].argmax()) == int(want[0].argmax())


def test_which_layers_load_from_blocks(smollm2_gguf_path: Path) -> None:
    """Blocks go straight in when the method takes their format; otherwise the layer is dequantized."""
    from kvpilot.runtime.load.gguf_checkpoint import gguf_arch_config
    from kvpilot.runtime.load.gguf_reader import GGUFFile
    from kvpilot.runtime.load.loader import build_model, gguf_blocks_plan

    with GGUFFile(smollm2_gguf_path) as f:
        arch = gguf_arch_config(f)
        model = build_model(arch, torch.device("cpu"), torch.float32)  # uninitialized: nothing touched

        def plan(method: str | None, group: int = 32) -> dict[str, tuple[int, int]]:
            return gguf_blocks_plan(f, model, method, group)[0]

        everything = plan("auto")
        assert len(everything) == 4 * 30 + 1 and everything["model.embed_tokens"] == (8, 32)
        assert everything["model.layers.0.self_attn.qkv_proj"] == (4, 32)
        assert plan("int4") == everything
        assert plan("int4", 64) == plan("int8") == {"model.embed_tokens": (8, 32)}  # Q4_1 is neither
        assert plan(None) == {}
        names = gguf_blocks_plan(f, model, "auto", 32)[1]
        assert "blk.0.attn_q.weight" in names and "token_embd.weight" in names
        assert "blk.0.attn_norm.weight" not in names


def test_int4_group_64_on_the_builtin_gguf_requantizes_the_layers_and_keeps_the_head_blocks() -> None:
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", quantization_group_size=64)
    loaded = load_model(cfg, torch.device("cpu"), torch.float32)
    model: Any = loaded.model
    assert {(m.qweight.bits, m.qweight.group) for _, m in linear_layers(model)} == {(4, 64)}
    assert (model.lm_head.qweight.bits, model.lm_head.qweight.group) == (8, 32)


def test_loaded_quantized_weights_are_tiled_for_the_cpu_kernel_and_the_tied_head_once() -> None:
    """load_model puts every quantized layer the CPU kernel tiles into the tiled layout; the tied
    embedding and LM head keep sharing one weight, and the embedding reads its rows from the tiles."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if qlinear.built_isa() == "generic":
        pytest.skip("the tiled layout exists at the avx512 and avx2 levels only: the generic sibling below")
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", quantization_group_size=32)
    model: Any = load_model(cfg, torch.device("cpu"), torch.float32).model
    assert all(m.qweight.tiled for _, m in linear_layers(model))
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.qweight is embed.qweight and head.qweight.tiled
    ids = torch.tensor([[0, 17, 49151, 576]])
    want = qlinear.untile(head.qweight).dequantize(torch.float32)[ids[0]]
    torch.testing.assert_close(embed(ids)[0], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tiled quantized weight cannot be narrowed"):
        from kvpilot.runtime.models.layers import narrow_qweight

        narrow_qweight(head.qweight, 0, 0, 16)


def test_at_the_generic_level_loaded_weights_keep_the_row_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above's sibling for a CPU without AVX2 (the level forced here): its kernel has no
    tiled path, so load_model leaves every quantized weight in the row layout that kernel reads."""
    if not qlinear.available("generic"):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    monkeypatch.setattr(isa, "selected", lambda: "generic")
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", quantization_group_size=32)
    model: Any = load_model(cfg, torch.device("cpu"), torch.float32).model
    layers = list(linear_layers(model))
    assert layers and not any(m.qweight.tiled for _, m in layers)
    assert tile_for_cpu(model) == 0


def test_quantized_weights_cut_on_blocks_for_tensor_parallel_shards() -> None:
    from kvpilot.runtime.models.layers import narrow_qweight

    qw = qlinear.quantize_int4(torch.randn(6, 128), 32)
    cols = narrow_qweight(qw, 1, 64, 64)
    torch.testing.assert_close(cols.dequantize(), qw.dequantize()[:, 64:], rtol=0, atol=0)
    rows = narrow_qweight(qlinear.quantize_int8(torch.randn(6, 64), 32), 0, 2, 3)
    assert rows.packed.shape == (3, 64) and rows.scales.shape == (3, 2)
    with pytest.raises(ValueError, match="group size 32"):
        narrow_qweight(qw, 1, 16, 64)
