"""GPTQ and AWQ checkpoints: their settings, and each layer's packed tensors as a QuantizedWeight.

Pure functions; runtime/load/loader.py streams a checkpoint's tensors through them, one layer at a time,
so no 16-bit copy of the model is ever made.

Formats (W is the [N, K] weight of a linear layer, y = x W^T; q, zero are unsigned `bits`-bit ints):

* GPTQ (`quant_method: gptq`, 4 or 8 bits): `qweight` int32 [K * bits / 32, N], the values of
  32 / bits consecutive input rows k in one word, row k + j in bits [bits * j, bits * (j + 1));
  `qzeros` int32 [G, N * bits / 32], packed the same way along N; `scales` float16 [G, N];
  `g_idx` int32 [K], the group of each input row (k // group_size unless act-order, `desc_act`,
  reordered the groups). W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].
  `checkpoint_format: gptq` (v1, auto-gptq and the default) stores every zero minus one, subtracted
  from the packed int32 words (gptqmodel's writer; a zero of 0 borrows from the next field) and
  added back the same way here; `gptq_v2` stores the zeros as they are. `sym: true` has every zero
  at 2^(bits - 1). `group_size: -1` is one group per output channel.
* AWQ (`quant_method: awq`, `version: gemm`, 4 bits): `qweight` int32 [K, N / 8], eight outputs
  of one input row per word in AWQ's interleaved order (output 8c + ORDER[j] in bits [4j, 4j + 4)
  of word c, ORDER = 0 2 4 6 1 3 5 7); `qzeros` int32 [K / group, N / 8] packed the same way;
  `scales` float16 [K / group, N]; W[n, k] = scales[k // group, n] * (q[k, n] - zero[k // group, n]).

Both become kernels/qlinear.QuantizedWeight: 4 bits -> int4 with min = -zero * scale (rounded to
float16: exact when the zero is a power of two, as in every symmetric checkpoint; otherwise within
half a float16 ulp of the min); 8 bits -> int8 with q - zero as the int8 value, accepted only where
every q - zero fits in -128..127 (always for `sym: true`), otherwise refused naming the layer.
int4 groups of 32/64/128 stay as they are; a larger group that is a multiple of 128 (64, 32),
per channel included, repeats its scale and min for each 128 (64, 32) weights, which is exact.
Act-order (a `g_idx` that is not k // group_size) is supported by permuting the input rows so that
every group is contiguous: the layer keeps that permutation and gathers its input the same way
(`input_perm`; x[..., perm] @ W[:, perm]^T = x @ W^T).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.kernels import qlinear
from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.config import ConfigError

METHODS = ("gptq", "awq")
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word field j holds output 8c + AWQ_ORDER[j]
# field holding output 8c + p: the inverse of AWQ_ORDER
_AWQ_FIELD_OF = tuple(AWQ_ORDER.index(p) for p in range(8))


@dataclass(frozen=True)
class CheckpointQuantization:
    """A GPTQ or AWQ checkpoint's quantization settings (config.json's `quantization_config`)."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # input weights per scale and zero; -1: one group per output channel
    sym: bool
    desc_act: bool
    checkpoint_format: str  # gptq: "gptq" (v1, zeros stored minus one) | "gptq_v2"; awq: "gemm"
    source: str = "quantization_config"  # where the settings were read, for messages

    @property
    def target(self) -> str:
        """The qlinear method the layers become: int4 or int8."""
        return "int4" if self.bits == 4 else "int8"

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return (
            ("qweight", "qzeros", "scales", "g_idx")
            if self.method == "gptq"
            else ("qweight", "qzeros", "scales")
        )

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = f", {self.checkpoint_format}" if self.method == "gptq" else ""
        sym = ", sym" if self.sym else ", asym"
        return f"{self.method.upper()} {self.bits}-bit, {group}{sym}{extra}"


class UnsupportedQuantization(ConfigError):
    """A checkpoint's quantization the runtime cannot take; the message names the setting (a
    ConfigError: `kvpilot serve` prints it on one line and exits 2)."""


