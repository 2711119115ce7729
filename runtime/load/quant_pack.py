"""Writing GPTQ and AWQ checkpoint tensors: the inverse of runtime/load/quant_formats.py's unpacking.

The runtime reads these formats; tests/runtime/test_gptq_awq.py and benchmarks/runtime_quality.py gptq
write checkpoints in them with the functions here. The packing libraries are not used: auto-gptq
0.7.1, gptqmodel 7.7.0 and autoawq 0.2.9 are source-only on PyPI, build CUDA extensions or pull
datasets/triton, and AutoAWQ (deprecated, "last tested with transformers 4.51") and auto-gptq do
not import under the transformers 5 this project tests with (tried: autoawq fails importing its
calibration code). The packers are written from the formats, as those libraries' sources (read
from the PyPI sdists) write them:

* GPTQ: `qweight` int32 [K * bits / 32, N] with input row 32/bits * i + j in bits
  [bits * j, bits * (j + 1)) of word (i, n); `qzeros` int32 [G, N * bits / 32] packed the same way
  along N; `scales` float16 [G, N]; `g_idx` int32 [K]; w = scale * (q - zero). The v1 format
  (`checkpoint_format: gptq`) stores zeros minus one, subtracted from each packed word as gptqmodel
  7.7.0's `convert_gptq_v2_to_v1_format_module` does (qzeros -= 0x11111111 for 4 bits); v2 stores
  them as they are (the v1/v2 difference is described in github.com/xxxxyu/blog,
  content/posts/vllm-gptqv2-support/index.md). The quantizer is GPTQ's min/max one
  (x_min <= 0 <= x_max, zero = round(-x_min / scale), symmetric zero 2^(bits - 1)) without the
  Hessian update, which changes the values, not the format.
* AWQ GEMM: `qweight` int32 [K, N / 8], output 8c + ORDER[j] in bits [4j, 4j + 4) of word (k, c),
  ORDER = 0 2 4 6 1 3 5 7 (autoawq 0.2.9's `WQLinear_GEMM.from_linear`); `qzeros` int32
  [K / group, N / 8] packed the same way; `scales` float16 [K / group, N]; w = scale * (q - zero).

Pure functions on CPU tensors; nothing here is used while serving.
"""

from __future__ import annotations

import torch

from kvpilot.runtime.load.quant_formats import AWQ_ORDER, CheckpointQuantization

# The Hugging Face Llama-family linear layers a GPTQ/AWQ checkpoint stores quantized.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensors with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _or_fields(fields: list[torch.Tensor], bits: int) -> torch.Tensor:
    word = torch.zeros_like(fields[0])
    for j, field in enumerate(fields):
        word = word + (field << (bits * j))
    return to_int32(word)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] -> int32 [K * bits / 32, N], 32 / bits consecutive rows per word (GPTQ's qweight)."""
    per = 32 // bits
    v = values.long().reshape(-1, per, values.shape[1])
    return _or_fields([v[:, j] for j in range(per)], bits)


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, N] -> int32 [R, N * bits / 32]; field j of word c holds column c * per + order[j]."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.long().reshape(values.shape[0], -1, per)
    return _or_fields([v[..., order[j]] for j in range(per)], bits)


def group_index(k: int, group_size: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """g_idx [K] int64: the group of each input row. `order` (act-order, `desc_act`) lists the input
    rows in the order the groups are formed (GPTQ: decreasing Hessian diagonal); None: k // group."""
    group = k if group_size == -1 else group_size
    if order is None:
        return torch.arange(k) // group
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    return g_idx


def quantize_groups(
    w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's min/max quantizer per group of input rows of W [N, K]: q [K, N], zeros [G, N] (int64),
    scales float16 [G, N]. A group may hold fewer rows than the others (GPTQ's last group when
    group_size does not divide K)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    q = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].double()  # [N, rows of group g]
        lo = wg.amin(dim=1).clamp(max=0)
        hi = wg.amax(dim=1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-8).half()
        zero = torch.full_like(lo, 2 ** (bits - 1)) if sym else (-lo / scale.double()).round()
        qg = (wg / scale.double().unsqueeze(1)).round() + zero.unsqueeze(1)
        q[cols] = qg.clamp(0, maxq).long().t()
        zeros[g], scales[g] = zero.long(), scale
    return q, zeros, scales


def dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """The packed layer's weights: scale * (q - zero), [N, K] float32."""
    return (scales[g_idx].float() * (q - zeros[g_idx]).float()).t().contiguous()


def pack_layer(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    cq: CheckpointQuantization,
) -> dict[str, torch.Tensor]:
    """Quantized values q [K, N], zeros and scales [G, N] -> one layer's tensors in cq's format."""
    if cq.method == "awq":
        return {
            "qweight": pack_columns(q, 4, AWQ_ORDER),
            "qzeros": pack_columns(zeros, 4, AWQ_ORDER),
            "scales": scales,
        }
    qzeros = pack_columns(zeros, cq.bits)
    if cq.checkpoint_format == "gptq":  # v1: every packed zero minus one, as word arithmetic
        qzeros = to_int32(qzeros.long() - sum(1 << (cq.bits * j) for j in range(32 // cq.bits)))
    return {
        "qweight": pack_rows(q, cq.bits),
        "qzeros": qzeros,
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }


def quantize_layer(
    w: torch.Tensor, cq: CheckpointQuantization, order: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """W [N, K] -> its checkpoint tensors in cq's format and their dequantized [N, K] float32 weight.
    `order`: the act-order input row order (see group_index); None keeps k // group_size."""
    g_idx = group_index(w.shape[1], cq.group_size, order)
    q, zeros, scales = quantize_groups(w, cq.bits, g_idx, cq.sym)
    return pack_layer(q, zeros, scales, g_idx, cq), dequantize(q, zeros, scales, g_idx)
