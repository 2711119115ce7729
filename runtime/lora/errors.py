"""The errors an adapter load raises (kept free of torch: the HTTP server imports them).

`LoRAError`: an adapter that cannot be served on this base model; the message names the adapter and
the problem, and clients see it as it is. `AdapterPathError`: the path names no usable adapter folder
(missing, not a folder, a file missing, unreadable or not JSON). Its message names the path and the
reason, for the server's log and `kvpilot serve`'s exit; a client gets `client_message`, the same
for every such path, so the load endpoint tells nobody which server paths exist.
"""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served on this base model; the message names the adapter."""

    @property
    def client_message(self) -> str:
        """What an API client is told."""
        return str(self)


class AdapterPathError(LoRAError):
    """`lora_path` names no usable PEFT adapter folder; the detail stays on the server."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"LoRA adapter {name!r}: {detail}")
        self.adapter_name = name

    @property
    def client_message(self) -> str:
        return unusable_path_message(self.adapter_name)


def unusable_path_message(name: str) -> str:
    """Pure: the one answer for every path an adapter cannot be loaded from."""
    return (
        f"LoRA adapter {name!r}: cannot load a PEFT adapter from this lora_path (it must be a folder on "
        "the server holding adapter_config.json and adapter_model.safetensors); the server's log has "
        "the reason"
    )
