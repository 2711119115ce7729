"""Loading a GPTQ/AWQ checkpoint's tensors into a model built without 16-bit linear weights.

The checkpoint's tensor stream is split: the packed tensors of each linear layer
(`<module>.qweight`, `.qzeros`, `.scales`, `.g_idx`) are gathered per checkpoint module and converted
(runtime/load/quant_formats.py) as soon as that module is complete; everything else (embeddings, norms,
biases) goes to the model's own `load_weights`. The pieces of a fused layer (q/k/v -> qkv_proj,
gate/up -> gate_up_proj) are stacked once all have arrived, and this rank's tensor-parallel shard is
taken with the layer's own weight_loader, run on a tensor of row (or column) indices: the loader
places the indices exactly where it would place the rows of a 16-bit weight, so the quantized rows
are picked the same way without the sharding rules being written twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.load import quant_formats
from kvpilot.runtime.load.quant_formats import CheckpointQuantization, UnsupportedQuantization
from kvpilot.runtime.models.base import CausalLM
from kvpilot.runtime.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

log = logging.getLogger(__name__)

Linear = ColumnParallelLinear | RowParallelLinear


@dataclass
class QuantizedLoadReport:
    layers: int = 0  # fused linear layers given a QuantizedWeight
    act_order_layers: int = 0  # of which with an input permutation (GPTQ desc_act)
    bytes: int = 0  # quantized weight bytes on this rank


@dataclass
class _Pending:
    pieces: dict[object, tuple[QuantizedWeight, torch.Tensor | None]] = field(default_factory=dict)


def linear_modules(model: nn.Module) -> dict[str, Linear]:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }


def drop_linear_weights(model: nn.Module) -> None:
    """Remove every linear layer's (meta or 16-bit) weight: the checkpoint's quantized ones replace them."""
    for mod in linear_modules(model).values():
        mod.weight = None  # type: ignore[assignment]


def _expected_pieces(mod: Linear) -> list[object]:
    if isinstance(mod, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(mod, MergedColumnParallelLinear):
        return list(range(len(mod.output_sizes)))
    return [None]


def _shard_rows(mod: ColumnParallelLinear, pieces: list[tuple[object, QuantizedWeight]]) -> torch.Tensor:
    """Rows of the stacked full pieces that this rank's fused weight holds, in its order."""
    index = torch.full((mod.output_size_per_rank, 1), -1.0, dtype=torch.float64)
    offset = 0
    for shard_id, qw in pieces:
        rows = torch.arange(offset, offset + qw.out_features, dtype=torch.float64).unsqueeze(1)
        mod.weight_loader(index, rows, shard_id)  # type: ignore[arg-type]
        offset += qw.out_features
    if bool((index < 0).any()):
        raise ValueError("fused quantized layer: some output rows were not placed")
    return index[:, 0].to(torch.int64)


def _shard_columns(mod: RowParallelLinear, in_features: int) -> tuple[int, int]:
    index = torch.full((1, mod.input_size_per_rank), -1.0, dtype=torch.float64)
    mod.weight_loader(index, torch.arange(in_features, dtype=torch.float64).unsqueeze(0))  # type: ignore[arg-type]
    cols = index[0].to(torch.int64)
    return int(cols[0]), int(cols.numel())


