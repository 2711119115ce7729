"""The nesting limit on client JSON, in one place: request bodies (api_request.py) and JSON given
inside them as text (a `guided_json` schema string) are held to the same `MAX_JSON_DEPTH`.

Python's json parser recurses once per level and raises RecursionError near 1,000 levels; the
checks here are iterative, so a value nested deeper than the limit is refused without touching the
interpreter's stack.
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.request_body import MAX_JSON_DEPTH  # one limit for bodies, here and in the router

__all__ = ["MAX_JSON_DEPTH", "JSONDepthError", "deeper_than", "loads_limited"]


class JSONDepthError(ValueError):
    """A JSON value nests deeper than `MAX_JSON_DEPTH`; `path` is where it first does."""

    def __init__(self, path: str = "") -> None:
        super().__init__(f"nests deeper than {MAX_JSON_DEPTH} levels")
        self.path = path


def deeper_than(value: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The path ('a.b[2]') of the first object or array nested deeper than `limit` levels (the
    value itself is level 1), or None. Iterative."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > limit:
            return path
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in item.items())
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item))
    return None


def loads_limited(text: str) -> Any:
    """json.loads with the nesting limit: raises JSONDepthError for a value nested deeper than
    MAX_JSON_DEPTH (also where the parser itself would overflow its recursion limit) and
    json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONDepthError() from None
    where = deeper_than(value)
    if where is not None:
        raise JSONDepthError(where)
    return value
