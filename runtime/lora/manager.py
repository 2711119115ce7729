"""Which adapters a model can run, and which of them sit in its `--max-loras` device slots.

- `LoRAState` (one per tensor-parallel rank): the LoRA buffers attached to the model's linears, the
  host copies of every loaded adapter (full weights; a slot load keeps this rank's shard), and the
  step's token grouping.
- `SlotTable` (rank 0 only): least-recently-used assignment of adapters to slots. An adapter that
  loses its slot stays in host memory and is copied back when a step needs it again.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.lora.adapter import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    LoRAAdapter,
    LoRAError,
    load_adapter,
)
from kvpilot.runtime.lora.layers import LoRAContext, LoRALinear, attach, build_lora_batch
from kvpilot.runtime.models import ModelArchConfig

# base linear attribute -> the checkpoint modules it holds
_FUSED = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


class LoRAState:
    """The LoRA side of one rank's model."""

    def __init__(
        self,
        model: Any,
        arch: ModelArchConfig,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.ctx = LoRAContext()
        self.layers: dict[tuple[int, str], LoRALinear] = {}  # (layer, fused attribute) -> buffers
        self.module_owner: dict[str, str] = {}  # checkpoint module -> fused attribute
        for i, layer in enumerate(model.model.layers):
            for fused, (parent, modules) in _FUSED.items():
                base = getattr(getattr(layer, parent, None), fused, None)
                if base is None or not hasattr(base, "lora"):
                    continue  # e.g. a Mixture-of-Experts block has no dense gate/up/down
                self.layers[(i, fused)] = attach(base, fused, num_slots, max_rank, self.ctx, device, dtype)
                for m in modules:
                    self.module_owner[m] = fused
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_ranks = [0] * num_slots
        self.slot_names: list[str | None] = [None] * num_slots

    @property
    def supported_targets(self) -> list[str]:
        return [m for m in (*ATTENTION_TARGETS, *MLP_TARGETS) if m in self.module_owner]

    @property
    def num_bytes(self) -> int:
        return sum(lin.num_bytes for lin in self.layers.values())

    def check(self, adapter: LoRAAdapter) -> None:
        """Refuse targets this model has no LoRA buffers for (the MLP of a Mixture-of-Experts model)."""
        missing = sorted(set(adapter.target_modules) - set(self.module_owner))
        if missing:
            raise LoRAError(
                f"LoRA adapter {adapter.name!r}: this model has no {', '.join(missing)} to adapt "
                f"(supported here: {', '.join(self.supported_targets)})"
            )

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load and check an adapter for this model (not yet added); raises LoRAError."""
        adapter = load_adapter(name, path, self.arch, self.max_rank)
        self.check(adapter)
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        self.check(adapter)
        self.adapters[adapter.name] = adapter
        for slot, name in enumerate(self.slot_names):
            if name == adapter.name:  # a reload: the slot must not keep the old weights
                self.load_slot(slot, None)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.load_slot(slot, None)

    def load_slot(self, slot: int, name: str | None) -> None:
        """Copy adapter `name` (None: nothing) from host memory into `slot` of every layer."""
        if name is None:
            for lin in self.layers.values():
                lin.clear_slot(slot)
            self.slot_ranks[slot], self.slot_names[slot] = 0, None
            return
        adapter = self.adapters[name]
        pieces: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), ab in adapter.weights.items():
            pieces.setdefault((layer, self.module_owner[module]), {})[module] = ab
        for key, lin in self.layers.items():
            if key in pieces:
                lin.set_slot(slot, pieces[key], adapter.scaling)
            else:
                lin.clear_slot(slot)
        self.slot_ranks[slot], self.slot_names[slot] = adapter.rank, name

    def clear(self) -> None:
        """After a forward: no step's grouping may leak into another runner's use of the model."""
        self.ctx.batch = None

    def apply(self, loads: list[tuple[int, str | None]], token_slots: list[int] | None) -> None:
        """Before a forward: bring the step's adapters into their slots, then group its tokens."""
        for slot, name in loads:
            self.load_slot(slot, name)
        if not token_slots:
            self.ctx.batch = None
            return
        dtype = torch.float32 if self.device.type == "cpu" else self.dtype  # the buffers' (layers.attach)
        self.ctx.batch = build_lora_batch(token_slots, self.slot_ranks, self.device, dtype)


class SlotTable:
    """Rank 0's least-recently-used assignment of adapters to device slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.evictions = 0

    def plan(self, needed: list[str]) -> tuple[dict[str, int], list[tuple[int, str | None]]]:
        """Slots for this step's adapters (at most num_slots distinct, the scheduler's promise), and
        the loads that bring the missing ones in over the least recently used others."""
        wanted = list(dict.fromkeys(needed))
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"{len(wanted)} adapters in one step, but --max-loras is {self.num_slots}")
        loads: list[tuple[int, str | None]] = []
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            free = sorted(set(range(self.num_slots)) - set(self.resident.values()))
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.resident if n not in wanted)
                slot = self.resident.pop(victim)
                self.evictions += 1
            self.resident[name] = slot
            loads.append((slot, name))
        return {n: self.resident[n] for n in wanted}, loads

    def drop(self, name: str) -> None:
        self.resident.pop(name, None)