def read_checkpoint_quantization(directory: Path, config: dict[str, Any]) -> CheckpointQuantization | None:
    """The GPTQ/AWQ settings of a Hugging Face directory (None for a 16/32-bit checkpoint).

    Read from config.json's `quantization_config`, else from the files older tools wrote beside it
    (auto-gptq's quantize_config.json, AutoAWQ's quant_config.json)."""
    import json

    qc = config.get("quantization_config")
    source = "config.json quantization_config"
    if qc is None:
        for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            path = directory / name
            if path.is_file():
                qc = {"quant_method": method, **json.loads(path.read_text(encoding="utf-8"))}
                source = name
                break
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantization(f"{source}: expected a JSON object")
    return parse_quantization_config(qc, source)


def parse_quantization_config(
    qc: dict[str, Any], source: str = "quantization_config"
) -> CheckpointQuantization:
    """Check a `quantization_config` and return its settings; refuse what the runtime cannot take."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedQuantization(
            f"{source}: quant_method {qc.get('quant_method')!r} is not supported (supported: {', '.join(METHODS)})"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    allowed_bits = GPTQ_BITS if method == "gptq" else (4,)
    if bits not in allowed_bits:
        raise UnsupportedQuantization(
            f"{source}: bits {bits} is not supported for {method} (supported: {', '.join(map(str, allowed_bits))})"
        )
    if group != -1 and group <= 0:
        raise UnsupportedQuantization(f"{source}: group_size {group} must be positive or -1")
    if bits == 4 and group != -1 and group % 32:
        raise UnsupportedQuantization(
            f"{source}: group_size {group} is not supported for 4 bits (int4 groups are 32, 64 or 128; "
            "a multiple of 32 or -1 is re-expressed with those)"
        )
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise UnsupportedQuantization(
            f"{source}: pack_dtype {qc['pack_dtype']!r} is not supported (supported: int32)"
        )
    if qc.get("lm_head"):
        raise UnsupportedQuantization(f"{source}: lm_head true (a quantized LM head) is not supported")
    if qc.get("dynamic"):
        raise UnsupportedQuantization(f"{source}: dynamic (per-module settings) is not supported")
    not_converted = [
        m for m in qc.get("modules_to_not_convert") or [] if m not in ("lm_head", "embed_tokens")
    ]
    if not_converted:
        raise UnsupportedQuantization(
            f"{source}: modules_to_not_convert {not_converted} is not supported (every linear layer "
            "of the decoder must be quantized)"
        )
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS:
            raise UnsupportedQuantization(
                f"{source}: checkpoint_format {fmt!r} is not supported (supported: {', '.join(GPTQ_FORMATS)})"
            )
        sym = bool(qc.get("sym", True))
        return CheckpointQuantization("gptq", bits, group, sym, bool(qc.get("desc_act", False)), fmt, source)
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version not in AWQ_VERSIONS:
        raise UnsupportedQuantization(
            f"{source}: version {version!r} is not supported for awq (supported: {', '.join(AWQ_VERSIONS)})"
        )
    if not qc.get("zero_point", True):
        raise UnsupportedQuantization(f"{source}: zero_point false is not supported for awq")
    return CheckpointQuantization("awq", bits, group, False, False, version, source)


def check_widths(cq: CheckpointQuantization, widths: dict[str, int]) -> None:
    """Refuse a group size that the model's linear input widths (name -> width) do not divide."""
    for name, width in widths.items():
        if cq.group_size != -1 and width % cq.group_size:
            raise UnsupportedQuantization(
                f"{cq.source}: group_size {cq.group_size}: the model's {name} {width} is not a multiple of it"
            )
        if cq.bits == 4 and width % min(qlinear.INT4_GROUPS):
            raise UnsupportedQuantization(
                f"{cq.source}: {cq.describe()}: the model's {name} {width} is not a multiple of "
                f"{min(qlinear.INT4_GROUPS)}, the smallest int4 group"
            )


