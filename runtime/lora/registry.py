"""The engine's adapter bookkeeping: which adapters are loaded under which served names, the identity each
load gives the sequences that use it, and the rule that an adapter in use is neither replaced nor unloaded.

The weights themselves live in the model runner (manager.py's `LoRAState` and `SlotTable`); this registry
asks it to read or drop them and keeps the engine's view in step. It runs on the engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvpilot.runtime.lora.errors import AdapterPathError, LoRAError
from kvpilot.runtime.lora.names import adapter_name_problem
from kvpilot.runtime.lora.request import LoadedAdapter, LoRARequest, new_request

if TYPE_CHECKING:
    from kvpilot.runtime.lora.manager import LoRAState

log = logging.getLogger(__name__)


class AdapterBackend(Protocol):
    """What the registry needs of the model runner (single-process or tensor-parallel)."""

    lora: LoRAState | None

    def add_lora(self, name: str, path: str) -> int: ...

    def remove_lora(self, name: str) -> None: ...


class AdapterRegistry:
    """Loaded adapters by served name. `users(name)`: how many unfinished requests run with `name`."""

    def __init__(self, backend: AdapterBackend, base_model_name: str, users: Callable[[str], int]) -> None:
        self.backend = backend
        self.base_model_name = base_model_name
        self.users = users
        self.requests: dict[str, LoRARequest] = {}  # the identity of each name's current load
        self.adapters: dict[str, LoadedAdapter] = {}  # what /v1/models lists, in load order

    @property
    def enabled(self) -> bool:
        return self.backend.lora is not None

    def names(self) -> list[str]:
        return list(self.requests)

    def loaded(self) -> list[LoadedAdapter]:
        return list(self.adapters.values())

    def add(self, name: str, path: str) -> LoRARequest:
        """Load a PEFT adapter under `name` (replacing one of that name unless requests use it).
        Raises LoRAError naming the adapter and the problem; nothing changes then."""
        if self.backend.lora is None:
            raise LoRAError(f"LoRA adapter {name!r}: LoRA serving is off (start with --enable-lora)")
        problem = adapter_name_problem(name)
        if problem is not None:
            raise LoRAError(f"LoRA adapter: {problem}")
        if name == self.base_model_name:
            raise LoRAError(f"LoRA adapter {name!r}: the name must differ from the base model's")
        if name in self.requests:
            self._check_unused(name, "replaced")
        rank = self.backend.add_lora(name, path)
        self.requests[name] = new_request(name)
        self.adapters[name] = LoadedAdapter(name, path, rank)
        log.info("LoRA adapter %r loaded from %s (rank %d)", name, path, rank)
        return self.requests[name]

    def remove(self, name: str) -> None:
        """Unload an adapter; raises LoRAError when it is unknown or requests still use it."""
        if name not in self.requests:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        self._check_unused(name, "unloaded")
        self.backend.remove_lora(name)
        del self.requests[name]
        del self.adapters[name]
        log.info("LoRA adapter %r unloaded", name)

    def request(self, name: str | None) -> LoRARequest | None:
        """The loaded adapter called `name` (None: the base model); ValueError when none is."""
        if name is None:
            return None
        if name not in self.requests:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return self.requests[name]

    def apply(self, name: str, path: str | None) -> LoRAError | None:
        """Load (`path`) or unload (None) for an API call: the error to hand back, None when it worked."""
        try:
            if path is None:
                self.remove(name)
            else:
                self.add(name, path)
        except LoRAError as exc:
            return exc
        except Exception as exc:  # e.g. an unreadable file: still the adapter's problem, not the engine's
            # (its text may name server paths: the client gets the one message for unusable paths)
            return AdapterPathError(name, f"{type(exc).__name__}: {exc}")
        return None

    def _check_unused(self, name: str, what: str) -> None:
        users = self.users(name)
        if users:
            raise LoRAError(f"LoRA adapter {name!r} cannot be {what}: {users} unfinished requests use it")
