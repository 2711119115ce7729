"""The quantized Triton matmul (kernels/triton_qlinear.py) against qlinear.reference_matmul.

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); on a GPU the same tests run on CUDA tensors (scripts/gpu_check.sh selects them with
`-m gpu`), and the last ones check that qlinear.matmul and a quantized engine take the kernel there.
Shapes stay small (the interpreter is slow) but cover every format (int8 per channel and group 32,
int4 groups 32/64/128), fp16/bf16/fp32 activations, decode and prefill row counts across the tile
sizes, and N and K that are not multiples of the tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.kernels import qlinear, triton_qlinear
from tests.needs import missing

pytestmark = pytest.mark.gpu

if not triton_qlinear.available():
    missing("triton (it comes with torch on Linux x86-64)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the reference rounds the same dequantized weights; what differs is the summation order (and, in
# 16-bit, where the output is rounded): a wrong code, nibble, scale or min is far outside these
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS: dict[str, Callable[[torch.Tensor], qlinear.QuantizedWeight]] = {
    "int8-per-channel": qlinear.quantize_int8,
    "int8-group32": lambda w: qlinear.quantize_int8(w, 32),
    "int4-group32": lambda w: qlinear.quantize_int4(w, 32),
    "int4-group64": lambda w: qlinear.quantize_int4(w, 64),
    "int4-group128": lambda w: qlinear.quantize_int4(w, 128),
}
# (N, K): N is never a multiple of the 32/64/128-column tiles; int8 per channel gets a K that is not
# a multiple of its 32-code steps (masked), the grouped formats the smallest K with several groups
SHAPES = {
    "int8-per-channel": (40, 72),
    "int8-group32": (40, 96),
    "int4-group32": (72, 96),
    "int4-group64": (40, 192),
    "int4-group128": (24, 256),
}


def check(x: torch.Tensor, qw: qlinear.QuantizedWeight, bias: torch.Tensor | None) -> None:
    got = triton_qlinear.qmatmul(x, qw, bias)
    want = qlinear.reference_matmul(x, qw, bias)
    assert got.shape == want.shape and got.dtype == x.dtype
    tol = TOL[x.dtype]
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_kernel_equals_dequantize_then_matmul(fmt: str, dtype: torch.dtype, m: int) -> None:
    torch.manual_seed(m)
    n, k = SHAPES[fmt]
    qw = FORMATS[fmt](torch.randn(n, k)).to(DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if m != 16 else None
    check(x, qw, bias)


@pytest.mark.parametrize("fmt", ["int8-per-channel", "int8-group32", "int4-group32", "int4-group128"])
@pytest.mark.parametrize("m", [1, 5])
def test_decode_kernel_splits_k_across_programs_and_masks_the_tail(fmt: str, m: int) -> None:
    """Small tiles force several K splits (the last one short) and a channel tail, as 8B shapes get
    from the default tile on a GPU; the partial sums add up to the reference."""
    torch.manual_seed(m)
    n, k = (40, 200) if fmt == "int8-per-channel" else (40, 256)
    qw = FORMATS[fmt](torch.randn(n, k)).to(DEVICE)
    cfg = triton_qlinear.DecodeConfig(block_n=16, block_kb=16, num_stages=2, target_programs=12)
    units = k if qw.bits == 8 else k // 2
    split, per = triton_qlinear.decode_split(n, units, cfg)
    assert split >= 3 and per % 16 == 0 and (split - 1) * per < units <= split * per
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    got = triton_qlinear.qgemv(x, qw, bias, cfg)
    want = qlinear.reference_matmul(x, qw, bias)
    torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=2e-5)


def test_decode_split_fills_the_gpu_without_empty_or_tiny_splits() -> None:
    cfg = triton_qlinear.DecodeConfig()  # 64 channels x 64 bytes, 264 programs wanted
    # an 8B model's o_proj at int4 (N 4096, K 4096 = 2048 bytes): 64 channel tiles, 5 splits of 448 bytes
    assert triton_qlinear.decode_split(4096, 2048, cfg) == (5, 448)
    # a wide gate/up (N 28672): 448 channel tiles already fill the GPU, K stays whole
    assert triton_qlinear.decode_split(28672, 2048, cfg) == (1, 2048)
    # a short K never splits below two steps
    assert triton_qlinear.decode_split(64, 256, cfg) == (2, 128)
    for n, units in [(4096, 2048), (6144, 2048), (4096, 7168), (128256, 2048), (40, 100)]:
        split, per = triton_qlinear.decode_split(n, units, cfg)
        assert per % cfg.block_kb == 0 and (split - 1) * per < units <= split * per


def test_prefill_rows_leading_dims_and_a_strided_input() -> None:
    """Many rows (the 64 x 128 tiles, several row tiles), a [B, T, K] input, a non-contiguous x."""
    torch.manual_seed(1)
    qw = qlinear.quantize_int4(torch.randn(136, 64), 32).to(DEVICE)
    x = torch.randn(2, 70, 64, device=DEVICE)
    out = triton_qlinear.qmatmul(x, qw)
    assert out.shape == (2, 70, 136)
    check(x, qw, None)
    wide = torch.randn(5, 128, device=DEVICE)
    check(wide[:, ::2], qw, None)  # every other column: stride 2 along K


def test_each_nibble_scale_and_min_lands_on_its_own_weight() -> None:
    """One-hot inputs read single weights back: column j of out is row j of the dequantized W."""
    torch.manual_seed(2)
    for qw in (qlinear.quantize_int4(torch.randn(20, 128), 64), qlinear.quantize_int8(torch.randn(20, 48))):
        qw = qw.to(DEVICE)
        eye = torch.eye(qw.in_features, device=DEVICE)[:33]
        got = triton_qlinear.qmatmul(eye, qw)
        torch.testing.assert_close(got, qw.dequantize()[:, :33].t())


def test_what_the_kernel_takes_and_refuses() -> None:
    x = torch.zeros(2, 64)
    i4 = qlinear.quantize_int4(torch.randn(8, 64), 32)
    assert triton_qlinear.unsupported(i4) is None
    assert triton_qlinear.unsupported(qlinear.quantize_int8(torch.randn(8, 40))) is None  # per channel
    odd = qlinear.quantize_int8(torch.randn(8, 72), 24)  # a group that is neither K nor 16 * i
    assert "group size 24" in str(triton_qlinear.unsupported(odd))
    with pytest.raises(ValueError, match="cannot take int8 group size 24"):
        triton_qlinear.qmatmul(torch.zeros(1, 72), odd)
    with pytest.raises(ValueError, match="input has 48 features, the weight expects 64"):
        triton_qlinear.qmatmul(torch.zeros(1, 48), i4)
    with pytest.raises(ValueError, match="the kernel takes float16, bfloat16 or float32"):
        triton_qlinear.qmatmul(torch.zeros(1, 64, dtype=torch.float64), i4)
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(8,\)"):
        triton_qlinear.qmatmul(x, i4, torch.zeros(4))
    assert triton_qlinear.qmatmul(torch.zeros(0, 64), i4).shape == (0, 8)
    # qlinear.matmul takes it only for CUDA tensors: CPU stays on the C kernel / dequantize paths
    assert not triton_qlinear.applies(x, i4)
    assert triton_qlinear.tile_shape(1) == (16, 32, 4) and triton_qlinear.tile_shape(33)[0] == 64


@needs_cuda
def test_qlinear_matmul_takes_the_kernel_on_cuda() -> None:
    torch.manual_seed(3)
    qw = qlinear.quantize_int4(torch.randn(4096, 4096), 128).to(DEVICE)
    for m in (1, 32, 300):
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        assert triton_qlinear.applies(x, qw)
        got = qlinear.matmul(x, qw)
        want = qlinear.reference_matmul(x, qw)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(want.abs().max()), rtol=2e-2)


def test_a_quantized_model_layer_through_qlinear_matmul_takes_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wiring: with `applies` true (on a GPU it is for CUDA tensors; here it is made true for the
    interpreter), a tiny int4 Llama's MLP runs its matmuls through the kernel and computes what float
    weights equal to the dequantized ones compute."""
    from kvpilot.runtime.load.quantization import linear_layers, quantize_model
    from kvpilot.runtime.models import ModelArchConfig, get_model_class

    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(4)
    model = get_model_class("LlamaForCausalLM")(arch)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    ref = get_model_class("LlamaForCausalLM")(arch)
    ref.load_state_dict(model.state_dict())
    quantize_model(model, "int4", 32)
    for (_, q), (_, r) in zip(linear_layers(model), linear_layers(ref), strict=True):
        assert q.qweight is not None and r.weight is not None
        r.weight.data = q.qweight.dequantize(torch.float32)
    model.to(DEVICE)
    ref.to(DEVICE)
    calls = []
    kernel = triton_qlinear.qmatmul

    def counted(
        x: torch.Tensor, qw: qlinear.QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, qw, bias)

    monkeypatch.setattr(qlinear, "kernel_applies", lambda x, qw: False)
    monkeypatch.setattr(triton_qlinear, "applies", lambda x, qw: triton_qlinear.unsupported(qw) is None)
    monkeypatch.setattr(triton_qlinear, "qmatmul", counted)
    x = torch.randn(5, 64, device=DEVICE)
    got = model.model.layers[0].mlp(x)
    assert calls == [5, 5]  # gate_up, down
    torch.testing.assert_close(got, ref.model.layers[0].mlp(x), rtol=1e-4, atol=1e-5)