# ---------------------------------------------------------------------------------------------
# Unpacking


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> uint8 values, 32 / bits per word laid out along `dim` (field j of word i is
    element i * 32 / bits + j), the GPTQ order."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {words.dtype}")
    per, mask = 32 // bits, (1 << bits) - 1
    fields = [((words >> (bits * j)) & mask).to(torch.uint8) for j in range(per)]
    stacked = torch.stack(fields, dim=dim + 1)  # [..., words along dim, per, ...]
    shape = list(words.shape)
    shape[dim] *= per
    return stacked.reshape(shape)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [R, C] -> uint8 [R, 8 C] in output order (undoing AWQ_ORDER)."""
    fields = unpack_int32(words, 4, dim=1).reshape(words.shape[0], -1, 8)
    return fields[..., list(_AWQ_FIELD_OF)].reshape(words.shape[0], -1)


def gptq_v1_to_v2_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Add one to every packed zero of a v1 checkpoint, as word arithmetic (the writer subtracted
    0x11111111 / 0x01010101 from each int32 word, so this is its exact inverse, borrows included)."""
    one_each = sum(1 << (bits * j) for j in range(32 // bits))
    w = (qzeros.to(torch.int64) & 0xFFFFFFFF) + one_each
    w = w & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _check_layer_shapes(
    layer: str, q_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> None:
    k, n = q_kn.shape
    groups = k // group
    if k % group:
        raise UnsupportedQuantization(
            f"quantization_config group_size {group}: layer {layer} has {k} input features, "
            "not a multiple of the group size"
        )
    if tuple(zeros.shape) != (groups, n) or tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"layer {layer}: qzeros {tuple(zeros.shape)} / scales {tuple(scales.shape)} do not match "
            f"{groups} groups of {n} outputs"
        )


def act_order_permutation(g_idx: torch.Tensor, group: int, layer: str) -> torch.Tensor | None:
    """None when g_idx is k // group (no act-order); else the input permutation that makes every
    group contiguous (stable sort of g_idx), checked to give each group exactly `group` rows."""
    k = g_idx.numel()
    expected = torch.arange(k, dtype=torch.int64) // group
    g = g_idx.to(torch.int64).reshape(-1)
    if torch.equal(g, expected):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], expected):
        raise ValueError(f"layer {layer}: g_idx does not assign {group} input rows to every group")
    return perm


def _largest_int4_group(group: int) -> int | None:
    for g in sorted(qlinear.INT4_GROUPS, reverse=True):
        if group % g == 0:
            return g
    return None


