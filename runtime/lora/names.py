"""Adapter names: the CRD's rule (`kvpilot.api.models.ADAPTER_NAME_PATTERN`), the one definition for
spec.adapters, `--lora-modules NAME=PATH` (a config file's `lora_modules`) and
POST /v1/load_lora_adapter. A name is what clients send as `model`."""

from __future__ import annotations

import re

from kvpilot.api.models import ADAPTER_NAME_PATTERN, ADAPTER_NAME_RULE

_NAME = re.compile(ADAPTER_NAME_PATTERN)
_SHOWN = 80  # characters of a refused name quoted back


def adapter_name_problem(name: str) -> str | None:
    """Pure: why `name` cannot name an adapter, or None when it can."""
    if _NAME.fullmatch(name) is not None:
        return None
    shown = name if len(name) <= _SHOWN else name[:_SHOWN] + "..."
    return f"adapter name {shown!r} must be {ADAPTER_NAME_RULE}"
