"""KV-cache quantization: per-(token, head) absmax scales. int8 and fp8 (e4m3) storage."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    if kind == "auto":
        return model_dtype
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv cache dtype {kind!r} (expected auto, fp8 or int8)")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.int8, torch.float8_e4m3fn)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, D] -> (q [..., H, D] in dtype, scale [..., H] float32) with x ~= q * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=1e-6)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scale = amax / qmax
    y = xf / scale.unsqueeze(-1)
    q = y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
