"""GGUF blocks -> QuantizedWeight (runtime/load/gguf_blocks.py) against gguf's own dequantization."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvpilot.kernels import qlinear, switches
from kvpilot.runtime.load import gguf_blocks

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(path: str) -> Any:
    """A benchmark module loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(path).stem}", BENCH / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS, COLS = 6, 512  # two Q4_K super-blocks, sixteen 32-weight blocks a row


def random_blocks(name: str, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """Random bytes in every block, with its float16 fields set to finite weight-sized values."""
    gtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[gtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    n_f16 = 2 if name in ("Q4_1", "Q4_K") else 1  # d (and m / dmin) lead the block
    f16 = (rng.standard_normal((rows, cols // block, n_f16)) * 0.02).astype(np.float16)
    if name == "Q4_K":  # include tiny super-block scales: d * sc then falls below float16's normals
        f16[0] *= np.float16(1e-3)
    b[..., : 2 * n_f16] = f16.view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_q8_0_q4_0_q4_1_convert_exactly(name: str) -> None:
    rng = np.random.default_rng(1)
    raw = random_blocks(name, rng)
    gtype = GGMLQuantizationType[name]
    qw = gguf_blocks.to_qweight(raw, gtype, COLS)
    assert (qw.bits, qw.group, qw.out_features, qw.in_features) == (
        gguf_blocks.DIRECT_BITS[name],
        32,
        ROWS,
        COLS,
    )
    assert qw.scales.dtype == torch.float16 and qw.packed.shape == (ROWS, COLS * qw.bits // 8)
    want = dequantize(raw, gtype).reshape(ROWS, COLS)
    np.testing.assert_array_equal(qw.dequantize(torch.float32).numpy(), want)


def q4_k_bound(raw: np.ndarray) -> np.ndarray:
    """Per weight: 15 * err(d * sc) + err(dmin * m), err(x) = max(|x| 2^-11, 2^-25) (float16 rounding)."""
    b = raw.reshape(ROWS, -1, 144)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf_blocks.q4_k_scales_mins(b[..., 4:16])
    scale, mn = np.abs(d * sc), np.abs(dmin * m)

    def err(x: np.ndarray) -> np.ndarray:
        return np.maximum(x * 2.0**-11, 2.0**-25)

    per_group = 15 * err(scale) + err(mn)  # [rows, super-blocks, 8]
    return np.repeat(per_group.reshape(ROWS, -1), 32, axis=-1)


def test_q4_k_converts_within_the_float16_rounding_bound() -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks("Q4_K", rng)
    qw = gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q4_K, COLS)
    assert (qw.bits, qw.group) == (4, 32) and qw.mins is not None
    want = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(ROWS, COLS)
    got = qw.dequantize(torch.float32).numpy()
    diff = np.abs(got - want)
    bound = q4_k_bound(raw) + np.abs(want) * 2.0**-22  # float32 rounding of the two products
    assert (diff <= bound).all(), float((diff - bound).max())
    assert diff.max() > 0  # float16 really rounds some products (the bound is not vacuous)
    # nibbles regrouped, not merely scaled: q recovered from the packed bytes matches gguf's q
    q = torch.cat([qw.packed.reshape(ROWS, -1, 16) & 15, qw.packed.reshape(ROWS, -1, 16) >> 4], -1)
    nib = (
        raw.reshape(ROWS, -1, 144)[..., 16:].reshape(ROWS, -1, 4, 1, 32)
        >> np.array([0, 4], np.uint8)[:, None]
    )
    np.testing.assert_array_equal(q.reshape(ROWS, COLS).numpy(), (nib & 15).reshape(ROWS, COLS))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_converted_weights_multiply_like_their_dequantized_form(name: str) -> None:
    """The C kernel (decode rows) and the reference matmul read the converted blocks alike: the kernel
    computes its specification (int8 activation blocks, qlinear.reference_q8_matmul) on them, within
    1% of the float product, and the float product itself with exact activations."""
    rng = np.random.default_rng(3)
    raw = random_blocks(name, rng)
    if name == "Q8_0":  # llama.cpp's quantizer never writes -128; the kernel's range is -127..127
        raw.reshape(ROWS, -1, 34)[..., 2:][raw.reshape(ROWS, -1, 34)[..., 2:] == 128] = 129
    qw = gguf_blocks.to_qweight(raw, GGMLQuantizationType[name], COLS)
    x = torch.randn(3, COLS)
    want = x @ qw.dequantize(torch.float32).T
    if qlinear.kernel_applies(x, qw) and qlinear.q8_path_applies(qw):
        spec = qlinear.reference_q8_matmul(x, qw)
        torch.testing.assert_close(qlinear.matmul(x, qw), spec, rtol=1e-4, atol=1e-4)
        assert float((spec - want).norm() / want.norm()) < 0.01
    with switches.using(qmatmul_activations="float"):
        torch.testing.assert_close(qlinear.matmul(x, qw), want, rtol=1e-4, atol=1e-4)


def assert_within_half_an_int8_step(qw: qlinear.QuantizedWeight, want: torch.Tensor) -> None:
    """Each group's scale its max |w| / 127 in float16, and each weight within half a step of `want`
    (or, where float16 rounded the scale down and the code stopped at 127, that rounding times 127)."""
    n, k = want.shape
    groups = want.float().reshape(n, k // 32, 32)
    exact = groups.abs().amax(-1, keepdim=True) / 127
    stored = qw.scales.float().reshape(n, k // 32, 1)
    torch.testing.assert_close(stored, exact.half().float(), rtol=0, atol=0)
    bound = torch.maximum(stored / 2, 127 * (stored - exact).abs()) * (1 + 1e-3) + 1e-12
    err = (qw.dequantize(torch.float32).reshape(n, k // 32, 32) - groups).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def q6_k_real_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q6_K blocks of normal weights (benchmarks/quality/requant.py's encoder)."""
    return bench_module("quality/requant.py").quantize_q6_k(
        rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    )


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_0", "Q5_1", "Q4_K", "Q8_0"])
def test_other_quantized_types_requantize_to_int8_within_half_a_step(kind: str) -> None:
    rng = np.random.default_rng(11)
    if kind == "Q6_K":
        raw = q6_k_real_blocks(rng, ROWS, COLS)
    elif kind in ("Q5_0", "Q5_1"):
        from gguf.quants import quantize

        raw = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), GGMLQuantizationType[kind])
    elif kind == "Q4_K":
        weights = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.02
        raw = bench_module("quality/q4k.py").quantize_q4_k(weights)
    else:
        raw = random_blocks(kind, rng)
    gtype = GGMLQuantizationType[kind]
    want = torch.from_numpy(dequantize(raw, gtype).reshape(ROWS, COLS))
    qw = gguf_blocks.to_qweight_as(raw, gtype, COLS, 8)
    assert (qw.bits, qw.group, qw.mins) == (8, 32, None)
    if kind == "Q8_0":  # held exactly: the file's own bytes
        torch.testing.assert_close(qw.dequantize(torch.float32), want, rtol=0, atol=0)
    else:
        assert_within_half_an_int8_step(qw, want)


def test_load_bits_of_a_matrix_from_its_pieces_types() -> None:
    assert gguf_blocks.load_bits({"Q4_K", "Q4_0"}) == 4
    assert gguf_blocks.load_bits({"Q8_0"}) == 8
    assert gguf_blocks.load_bits({"Q4_K", "Q6_K"}) == 8  # a Q4_K_M layer's q/k/v
    assert gguf_blocks.load_bits({"Q5_K"}) == 8
    assert gguf_blocks.load_bits({"Q4_K", "F16"}) is None
    assert gguf_blocks.load_bits({"BF16"}) is None and gguf_blocks.load_bits(set()) is None
    assert not gguf_blocks.is_quantized("F32") and not gguf_blocks.is_quantized("NOPE")
    with pytest.raises(ValueError, match="do not load as 4-bit"):
        gguf_blocks.to_qweight_as(
            random_blocks("Q8_0", np.random.default_rng(0)), GGMLQuantizationType.Q8_0, COLS, 4
        )


def test_bad_blocks_are_refused() -> None:
    rng = np.random.default_rng(4)
    raw = random_blocks("Q4_0", rng)
    raw.reshape(ROWS, -1, 18)[0, 0, :2] = np.array([np.float16(9000.0)]).view(np.uint8)  # -8 d overflows
    with pytest.raises(ValueError, match="float16"):
        gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q4_0, COLS)
    with pytest.raises(ValueError, match="bytes a row"):
        gguf_blocks.to_qweight(raw[:, :-1], GGMLQuantizationType.Q4_0, COLS)
    with pytest.raises(ValueError, match="Q6_K"):
        gguf_blocks.to_qweight(raw, GGMLQuantizationType.Q6_K, COLS)


# ---------------------------------------------------------------------------------------------
# A whole (tiny) GGUF file with mixed storage types, through the loader


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    b = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    b[..., 208:] = (rng.standard_normal((rows, cols // 256, 1)) * 0.002).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def write_mixed_gguf(path: Path) -> None:
    """One llama layer, hidden 256 (Q4_K's super-block): q/k/v Q4_K, o Q4_0, gate Q4_K with up Q6_K
    (a fused layer of two kinds), down Q8_0, tied embedding Q8_0, norms float32."""
    import gguf

    rng = np.random.default_rng(5)
    hidden, inter, vocab = 256, 512, 64
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": 1, "context_length": 128, "embedding_length": hidden, "feed_forward_length": inter,
        "attention.head_count": 4, "attention.head_count_kv": 2,
    }.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)

    def blocks(name: str, kind: str, rows: int, cols: int) -> None:
        raw = q6_k_blocks(rng, rows, cols) if kind == "Q6_K" else random_blocks(kind, rng, rows, cols)
        if kind == "Q4_K":
            raw.reshape(rows, -1, 144)[..., :4] = (  # d and dmin of realistic size for a weight
                (rng.standard_normal((rows, cols // 256, 2)) * 0.0005).astype(np.float16).view(np.uint8)
            )
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    blocks("token_embd.weight", "Q8_0", vocab, hidden)
    blocks("blk.0.attn_q.weight", "Q4_K", hidden, hidden)
    blocks("blk.0.attn_k.weight", "Q4_K", 128, hidden)
    blocks("blk.0.attn_v.weight", "Q4_K", 128, hidden)
    blocks("blk.0.attn_output.weight", "Q4_0", hidden, hidden)
    blocks("blk.0.ffn_gate.weight", "Q4_K", inter, hidden)
    blocks("blk.0.ffn_up.weight", "Q6_K", inter, hidden)
    blocks("blk.0.ffn_down.weight", "Q8_0", hidden, inter)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_mixed(path: Path, quantization: str | None) -> Any:
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.load.gguf_checkpoint import gguf_arch_config
    from kvpilot.runtime.load.gguf_reader import GGUFFile
    from kvpilot.runtime.load.loader import build_model, load_gguf_weights, quantize_loaded

    with GGUFFile(path) as f:
        arch = gguf_arch_config(f)
        model = build_model(arch, torch.device("cpu"), torch.float32)
        load_gguf_weights(f, model, arch, quantization, 32)
    quantize_loaded(model, EngineConfig(model=str(path), quantization=quantization), path)  # type: ignore[arg-type]
    return model.eval(), arch


@pytest.mark.usefixtures("exact_qmatmul")  # the loader's plumbing, to float rounding
def test_a_mixed_gguf_loads_each_layer_its_own_way(tmp_path: Path) -> None:
    from tests.runtime.test_model_parity import PagedKV

    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path)
    ref, arch = load_mixed(path, None)  # everything dequantized to float32
    auto, _ = load_mixed(path, "auto")
    a, r = auto.model.layers[0], ref.model.layers[0]
    qkv = a.self_attn.qkv_proj.qweight
    assert (qkv.bits, qkv.group) == (4, 32) and a.self_attn.qkv_proj.weight is None
    want = r.self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv.dequantize(), want, rtol=2e-3, atol=1e-3 * float(want.abs().max()))
    exact = [(a.self_attn.o_proj, r.self_attn.o_proj, 4), (a.mlp.down_proj, r.mlp.down_proj, 8)]
    for got, base, bits in exact:  # Q4_0 and Q8_0 blocks: exactly the dequantized values
        assert got.weight is None and got.qweight.bits == bits
        torch.testing.assert_close(got.qweight.dequantize(), base.weight, rtol=0, atol=0)
    # Q4_K gate + Q6_K up: two widths, so the fused matrix loads as int8, both pieces requantized to
    # within half an int8 step of their dequantized values
    gate_up = a.mlp.gate_up_proj.qweight
    assert (gate_up.bits, gate_up.group) == (8, 32) and a.mlp.gate_up_proj.weight is None
    assert_within_half_an_int8_step(gate_up, r.mlp.gate_up_proj.weight)
    head = auto.lm_head.qweight
    assert (head.bits, head.group) == (8, 32) and auto.model.embed_tokens.qweight is head
    torch.testing.assert_close(head.dequantize(), ref.lm_head.weight, rtol=0, atol=0)

    ids = [3, 17, 42, 5, 60, 1, 8]
    with torch.no_grad():  # the reference with the requantized values: the rest must be exact
        r.mlp.gate_up_proj.weight.copy_(gate_up.dequantize(torch.float32))
    want_logits = PagedKV(arch).logits(ref, [(0, ids)])
    got_logits = PagedKV(arch).logits(auto, [(0, ids)])
    rel = float((got_logits - want_logits).abs().max() / want_logits.abs().max())
    assert rel < 1e-3, rel

    # int4 takes the 4-bit blocks as they are and quantizes the rest (Q8_0 down, the mixed gate/up)
    int4, _ = load_mixed(path, "int4")
    layer = int4.model.layers[0]
    torch.testing.assert_close(layer.self_attn.qkv_proj.qweight.packed, qkv.packed, rtol=0, atol=0)
    assert all(
        m.weight is None and m.qweight.bits == 4 for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    assert not torch.equal(layer.mlp.down_proj.qweight.dequantize(), r.mlp.down_proj.weight)  # re-rounded


def test_requantizing_in_row_chunks_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = q6_k_real_blocks(np.random.default_rng(3), ROWS, COLS)
    whole = gguf_blocks.requantize_int8(raw, GGMLQuantizationType.Q6_K, COLS)
    monkeypatch.setattr(gguf_blocks, "REQUANT_ROWS", 4)  # 6 rows: a chunk of 4 and one of 2
    chunked = gguf_blocks.requantize_int8(raw, GGMLQuantizationType.Q6_K, COLS)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(whole.scales, chunked.scales)
    assert (chunked.out_features, chunked.in_features) == (ROWS, COLS)
