"""Weight-only quantization of whole models (runtime/quantization.py, `--quantization`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.kernels import qlinear
from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.loader import LoadedModel, load_model, quantization_method
from kvpilot.runtime.models import ModelArchConfig, get_model_class
from kvpilot.runtime.quantization import linear_layers, quantize_model
from tests.runtime.test_model_parity import PagedKV

PROMPT = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks of"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
# channel re-rounds them. Up to qlinear.SMALL_M rows (this prompt and the decode steps) the C kernel
# also rounds the activations to int8 blocks at the avx512/avx2 levels (kernels/qlinear.py). Measured
# max |logit diff| / max |logit| (the 16-bit model's tokens fed to both): int8 4.8%, int4 3.0%.
@pytest.mark.parametrize(("method", "max_rel"), [("int8", 0.08), ("int4", 0.05)])
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
        monkeypatch.setattr(qlinear, "INT8_ACTIVATIONS", False)
        exact = _prefill_then_decode(quant, ids, fed)
        assert float((exact - want).abs().max() / want.abs().max()) < 1e-3


def _tiny(hidden: int) -> Any:
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=hidden, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=64,
    )  # fmt: skip
    return get_model_class("LlamaForCausalLM")(arch)


def test_a_layer_that_cannot_take_the_method_is_refused_naming_the_flag() -> None:
    model = _tiny(48)  # 48 inputs: not a multiple of any int4 group
    with pytest.raises(
        ValueError,
        match=r"--quantization int4: layer model.layers.0.*not a multiple of the int4 group size 32",
    ):
        quantize_model(model, "int4", 32)
    assert all(m.weight is not None and m.qweight is None for _, m in linear_layers(model))  # untouched
    report = quantize_model(model, "int8")  # per channel takes any width
    assert report.layers == 4 and report.bytes_after < report.bytes_before / 3
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8")


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
