"""Weight-only quantization of a loaded model (`--quantization int8|int4|auto`).

Every linear layer (the fused QKV, output, gate/up and down projections of each decoder layer) gets
its weight replaced by a kernels/qlinear.QuantizedWeight: int8 with one scale per output channel,
or int4 with a scale and min per group of `quantization_group_size` (32, 64 or 128) input weights.
The experts of a Mixture-of-Experts layer (runtime/models/moe.FusedMoE) are quantized the same way,
one QuantizedWeight per expert for each of its two stacked weights (`FusedMoE.quantize`).
The embedding and the LM head (tied to the embedding in the small models) stay in the model dtype.
`auto` takes the checkpoint's own quantization: a GGUF file whose linear weights are stored as Q8_0
becomes int8 (group 32) and one with Q4_0/Q4_1 becomes int4 (group 32) — the same values, requantized
from the loaded copy; a 16/32-bit checkpoint stays unquantized. A GPTQ/AWQ directory's linear
layers are loaded quantized as they are read (runtime/quant_formats.py), so nothing is left here.

A layer that cannot take the method (for int4, an input size that is not a multiple of the group)
is refused before anything changes, with an error that names the flag.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from kvpilot.kernels import qlinear
from kvpilot.runtime.models.layers import ColumnParallelLinear, RowParallelLinear
from kvpilot.runtime.models.moe import FusedMoE

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "auto")


@dataclass(frozen=True)
class QuantizationReport:
    method: str
    group_size: int
    layers: int
    bytes_before: int
    bytes_after: int
    expert_layers: int = 0  # Mixture-of-Experts layers whose experts were quantized


def linear_layers(model: nn.Module) -> Iterator[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            yield name, mod


def expert_layers(model: nn.Module) -> Iterator[tuple[str, FusedMoE]]:
    for name, mod in model.named_modules():
        if isinstance(mod, FusedMoE):
            yield name, mod


def check(model: nn.Module, method: str, group_size: int) -> None:
    """Raise ValueError naming --quantization when any linear layer cannot take `method`."""
    for name, mod in linear_layers(model):
        if mod.weight is None:
            raise ValueError(f"--quantization {method}: layer {name} is already quantized")
        reason = qlinear.check_shape(method, int(mod.weight.shape[1]), group_size)
        if reason:
            flag = "--quantization-group-size" if "group size must" in reason else "--quantization"
            raise ValueError(
                f"{flag} {method if flag == '--quantization' else group_size}: layer {name}: {reason}"
            )
    for name, experts in expert_layers(model):
        reason = experts.quantization_problem(method, group_size)
        if reason:
            flag = "--quantization-group-size" if "group size must" in reason else "--quantization"
            raise ValueError(
                f"{flag} {method if flag == '--quantization' else group_size}: experts {name}: {reason}"
            )


def quantize_model(model: nn.Module, method: str, group_size: int = 32) -> QuantizationReport:
    """Replace every linear layer's weight by its quantized form, in place."""
    check(model, method, group_size)
    before = after = count = 0
    for _, mod in linear_layers(model):
        w = mod.weight
        assert w is not None
        before += w.numel() * w.element_size()
        qw = qlinear.quantize(w.data, method, group_size)
        after += qw.nbytes
        mod.qweight = qw
        mod.weight = None  # type: ignore[assignment]  # the 16-bit copy is freed
        count += 1
    moe = 0
    for _, experts in expert_layers(model):
        b, a = experts.quantize(method, group_size)
        before, after, moe = before + b, after + a, moe + 1
    report = QuantizationReport(method, group_size if method == "int4" else 0, count, before, after, moe)
    log.info(
        "quantized %d linear layers and %d expert layers to %s%s: %.1f MiB -> %.1f MiB",
        count,
        moe,
        method,
        f" (group {group_size})" if method == "int4" else " (per channel)",
        before / 2**20,
        after / 2**20,
    )
    return report


def auto_method(gguf_linear_types: set[str]) -> str | None:
    """`auto`: the method matching a GGUF file's linear-weight storage types (None: leave as is)."""
    if not gguf_linear_types:
        return None
    if gguf_linear_types <= {"Q4_0", "Q4_1", "Q4_K"}:
        return "int4"
    if gguf_linear_types <= {"Q8_0"}:
        return "int8"
    return None
