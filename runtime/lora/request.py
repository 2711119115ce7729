"""What a sequence carries to say which adapter it runs with (kept free of torch and the model)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

_adapter_ids = itertools.count(1)


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a sequence runs with. `key` is unique per load (a reload under the same name gets a
    new one), so prefix-cache blocks never outlive the weights that computed them."""

    name: str
    adapter_id: int

    @property
    def key(self) -> str:
        return f"{self.name}#{self.adapter_id}"


def new_request(name: str) -> LoRARequest:
    """A fresh identity for an adapter that was just loaded under `name`."""
    return LoRARequest(name, next(_adapter_ids))


@dataclass(frozen=True)
class LoadedAdapter:
    """What `/v1/models` says about a loaded adapter."""

    name: str
    path: str
    rank: int
