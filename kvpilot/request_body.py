"""The OpenAI API's request-body rules that the router and the runtime share, torch-free.

`parse_json_object(raw)` turns a request body into a dict or raises `BodyError` (always an HTTP 400):
not UTF-8, empty, not JSON, an integer literal past Python's digit limit, not an object, nested
deeper than `MAX_JSON_DEPTH`, or a string holding a lone surrogate ("\\ud800" decodes to a string
that is not valid Unicode). The checks and messages are the runtime's (runtime/serving/request.py
`parse_json_body`), so a client gets the same answer from the router as from a pod. `error_body` is the
OpenAI error body, {"error": {"message", "type", "param", "code"}}.

Nothing here imports aiohttp, pydantic or torch: `kvpilot router` imports it at startup.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # the deepest legitimate body (chat content parts) nests 4 levels


class BodyError(ValueError):
    """A request body the API refuses with 400; `param` names the top-level field it is about."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8 (byte offset {e.start})") from None
    if not text.strip():
        raise BodyError("request body is empty; expected a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:  # the C decoder's own depth guard (about 1,000 levels)
        raise BodyError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # an integer literal beyond Python's int_max_str_digits
        raise BodyError(f"request body is not acceptable JSON: {str(e).split(';')[0]}") from None
    check_values(data)  # first: whether the parser itself recursed too deep depends on the caller's stack
    if not isinstance(data, dict):
        raise BodyError("request body must be a JSON object")
    return data


def check_values(body: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates. Iterative, so a
    deep body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BodyError(
                    f"{path or 'body'} contains an invalid Unicode escape (lone surrogate)",
                    param=path or None,
                ) from None
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BodyError(f"request body nests deeper than {MAX_JSON_DEPTH} levels", param=_top(path))
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in value.items())
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _top(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None
