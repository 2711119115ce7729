"""The request-body rules the router shares with the runtime (kvpilot/request_body.py): the same
answer as a pod's for every malformed body, and importable without torch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from kvpilot.request_body import MAX_JSON_DEPTH, BodyError, parse_json_object
from kvpilot.runtime.serving import request as api_request
from kvpilot.runtime.serving.errors import APIError

BODIES = [
    b"[" * 1000 + b"]" * 1000,
    b'{"a": ' + b"[" * 80 + b"]" * 80 + b"}",
    b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}",  # at the limit: fine
    b"",
    b"   \n",
    b"\xff\xfe{}",
    b'{"n": 1' + b"0" * 5000 + b"}",
    b'{"n": 1e999, "m": -1e999}',
    b'{"p": "\\ud800"}',
    b'{"messages": [{"content": [{"text": "\\udfff"}]}]}',
    b'"text"',
    b"[1, 2]",
    b"null",
    b"{not json",
    b'{"model": "m", "prompt": "hi"}',
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_shared_parser_answers_as_the_runtime_does(raw: bytes) -> None:
    def outcome(parse: object) -> tuple[str, str | None] | dict[str, object]:
        try:
            return parse(raw)  # type: ignore[operator, no-any-return]
        except (APIError, BodyError) as e:
            assert getattr(e, "status", 400) == 400
            return (e.message, e.param)

    assert outcome(parse_json_object) == outcome(api_request.parse_json_body)


def test_the_router_imports_neither_torch_nor_the_runtime() -> None:
    code = (
        "import sys, kvpilot.cli, kvpilot.router.server, kvpilot.router.cli; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kvpilot.runtime')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_one_depth_limit() -> None:
    from kvpilot.runtime.grammar import json_limits

    assert json_limits.MAX_JSON_DEPTH is MAX_JSON_DEPTH == 64  # bodies and schema strings alike


@pytest.fixture
def high_recursion_limit() -> Iterator[None]:
    """What a library may do in the same process (celpy's Environment sets 2500): json.loads then
    parses 1,000 levels without RecursionError."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(2500)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.usefixtures("high_recursion_limit")
@pytest.mark.parametrize("parse", [parse_json_object, api_request.parse_json_body])
def test_a_deep_array_is_refused_for_its_depth_whatever_the_recursion_limit(
    parse: Callable[[bytes], object],
) -> None:
    with pytest.raises((APIError, BodyError), match="nests deeper than 64 levels"):
        parse(b"[" * 1000 + b"]" * 1000)
