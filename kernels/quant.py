"""KV-cache quantization: per-(token, head) absmax scales. int8 and fp8 (e4m3) storage.

Scales are stored as float16 (2 bytes per token and head), so a head of 64 values costs 66 bytes
instead of 128 in 16-bit: 1.94x the tokens in the same memory.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0


def storage_dtype(kind: str, model_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The KV cache's storage dtype for `--kv-cache-dtype kind`. `auto`: the model's dtype, except on
    the CPU under float32 activations, where it is bfloat16 (half the bytes the attention reads per
    step: 1.3x a batch-1 decode step at 1k tokens of context, 1.5x at 16k, and twice the tokens in the
    pool, for a rounding of the keys and values measured in docs/runtime.md, "Precision");
    `float32` keeps them unrounded there. On a GPU the attention kernels read the cache in the
    model's dtype: a float kind that differs from it is refused."""
    floats = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if kind == "auto":
        cpu_f32 = device_type == "cpu" and model_dtype == torch.float32
        return torch.bfloat16 if cpu_f32 else model_dtype
    if kind in floats:
        if device_type != "cpu" and floats[kind] != model_dtype:
            raise ValueError(
                f"--kv-cache-dtype {kind} under {str(model_dtype).removeprefix('torch.')} activations runs "
                f"on the CPU only; on {device_type} the cache is in the model's dtype (--dtype), or fp8/int8"
            )
        return floats[kind]
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv cache dtype {kind!r} (expected auto, float32, bfloat16, fp8 or int8)")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.int8, torch.float8_e4m3fn)


SCALE_DTYPE = torch.float16
_MIN_AMAX = 1e-4  # keeps amax / qmax a normal-ish float16


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, D] -> (q [..., H, D] in dtype, scale [..., H] float16) with x ~= q * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=_MIN_AMAX)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    # round the scale to its storage dtype first, so that quantization uses exactly the stored scale
    scale = (amax / qmax).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    q = y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