def assemble(
    name: str, mod: Linear, pieces: dict[object, tuple[QuantizedWeight, torch.Tensor | None]]
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """This rank's QuantizedWeight (and input permutation) for a layer from its converted pieces."""
    order = _expected_pieces(mod)
    perms = [pieces[s][1] for s in order]
    perm = perms[0]
    for other in perms[1:]:
        same = (perm is None and other is None) or (
            perm is not None and other is not None and torch.equal(perm, other)
        )
        if not same:
            raise UnsupportedQuantization(
                f"desc_act: the pieces of fused layer {name} have different act-order permutations"
            )
    if isinstance(mod, RowParallelLinear):
        qw = pieces[None][0]
        if mod.tp_size == 1:
            return qw, perm
        if perm is not None:
            raise UnsupportedQuantization(
                f"desc_act with --tensor-parallel-size {mod.tp_size}: layer {name} has an act-order "
                "permutation of its input features, which a row-parallel shard cannot gather"
            )
        start, size = _shard_columns(mod, qw.in_features)
        shard = quant_formats.narrow_columns(qw, start, size)
        if shard is None:
            raise UnsupportedQuantization(
                f"--tensor-parallel-size {mod.tp_size}: layer {name}'s input features per rank ({size}) "
                f"are not a multiple of the quantization group ({qw.group})"
            )
        return shard, None
    full = quant_formats.concat_rows([pieces[s][0] for s in order])
    rows = _shard_rows(mod, [(s, pieces[s][0]) for s in order])
    if torch.equal(rows, torch.arange(full.out_features)):
        return full, perm
    return quant_formats.select_rows(full, rows), perm


def load_quantized(
    model: CausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    cq: CheckpointQuantization,
    device: torch.device,
) -> QuantizedLoadReport:
    """Load a GPTQ/AWQ checkpoint's tensors into `model` (its linear weights dropped beforehand)."""
    modules = linear_modules(model)
    # checkpoint name -> (our parameter name, shard id): every model here defines it (llama.py)
    map_name = cast(Callable[[str], tuple[str, object]], model.map_name)
    suffixes = cq.tensor_suffixes
    required = [s for s in suffixes if s != "g_idx"]
    collected: dict[str, dict[str, torch.Tensor]] = {}
    pending: dict[str, _Pending] = {}
    report = QuantizedLoadReport()

    def target_of(ckpt_module: str) -> tuple[str, object]:
        target, shard_id = map_name(f"{ckpt_module}.weight")
        return target.removesuffix(".weight"), shard_id

    def finish(ckpt_module: str) -> None:
        tensors = collected.pop(ckpt_module)
        target, shard_id = target_of(ckpt_module)
        mod = modules.get(target)
        if mod is None:
            raise ValueError(f"unexpected quantized checkpoint module {ckpt_module} (no such linear layer)")
        qw, perm = quant_formats.convert_layer(ckpt_module, tensors, cq)
        entry = pending.setdefault(target, _Pending())
        entry.pieces[shard_id] = (qw, perm)
        if all(s in entry.pieces for s in _expected_pieces(mod)):
            shard, shard_perm = assemble(target, mod, pending.pop(target).pieces)
            mod.qweight = shard.to(device)
            mod.input_perm = None if shard_perm is None else shard_perm.to(device)
            report.layers += 1
            report.act_order_layers += shard_perm is not None
            report.bytes += shard.nbytes

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module, _, suffix = name.rpartition(".")
            if suffix in suffixes:
                parts = collected.setdefault(module, {})
                parts[suffix] = tensor
                if all(s in parts for s in suffixes):
                    finish(module)
                continue
            if (
                suffix == "bias"
                and (mod := modules.get(target_of(module)[0])) is not None
                and mod.bias is None
            ):
                if bool((tensor == 0).all()):
                    continue  # GPTQ-for-LLaMa and early auto-gptq saved an all-zero bias for every layer
                raise ValueError(f"{name}: a non-zero bias for a layer that has none in this architecture")
            if suffix == "weight" and target_of(module)[0] in modules:
                raise UnsupportedQuantization(
                    f"{cq.source}: layer {module} is stored unquantized in this {cq.method.upper()} checkpoint "
                    "(a partly quantized checkpoint is not supported)"
                )
            yield name, tensor

    model.load_weights(others())
    for module in list(collected):
        missing = [s for s in required if s not in collected[module]]
        if missing:
            raise ValueError(f"quantized layer {module}: {', '.join(missing)} missing from the checkpoint")
        finish(module)  # a GPTQ layer without g_idx: groups in input order
    unset = sorted(set(modules) - {n for n, m in modules.items() if m.qweight is not None})
    if unset:
        raise ValueError(f"linear layers missing from the quantized checkpoint: {unset[:8]}")
    log.info(
        "%s: %d linear layers loaded quantized (%d with act-order input permutations): %.1f MiB",
        cq.describe(),
        report.layers,
        report.act_order_layers,
        report.bytes / 2**20,
    )
    return report
