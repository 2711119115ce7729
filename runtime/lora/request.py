"""What a sequence carries to say which adapter it runs with (kept free of torch and the model)."""

from __future__ import annotations

import hashlib
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


def path_digest(path: str) -> str:
    """Pure: the SHA-256 (hex) of an adapter's path as it was loaded. `/v1/models` shows this instead
    of the path, so a caller that knows the path (the operator) can tell which folder an adapter came
    from while nobody learns server paths from it."""
    return hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class LoadedAdapter:
    """A loaded adapter: `/v1/models` shows its name, rank and `path_digest(path)`, never the path."""

    name: str
    path: str
    rank: int
