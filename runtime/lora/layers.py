"""Batched multi-adapter LoRA compute: every sequence in a step uses its own adapter.

Each targeted linear layer keeps its adapters in stacked, zero-padded slot buffers, this rank's
shard only, stored transposed so that both matmuls read contiguous operands: A^T [slots, in, pieces,
max_rank] and B^T [slots, pieces, max_rank, out] (with the scaling folded into B). A fused linear
(q/k/v, gate/up) has one piece per checkpoint module, so B is block-diagonal over the pieces. A
step's tokens are grouped by slot once (`LoRABatch`); every layer then adds `(x_g A_g^T) B_g^T` to
its base output for each group, with two batched matmuls when the groups are even (decode) or one
pair per group when they are not (a long prefill chunk beside decodes). Tokens of base-model
sequences are in no group and their rows get nothing added.

On the CPU the buffers and the low-rank matmuls are float32 whatever the model dtype: torch's CPU
batched matmul has no fast bf16 path on CPUs without AMX, and these matmuls are small.

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
    # the runner puts base-model rows first and each adapter's rows together: when every group has
    # the same length M and the groups follow each other from row `dense_start` in slot order, the
    # rows are a [G, M] view and need no gather (decode steps)
    dense_start: int | None = None
    # even groups: one padded [G, M] gather (pad rows repeat a real row; their results are dropped)
    gather: torch.Tensor | None = None  # [G * M] token rows
    inverse: torch.Tensor | None = None  # [T] each token's row in the padded layout
    token_mask: torch.Tensor | None = None  # [T, 1] 0 for base-model tokens; None when there are none
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
    start = len(token_slots) - total
    if all(
        groups[s] == list(range(start + i * longest, start + (i + 1) * longest)) for i, s in enumerate(slots)
    ):
        return LoRABatch(slot_tensor, rank, first, dense_start=start, group_len=longest)
    if len(slots) * longest <= MAX_PADDING_RATIO * total:
        gather: list[int] = []
        inverse = [0] * len(token_slots)
        for s in slots:
            rows = groups[s]
            for row in rows:
                inverse[row] = len(gather)
                gather.append(row)
            gather.extend([rows[0]] * (longest - len(rows)))
        token_mask = None
        if total < len(token_slots):
            keep = [0.0 if slot < 0 else 1.0 for slot in token_slots]
            token_mask = torch.tensor(keep, dtype=dtype, device=device).unsqueeze(-1)
        return LoRABatch(
            slot_tensor,
            rank,
            first,
            gather=torch.tensor(gather, dtype=torch.int64, device=device),
            inverse=torch.tensor(inverse, dtype=torch.int64, device=device),
            token_mask=token_mask,
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
        self.At = torch.zeros(num_slots, in_size, n, max_rank, dtype=dtype, device=device)
        self.Bt = torch.zeros(num_slots, n, max_rank, out_size, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.At.numel() * self.At.element_size() + self.Bt.numel() * self.Bt.element_size()

    def set_slot(
        self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Fill `slot` from full (unsharded) host (A, B) per module; modules left out stay zero."""
        self.clear_slot(slot)
        for module, (a, b) in pieces.items():
            sub = self.subs[module]
            r = a.shape[0]
            a_local = a.narrow(1, sub.in_offset, sub.in_size)  # [r, in]
            b_local = b.narrow(0, sub.src_offset, sub.out_size) * scaling  # [out piece, r]
            self.At[slot, :, sub.index, :r].copy_(a_local.t())
            self.Bt[slot, sub.index, :r, sub.out_offset : sub.out_offset + sub.out_size].copy_(b_local.t())

    def clear_slot(self, slot: int) -> None:
        self.At[slot].zero_()
        self.Bt[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for x) plus each token's adapter update; y is updated in place."""
        batch = self.ctx.batch
        if batch is None:
            return y
        g = batch.slots.numel()
        in_size, n, max_rank = self.At.shape[1:]
        out_size = self.Bt.shape[-1]
        if batch.first_slot is not None:  # views, no copy
            r = max_rank
            a = self.At.narrow(0, batch.first_slot, g).reshape(g, in_size, n * r)  # [G, in, n r]
            b = self.Bt.narrow(0, batch.first_slot, g).reshape(g, n * r, out_size)  # [G, n r, out]
        else:
            r = batch.rank
            a = self.At.index_select(0, batch.slots)[..., :r].reshape(g, in_size, n * r)
            b = self.Bt.index_select(0, batch.slots)[:, :, :r].reshape(g, n * r, out_size)
        cdt = a.dtype
        if batch.dense_start is not None:
            start = batch.dense_start
            xg = x[start:].to(cdt).view(g, batch.group_len, in_size)
            y[start:] += torch.bmm(torch.bmm(xg, a), b).view(-1, out_size).to(y.dtype)
            return y
        if batch.gather is not None:
            assert batch.inverse is not None
            xg = x.index_select(0, batch.gather).to(cdt).view(g, batch.group_len, in_size)
            delta = torch.bmm(torch.bmm(xg, a), b).view(g * batch.group_len, out_size)
            delta = delta.index_select(0, batch.inverse)  # back to token order, [T, out]
            if batch.token_mask is not None:
                delta = delta * batch.token_mask
            y += delta.to(y.dtype)
            return y
        for i, rows in enumerate(batch.rows):
            if isinstance(rows, slice):
                y[rows] += ((x[rows].to(cdt) @ a[i]) @ b[i]).to(y.dtype)
            else:
                d = (x.index_select(0, rows).to(cdt) @ a[i]) @ b[i]
                y.index_add_(0, rows, d.to(y.dtype))
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
    """Give `base` its LoRA slot buffers (in the model's dtype; float32 on the CPU)."""
    if device.type == "cpu":
        dtype = torch.float32
    subs = lora_subs(base, module)
    in_size = next(iter(subs.values())).in_size
    out_size = sum(s.out_size for s in subs.values())
    lora = LoRALinear(subs, in_size, out_size, num_slots, max_rank, ctx, device, dtype)
    base.lora = lora
    return lora
