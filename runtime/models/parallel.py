"""Tensor-parallel group helpers.

At world size 1 (no `torch.distributed` process group, or a group of one) every collective here is a
no-op that returns its input, so models written against these helpers run unchanged on one device.
The engine that spawns tensor-parallel workers initializes `torch.distributed` and may hand a
subgroup to `set_tp_group()`; otherwise the default (world) group is the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_EXPERT_PARALLEL = False


def set_expert_parallel(enabled: bool) -> None:
    """`--enable-expert-parallel`: MoE layers built after this place whole experts on the
    tensor-parallel ranks (E / N each) instead of splitting every expert's width N ways."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = enabled


def expert_parallel_enabled() -> bool:
    return _EXPERT_PARALLEL


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Use `group` for tensor parallelism (None: the default group, when one is initialized)."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_world_size() -> int:
    if not _distributed():
        return 1
    return int(dist.get_world_size(_TP_GROUP))


def get_tp_rank() -> int:
    if not _distributed():
        return 0
    return int(dist.get_rank(_TP_GROUP))


def divide(numerator: int, denominator: int) -> int:
    """Exact division, with an error that names both sides when a size does not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place when distributed)."""
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
