"""Property-based fuzzing of the HTTP API on the real SmolLM2 engine with small limits.

Hypothesis draws request bodies (plausible fields with hostile values, random JSON shapes, wrong
types, extreme and non-finite numbers, unicode, refused vLLM fields, non-JSON bytes) and headers
(API keys with arbitrary latin-1 bytes, content types) for both generation endpoints, streaming and
not. Any 5xx (also as an error event inside a stream), a request that does not answer within the
client timeout (a hang), or a KV block or request still held by the engine once the requests have
ended fails the test. Bounded: a fixed number of examples, each generating at most a few dozen
tokens (max_model_len 32).
"""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_engine import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.runtime.serving.refused_fields import REFUSED_FIELDS

pytestmark = pytest.mark.timeout(300)

API_KEY = "fuzz-key"
CLIENT_TIMEOUT_S = 60  # a request that does not answer in this long is a hang

MAX_INT = 2**70


def floats(*args: Any, **kwargs: Any) -> st.SearchStrategy[float]:
    # Subnormals come as fixed values below: the CPU attention extension is built with -ffast-math,
    # which sets flush-to-zero in the process, and hypothesis refuses to draw subnormals then.
    return st.floats(*args, allow_subnormal=False, **kwargs)


numbers = st.one_of(
    st.integers(-3, 8),
    st.integers(-MAX_INT, MAX_INT),
    floats(allow_nan=True, allow_infinity=True),
    floats(-3, 3),
    st.sampled_from([0, 1, -1, 2**63, -(2**63) - 1, 1e-300, 5e-324, 1e308]),
)
texts = st.text(max_size=24)
json_scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


token_ids = st.lists(st.integers(-2, 50_000), min_size=0, max_size=20)
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": texts}), max_size=3
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]),
            "content": st.one_of(texts, texts, content_parts, json_values),
        },
        optional={"name": texts},
    ),
    max_size=3,
)
# Plausible values per field; a hostile body replaces some of them by any JSON value.
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(-1, 0), numbers),
    "temperature": floats(0, 2),
    "top_p": floats(0, 1),
    "top_k": st.integers(-2, 60_000),
    "min_p": floats(0, 1),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0, 3),
    "n": st.integers(-1, 5),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": token_ids,
    "min_tokens": st.integers(-1, 6),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(texts, floats(), max_size=2),
    "cache_salt": texts,
    "user": texts,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "model": st.sampled_from(["smollm2-135m-instruct", "smollm2-135m-instruct", "other"]),
    # refused vLLM fields: their neutral values are accepted, others are refused
    **{name: st.sampled_from(neutral) for name, (_, neutral) in REFUSED_FIELDS.items()},
}
COMPLETIONS: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.integers(-1, 21),
    "echo": st.booleans(),
    "suffix": st.sampled_from([None, "", "x"]),
    "best_of": st.sampled_from([None, 1, 2]),
}
CHAT: dict[str, st.SearchStrategy[Any]] = {
    "max_completion_tokens": st.integers(-1, 4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tools": st.sampled_from([None, []]),
    "tool_choice": st.sampled_from(["none", "auto"]),
    "add_generation_prompt": st.booleans(),
    "echo": st.booleans(),
}


@st.composite
def bodies(draw: st.DrawFn, endpoint: str) -> dict[str, Any]:
    if endpoint == "completions":
        prompt = st.one_of(texts, texts, token_ids, st.lists(texts, max_size=3))
        body: dict[str, Any] = {"prompt": draw(prompt)}
        fields = COMMON | COMPLETIONS
    else:
        body = {"messages": draw(messages)}
        fields = COMMON | CHAT
    body["stream"] = draw(st.booleans())
    # mostly a small max_tokens: without one a request generates what fits in the context
    names = ["max_tokens"] if draw(st.integers(0, 9)) else []
    names += draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True))
    names = list(dict.fromkeys(names))
    hostile = draw(st.booleans())
    for name in names:
        value = fields[name]
        body[name] = draw(st.one_of(value, value, json_values) if hostile else value)
    if hostile:  # unknown keys, and the required field of any shape
        body |= draw(st.dictionaries(st.text(max_size=12), json_values, max_size=2))
        if draw(st.booleans()):
            body["prompt" if endpoint == "completions" else "messages"] = draw(json_values)
    return body


header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=20
)


@st.composite
def http_cases(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "fields", "json", "bytes"]))
    if kind == "fields":
        raw = json.dumps(draw(bodies(endpoint.split("/")[0]))).encode()
    elif kind == "json":
        raw = json.dumps(draw(json_values)).encode()
    else:
        raw = draw(st.binary(max_size=64))
    auth = draw(st.sampled_from(["good", "good", "good", "good", "none", "bad"]))
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "text/plain", "x/y; charset=bad"]))}
    if auth == "good":
        headers["Authorization"] = f"Bearer {API_KEY}"
    elif auth == "bad":
        headers["Authorization"] = draw(header_text)
    return "/v1/" + endpoint, raw, headers


def post(port: int, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value.encode("latin-1"))
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        resp = conn.getresponse()  # raises TimeoutError on a hang
        return resp.status, resp.read()
    finally:
        conn.close()


def check_response(status: int, body: bytes) -> None:
    assert status < 500, body[:500]
    if status != 200:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    if body.startswith(b"data: "):  # a stream: no error event, ends with [DONE]
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, chunk
    else:
        out = json.loads(body)
        assert out["choices"] and out["usage"]["completion_tokens"] >= 0


def metric(live: LiveServer, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert len(values) == 1
    return values[0]


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met (a request or KV block left behind?)"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fuzz_live(make_engine: Callable[..., Any]) -> Iterator[tuple[LiveServer, Any]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    llm = make_engine(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20)
    engine = AsyncEngine(llm, max_queue_len=4)
    engine.start()
    live = LiveServer(engine, api_key=API_KEY, model_name="smollm2-135m-instruct")
    yield live, engine
    live.close()


def test_http_api_fuzz(fuzz_live: tuple[LiveServer, Any]) -> None:
    live, engine = fuzz_live
    seen: dict[int, int] = {}

    @settings(
        max_examples=80,
        deadline=None,  # hangs are caught by the client timeout; the machine's load varies
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,  # the same cases every run: a failure reproduces
        database=None,
    )
    @given(case=http_cases())
    def one_request(case: tuple[str, bytes, dict[str, str]]) -> None:
        path, raw, headers = case
        status, body = post(live.port, path, raw, headers)
        seen[status] = seen.get(status, 0) + 1
        check_response(status, body)

    one_request()
    # the cases reached the engine, not only the validation layer
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 5 and seen.get(401, 0) >= 1, seen
    wait_until(lambda: engine.num_unfinished() == 0)
    bm = engine.engine.block_manager
    wait_until(lambda: bm.num_free_blocks == bm.num_blocks)
    wait_until(lambda: math.isclose(metric(live, "kvpilot_kv_cache_usage_ratio"), 0.0))
    bm.check_invariants()
