"""Batched multi-adapter LoRA compute: every sequence in a step uses its own adapter.

Each targeted linear layer keeps its adapters in stacked, zero-padded slot buffers, this rank's
shard only: A [slots, subs, max_rank, in] and B [slots, out, subs, max_rank] (with the scaling folded
into B). A fused linear (q/k/v, gate/up) has one sub-block per piece, so B is block-diagonal over
the pieces. A step's tokens are grouped by slot once (`LoRABatch`); every layer then adds
`((x_g A_g^T) B_g^T)` to its base output for each group, with two batched matmuls when the groups are
even (decode) or one pair per group when they are not (a long prefill chunk beside decodes).
Tokens of base-model sequences are in no group and are never touched.

Tensor parallelism shards A and B like the base linear: column-parallel layers keep A whole and
this rank's rows of B (the same rows its weight loader keeps); row-parallel layers keep this rank's
columns of A and all of B, and add their partial product before the base layer's all-reduce (the
sum over ranks of x_r A_r^T B^T is x A^T B^T).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvpilot.runtime.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

# padding is worth it while the padded rows are at most this many times the real ones
MAX_PADDING_RATIO = 2.0


@dataclass
class LoRABatch:
    """One step's tokens grouped by slot; built once per step, read by every LoRA layer."""

    slots: torch.Tensor  # [G] slot of each group
    rank: int  # the largest rank among the groups' adapters: buffers are sliced to it
    # the groups' slots are first..first+G-1: the buffers are read in place, at their full rank
    # (zero padding costs a few flops; gathering the slots would copy every adapter's weights)
    first_slot: int | None = None
    # even groups: one padded [G, M] gather (pad rows repeat a real row and are masked out)
    gather: torch.Tensor | None = None  # [G * M]
    mask: torch.Tensor | None = None  # [G * M, 1]
    group_len: int = 0  # M
    # uneven groups: the rows of each group (a slice when they are consecutive)
    rows: list[slice | torch.Tensor] = field(default_factory=list)


@dataclass
class LoRAContext:
    """Shared by every LoRA layer of a model: the step's batch (None: no adapter in this step)."""

    batch: LoRABatch | None = None


def build_lora_batch(
    token_slots: list[int], slot_ranks: list[int], device: torch.device, dtype: torch.dtype
) -> LoRABatch | None:
    """Pure: per-token slot (-1: base model) -> the step's grouping, or None when no token uses one."""
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            groups.setdefault(slot, []).append(row)
    if not groups:
        return None
    slots = sorted(groups)
    rank = max(slot_ranks[s] for s in slots)
    first = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device=device)
    lens = [len(groups[s]) for s in slots]
    longest, total = max(lens), sum(lens)
    if len(slots) * longest <= MAX_PADDING_RATIO * total:
        gather: list[int] = []
        mask: list[float] = []
        for s in slots:
            rows = groups[s]
            pad = longest - len(rows)
            gather.extend(rows + [rows[0]] * pad)
            mask.extend([1.0] * len(rows) + [0.0] * pad)
        return LoRABatch(
            slot_tensor,
            rank,
            first,
            gather=torch.tensor(gather, dtype=torch.int64, device=device),
            mask=torch.tensor(mask, dtype=dtype, device=device).unsqueeze(-1),
            group_len=longest,
        )
    per_group: list[slice | torch.Tensor] = []
    for s in slots:
        rows = groups[s]
        if rows[-1] - rows[0] + 1 == len(rows):
            per_group.append(slice(rows[0], rows[-1] + 1))
        else:
            per_group.append(torch.tensor(rows, dtype=torch.int64, device=device))
    return LoRABatch(slot_tensor, rank, first, rows=per_group)


@dataclass(frozen=True)
class SubTarget:
    """Where one checkpoint module (q_proj, up_proj, ...) lives inside a (fused) base linear."""

    index: int  # sub-block of the LoRA buffers
    out_offset: int  # first row of this piece in this rank's output
    out_size: int  # rows of this piece on this rank
    src_offset: int  # first row of this rank's piece in the full checkpoint B
    in_offset: int  # first column of this rank's input in the full A (row-parallel)
    in_size: int


