"""KV quantization round trip: error bounds per storage dtype."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import quant


@pytest.mark.parametrize("dtype,bound", [(torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 1 / 16)])
def test_round_trip_error_is_bounded_relative_to_row_absmax(dtype: torch.dtype, bound: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-2, 2, 64)[:, None, None]
    q, scale = quant.quantize(x, dtype)
    assert q.dtype == dtype and scale.shape == (64, 4)
    back = quant.dequantize(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a quantization step; fp8 e4m3: 3 mantissa bits -> relative error <= 2^-4 of the value
    err = (back - x).abs()
    # (+ float16 rounding of the scale itself: relative 2^-11 of amax)
    limit = (bound + 2**-10) * amax if dtype == torch.int8 else bound * x.abs() + 2e-3 * amax
    assert bool((err <= limit + 1e-7).all())


def test_zero_rows_do_not_divide_by_zero() -> None:
    q, s = quant.quantize(torch.zeros(2, 3, 8), torch.int8)
    assert torch.isfinite(s).all()
    assert quant.dequantize(q, s, torch.float32).abs().sum() == 0


def test_storage_dtype_names() -> None:
    assert quant.storage_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert quant.storage_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert quant.storage_dtype("auto", torch.float16, "cuda") == torch.float16
    assert quant.storage_dtype("int8", torch.bfloat16, "cpu") == torch.int8
    assert quant.storage_dtype("fp8", torch.float16, "cuda") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv cache dtype"):
        quant.storage_dtype("int4", torch.float16, "cpu")


def test_auto_is_a_bfloat16_cache_under_float32_activations_on_the_cpu_only() -> None:
    assert quant.storage_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert quant.storage_dtype("float32", torch.float32, "cpu") == torch.float32  # the opt-out
    assert quant.storage_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert quant.storage_dtype("auto", torch.float32, "cuda") == torch.float32
    assert quant.storage_dtype("bfloat16", torch.bfloat16, "cuda") == torch.bfloat16
    for kind, model in [("bfloat16", torch.float32), ("float32", torch.bfloat16)]:
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {kind} under .* runs on the CPU only"):
            quant.storage_dtype(kind, model, "cuda")
