"""Weight-only quantization of a loaded model (`--quantization int8|int4|auto`).

Every linear layer (the fused QKV, output, gate/up and down projections of each decoder layer) gets
its weight replaced by a kernels/qlinear.QuantizedWeight: int8 with one scale per output channel,
or int4 with a scale and min per group of `quantization_group_size` (32, 64 or 128) input weights.
The experts of a Mixture-of-Experts layer (runtime/models/moe.FusedMoE) are quantized the same way,
one QuantizedWeight per expert for each of its two stacked weights (`FusedMoE.quantize`).

The LM head is quantized too (`quantize_lm_head`): int8 with one scale per 32 weights (Q8_0's
format; one scale per vocabulary row cost 2.1% of the largest logit on SmolLM2, group 32 is exact
there and takes 6% more bytes), or, from a GGUF file, its own blocks (the builtin SmolLM2 stores
it as Q8_0). When the
embedding is tied to it, the embedding shares that QuantizedWeight and a lookup dequantizes only
the rows it reads; an untied embedding stays in the model dtype.

GGUF files: a layer whose tensors are all stored as Q8_0, Q4_0, Q4_1 or Q4_K (one bit width) is
loaded from the file's blocks straight into its QuantizedWeight (`prepare_blocks` before loading,
runtime/load/gguf_blocks.py converts, `finish_blocks` after): no 16-bit copy of it ever exists. That
takes `auto`, `int4` at group 32 for the 4-bit types and `int8` for Q8_0. The other layers
(another storage type, or a method or group the blocks are not) are dequantized at load as
before, then quantized with the method; `auto` takes for them the method matching the file's
linear storage when it is all Q8_0 or all 4-bit (for example a Mixture-of-Experts file's experts),
else leaves them in the model dtype, and says in the log which layers went which way.
A GPTQ/AWQ directory's linear layers are loaded quantized as they are read (runtime/load/quant_formats.py).

A layer that cannot take the method (for int4, an input size that is not a multiple of the group)
is refused before anything changes with a ConfigError (`kvpilot serve` prints it on one line and
exits 2) that names the flag and the group sizes that fit every layer of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn

from kvpilot.kernels import qlinear
from kvpilot.runtime.config import ConfigError
from kvpilot.runtime.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    blocks_param,
    empty_qweight,
)
from kvpilot.runtime.models.moe import FusedMoE

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "auto")
HEAD_GROUP = 32  # int8 weights per scale in a quantized LM head


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


def fitting_int4_groups(widths: Iterable[int]) -> list[int]:
    """The int4 group sizes that divide every one of these input widths."""
    widths = list(widths)
    return [g for g in qlinear.INT4_GROUPS if all(w % g == 0 for w in widths)]


def _refusal(method: str, group_size: int, where: str, reason: str, widths: list[int]) -> ConfigError:
    """The configuration error for a layer that cannot take `method`: names the flag and what fits."""
    if "group size must" in reason:
        return ConfigError(f"--quantization-group-size {group_size}: {where}: {reason}")
    fits = fitting_int4_groups(widths)
    hint = (
        f"--quantization-group-size {' or '.join(map(str, fits))} fits every layer of this model"
        if fits
        else f"no int4 group size ({', '.join(map(str, qlinear.INT4_GROUPS))}) divides every layer's "
        "input width; --quantization int8 (per output channel) takes any width"
    )
    return ConfigError(f"--quantization {method}: {where}: {reason}; {hint}")


def check(model: nn.Module, method: str, group_size: int, *, skip_quantized: bool = False) -> None:
    """Raise ConfigError naming --quantization (or --quantization-group-size) and the group sizes
    that would fit when any layer's input width cannot take `method`; ValueError for a call that no
    flag can make (an unknown method, a layer already quantized)."""
    if method not in qlinear.METHODS:
        raise ValueError(f"unknown quantization {method!r} (expected {', '.join(qlinear.METHODS)})")
    layers = [
        (name, mod) for name, mod in linear_layers(model) if not (skip_quantized and mod.qweight is not None)
    ]
    for name, mod in layers:
        if mod.weight is None:
            raise ValueError(f"--quantization {method}: layer {name} is already quantized")
    experts = list(expert_layers(model))
    for name, moe in experts:
        if moe.q13 is not None:
            raise ValueError(f"--quantization {method}: experts {name}: already quantized")
    widths = [int(mod.weight.shape[1]) for _, mod in layers]
    widths += [w for _, moe in experts for w in (moe.hidden_size, moe.intermediate_per_rank)]
    for name, mod in layers:
        reason = qlinear.check_shape(method, int(mod.weight.shape[1]), group_size)
        if reason:
            raise _refusal(method, group_size, f"layer {name}", reason, widths)
    for name, moe in experts:
        reason = moe.quantization_problem(method, group_size)
        if reason:
            raise _refusal(method, group_size, f"experts {name}", reason, widths)


def quantize_model(
    model: nn.Module, method: str, group_size: int = 32, *, skip_quantized: bool = False
) -> QuantizationReport:
    """Replace every linear layer's weight by its quantized form, in place (with `skip_quantized`,
    the layers that already hold a QuantizedWeight, loaded from a file's blocks, are left alone)."""
    check(model, method, group_size, skip_quantized=skip_quantized)
    before = after = count = 0
    for _, mod in linear_layers(model):
        if skip_quantized and mod.qweight is not None:
            continue
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