class LoRALinear:
    """The slot buffers of one base linear layer and the delta it adds (a plain object, not a module:
    the model's parameters and state dict stay what they were)."""

    def __init__(
        self,
        subs: dict[str, SubTarget],
        in_size: int,
        out_size: int,
        num_slots: int,
        max_rank: int,
        ctx: LoRAContext,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.subs = subs
        self.ctx = ctx
        n = len(subs)
        self.A = torch.zeros(num_slots, n, max_rank, in_size, dtype=dtype, device=device)
        self.B = torch.zeros(num_slots, out_size, n, max_rank, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def set_slot(
        self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Fill `slot` from full (unsharded) host (A, B) per module; modules left out stay zero."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        for module, (a, b) in pieces.items():
            sub = self.subs[module]
            r = a.shape[0]
            a_local = a.narrow(1, sub.in_offset, sub.in_size)
            b_local = b.narrow(0, sub.src_offset, sub.out_size) * scaling
            self.A[slot, sub.index, :r].copy_(a_local)
            self.B[slot, sub.out_offset : sub.out_offset + sub.out_size, sub.index, :r].copy_(b_local)

    def clear_slot(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for x) plus each token's adapter update; y is updated in place."""
        batch = self.ctx.batch
        if batch is None:
            return y
        g = batch.slots.numel()
        n = self.A.shape[1]
        if batch.first_slot is not None:  # views, no copy
            r = self.A.shape[2]
            a = self.A.narrow(0, batch.first_slot, g).reshape(g, n * r, -1)  # [G, n r, in]
            b = self.B.narrow(0, batch.first_slot, g).reshape(g, -1, n * r)  # [G, out, n r]
        else:
            r = batch.rank
            a = self.A.index_select(0, batch.slots)[:, :, :r].reshape(g, n * r, -1)
            b = self.B.index_select(0, batch.slots)[..., :r].reshape(g, -1, n * r)
        if batch.gather is not None:
            assert batch.mask is not None
            xg = x.index_select(0, batch.gather).view(g, batch.group_len, -1)
            delta = torch.bmm(torch.bmm(xg, a.transpose(1, 2)), b.transpose(1, 2))
            y.index_add_(0, batch.gather, delta.view(g * batch.group_len, -1) * batch.mask)
            return y
        for i, rows in enumerate(batch.rows):
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a[i].t()) @ b[i].t()
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a[i].t()) @ b[i].t())
        return y


def lora_subs(base: Any, module: str) -> dict[str, SubTarget]:
    """The sub-targets a base linear offers, with this rank's slices (the weight loaders' rules)."""
    rank = base.tp_rank
    if isinstance(base, QKVParallelLinear):
        q, kv = base.q_size, base.kv_size
        kv_src = (rank // base.kv_replicas) * kv
        full_in = base.input_size
        return {
            "q_proj": SubTarget(0, 0, q, rank * q, 0, full_in),
            "k_proj": SubTarget(1, q, kv, kv_src, 0, full_in),
            "v_proj": SubTarget(2, q + kv, kv, kv_src, 0, full_in),
        }
    if isinstance(base, MergedColumnParallelLinear):
        sizes = [s // base.tp_size for s in base.output_sizes]
        names = (
            ("gate_proj", "up_proj")
            if module == "gate_up_proj"
            else tuple(f"{module}.{i}" for i in range(len(sizes)))
        )
        return {
            name: SubTarget(i, sum(sizes[:i]), size, rank * size, 0, base.input_size)
            for i, (name, size) in enumerate(zip(names, sizes, strict=True))
        }
    if isinstance(base, RowParallelLinear):
        size = base.input_size_per_rank
        return {module: SubTarget(0, 0, base.output_size, 0, rank * size, size)}
    if isinstance(base, ColumnParallelLinear):
        size = base.output_size_per_rank
        return {module: SubTarget(0, 0, size, rank * size, 0, base.input_size)}
    raise TypeError(f"{module}: {type(base).__name__} cannot take a LoRA adapter")


def attach(
    base: Any,
    module: str,
    num_slots: int,
    max_rank: int,
    ctx: LoRAContext,
    device: torch.device,
    dtype: torch.dtype,
) -> LoRALinear:
    """Give `base` its LoRA slot buffers (in the model's activation dtype)."""
    subs = lora_subs(base, module)
    in_size = next(iter(subs.values())).in_size
    out_size = sum(s.out_size for s in subs.values())
    lora = LoRALinear(subs, in_size, out_size, num_slots, max_rank, ctx, device, dtype)
    base.lora = lora
    return lora