def to_quantized_weight(
    layer: str, q_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int
) -> QuantizedWeight:
    """Unpacked q [K, N] (groups contiguous along K), zeros and scales [K / group, N] ->
    QuantizedWeight for W[n, k] = scale * (q - zero)."""
    _check_layer_shapes(layer, q_kn, zeros, scales, group)
    k, n = q_kn.shape
    s = scales.to(torch.float16).t().contiguous()  # [N, G]
    z = zeros.t().to(torch.int16)  # [N, G]
    q = q_kn.t()  # [N, K] view
    if bits == 8:
        qi = q.to(torch.int16).reshape(n, k // group, group) - z.unsqueeze(-1)
        if int(qi.min()) < -128 or int(qi.max()) > 127:
            raise UnsupportedQuantization(
                f"layer {layer}: its 8-bit GPTQ weights are not exactly representable as int8 "
                "(q - zero outside -128..127; an asymmetric zero point)"
            )
        return QuantizedWeight(8, group, qi.reshape(n, k).to(torch.int8).contiguous(), s, None, n, k)
    g4 = _largest_int4_group(group)
    if g4 is None:
        raise UnsupportedQuantization(
            f"quantization_config group_size {group}: layer {layer}: int4 groups must be a multiple of 32"
        )
    reps = group // g4
    mins = (-z.float() * s.float()).to(torch.float16)
    if reps > 1:
        s, mins = s.repeat_interleave(reps, dim=1), mins.repeat_interleave(reps, dim=1)
    qg = q.contiguous().reshape(n, k // g4, g4)
    half = g4 // 2
    packed = (qg[..., :half] | (qg[..., half:] << 4)).reshape(n, k // 2)
    return QuantizedWeight(4, g4, packed.contiguous(), s.contiguous(), mins.contiguous(), n, k)


def convert_gptq(
    layer: str, tensors: dict[str, torch.Tensor], cq: CheckpointQuantization
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """One GPTQ layer's qweight/qzeros/scales(/g_idx) -> (QuantizedWeight, input permutation or None)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    q = unpack_int32(qweight, cq.bits, dim=0)  # [K, N]
    k, n = q.shape
    group = k if cq.group_size == -1 else cq.group_size
    if k % group:
        raise UnsupportedQuantization(
            f"quantization_config group_size {cq.group_size}: layer {layer} has {k} input features, "
            "not a multiple of the group size"
        )
    if cq.checkpoint_format == "gptq":
        qzeros = gptq_v1_to_v2_zeros(qzeros, cq.bits)
    zeros = unpack_int32(qzeros, cq.bits, dim=1)[:, :n]
    g_idx = tensors.get("g_idx")
    perm = None if g_idx is None else act_order_permutation(g_idx, group, layer)
    if perm is not None:
        q = q.index_select(0, perm)
    return to_quantized_weight(layer, q, zeros, scales, cq.bits, group), perm


def convert_awq(layer: str, tensors: dict[str, torch.Tensor], cq: CheckpointQuantization) -> QuantizedWeight:
    """One AWQ GEMM layer's qweight/qzeros/scales -> QuantizedWeight."""
    q = unpack_awq(tensors["qweight"])  # [K, N]
    k, n = q.shape
    group = k if cq.group_size == -1 else cq.group_size
    if k % group:
        raise UnsupportedQuantization(
            f"quantization_config group_size {cq.group_size}: layer {layer} has {k} input features, "
            "not a multiple of the group size"
        )
    zeros = unpack_awq(tensors["qzeros"])[:, :n]
    return to_quantized_weight(layer, q, zeros, tensors["scales"], 4, group)


def convert_layer(
    layer: str, tensors: dict[str, torch.Tensor], cq: CheckpointQuantization
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    if cq.method == "gptq":
        return convert_gptq(layer, tensors, cq)
    return convert_awq(layer, tensors, cq), None


# ---------------------------------------------------------------------------------------------
# Putting pieces together (fused q/k/v and gate/up) and tensor-parallel shards


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack QuantizedWeights of the same input width and format along the output rows."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group, p.in_features) != (first.bits, first.group, first.in_features):
            raise ValueError("fused layer pieces differ in bits, group or input width")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantizedWeight(
        first.bits,
        first.group,
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
        sum(p.out_features for p in parts),
        first.in_features,
    )


def select_rows(qw: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """The output rows `rows` (int64 indices) of a QuantizedWeight."""
    return QuantizedWeight(
        qw.bits,
        qw.group,
        qw.packed.index_select(0, rows).contiguous(),
        qw.scales.index_select(0, rows).contiguous(),
        None if qw.mins is None else qw.mins.index_select(0, rows).contiguous(),
        int(rows.numel()),
        qw.in_features,
    )


def narrow_columns(qw: QuantizedWeight, start: int, size: int) -> QuantizedWeight | None:
    """Input features start..start+size (a tensor-parallel row shard); None unless both are whole groups."""
    g = qw.group
    if start % g or size % g:
        return None
    per_byte = 2 if qw.bits == 4 else 1
    return QuantizedWeight(
        qw.bits,
        g,
        qw.packed.narrow(1, start // per_byte, size // per_byte).contiguous(),
        qw.scales.narrow(1, start // g, size // g).contiguous(),
        None if qw.mins is None else qw.mins.narrow(1, start // g, size // g).contiguous(),
        qw.out_features,
        size,
    )