# ---------------------------------------------------------------------------------------------
# Weights loaded from a checkpoint's own quantized blocks, and the LM head


QuantizableModule = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding


def blocks_fit(mod: nn.Module, bits: int, group: int) -> bool:
    """Whether this rank's shard of `mod` can hold blocks of `group` weights along its input."""
    if isinstance(mod, RowParallelLinear):
        return mod.input_size_per_rank % group == 0
    if isinstance(mod, ColumnParallelLinear):
        return mod.input_size % group == 0
    if isinstance(mod, VocabParallelEmbedding):
        return mod.weight is not None and int(mod.weight.shape[1]) % group == 0
    return False


def prepare_blocks(model: nn.Module, plan: dict[str, tuple[int, int]]) -> None:
    """Give each module in `plan` (name -> bits, group) an empty QuantizedWeight of its shard's shape
    and a memory-less stand-in for its weight, so its weight loader copies blocks into it. A module
    tied to one in the plan (the LM head to the embedding) shares both."""
    modules = dict(model.named_modules())
    for name, (bits, group) in plan.items():
        mod = modules[name]
        weight = mod.weight
        assert isinstance(weight, nn.Parameter) and weight.device.type != "meta"
        rows, cols = int(weight.shape[0]), int(weight.shape[1])
        qweight = empty_qweight(bits, group, rows, cols, weight.device)
        stand_in = blocks_param(weight)
        for other in modules.values():
            if getattr(other, "weight", None) is weight and hasattr(other, "qweight"):
                other.weight = stand_in
                other.qweight = qweight
        del weight  # the uninitialized 16-bit storage goes with the last reference


def finish_blocks(model: nn.Module) -> int:
    """Drop the stand-ins once the blocks are loaded; returns how many modules hold blocks."""
    count = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, nn.Parameter) and w.device.type == "meta":
            setattr(mod, "weight", None)  # noqa: B010 - any module kind; the blocks are its weight now
            count += 1
    return count


def quantize_lm_head(model: nn.Module) -> tuple[int, int] | None:
    """int8, group 32 (per vocabulary row when the hidden size is not a multiple of 32), for an LM
    head still in the model dtype (the tied embedding shares it); returns (bytes before, after), or
    None when the head already holds a QuantizedWeight."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    if not heads:
        raise ValueError(f"--quantization: {type(model).__name__} has no LM head to quantize")
    done = None
    for head in heads:
        if head.qweight is not None:
            continue
        weight = head.weight
        assert weight is not None
        hidden = int(weight.shape[1])
        qw = qlinear.quantize_int8(weight.data, HEAD_GROUP if hidden % HEAD_GROUP == 0 else None)
        for other in model.modules():
            if isinstance(other, VocabParallelEmbedding) and other.weight is weight:
                other.qweight = qw
                other.weight = None  # type: ignore[assignment]
        done = (weight.numel() * weight.element_size(), qw.nbytes)
    if done:
        log.info(
            "LM head quantized to int8: %.1f MiB -> %.1f MiB",
            done[0] / 2**20,
            done[1] / 2**20,
        )
    return done


def tile_for_cpu(model: nn.Module) -> int:
    """Put every quantized linear layer and LM head the CPU kernel takes tiled into its tiled layout
    (kernels/qlinear.tile: the same bytes permuted, so one vector of codes spans 16 output rows), in
    place; a weight shared by several modules (the tied embedding and LM head) is tiled once. Returns
    how many weights were tiled. A Mixture-of-Experts layer's quantized experts are tiled together
    (kvpilot_qmoe reads either layout, one per call)."""
    done: dict[int, qlinear.QuantizedWeight] = {}
    for mod in model.modules():
        if not isinstance(mod, QuantizableModule):
            continue
        qw = mod.qweight
        if qw is None or not qlinear.tile_applies(qw):
            continue
        if id(qw) not in done:
            done[id(qw)] = qlinear.tile(qw)
        mod.qweight = done[id(qw)]
    experts = 0
    for _, moe in expert_layers(model):  # a layer's experts all tiled, or none (one fused call)
        q13, q2 = moe.q13, moe.q2
        if q13 is not None and q2 is not None and all(qlinear.tile_applies(q) for q in q13 + q2):
            moe.q13, moe.q2 = [qlinear.tile(q) for q in q13], [qlinear.tile(q) for q in q2]
            experts += len(q13) + len(q2)
    if done or experts:
        log.info("%d quantized weights in the CPU kernel's tiled layout", len(done) + experts)
    return len(done) + experts
