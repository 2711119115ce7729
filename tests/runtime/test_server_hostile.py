"""The HTTP server under hostile input: every bad request is a 4xx with an OpenAI error body and at
most one log line, never a 500, a traceback, a stalled event loop or a request that can never run.

HTTP mechanics run against the fake engine (tests/runtime/fake_engine.py); what depends on the
engine (KV pool size, streaming usage, sampling values) runs on the real SmolLM2 engine."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine, FakeTokenizer, LiveServer

from kvpilot.runtime.serving.server import INLINE_BODY_BYTES, body_limit

pytestmark = pytest.mark.timeout(120)


def http(
    url: str, method: str, path: str, body: bytes | None = None, timeout: float = 30
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url + path, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw_http(port: int, data: bytes, more: list[bytes] | None = None) -> tuple[int, dict[str, Any]]:
    """Send raw bytes (then `more` chunks, stopping early if the connection breaks), read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        for part in more or []:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):  # the server answered and closed early
                break
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        length = 0
        while (line := f.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, json.loads(f.read(length))


def assert_openai_error(body: dict[str, Any], status: int) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert 400 <= status < 500 and body["error"]["message"]


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None or r.levelno >= logging.ERROR]


@pytest.fixture
def live() -> Iterator[LiveServer]:
    server = LiveServer(FakeEngine())
    yield server
    server.close()


# -- HTTP 500s that were the client's fault -------------------------------------------------------


def test_non_utf8_authorization_is_401_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    live = LiveServer(FakeEngine(), api_key="sekret")
    try:
        caplog.set_level(logging.INFO)
        for token in (b"\xff\xfe", b"sekr\xc3\x28t", b"sekret\x80"):
            status, body = raw_http(
                live.port,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
            )
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert tracebacks(caplog) == []
    finally:
        live.close()


def test_deep_json_and_huge_integers_are_400(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    deep = b'{"prompt": "x", "user": ' + b"[" * 1_000 + b"]" * 1_000 + b"}"
    digits = b'{"prompt": "x", "max_tokens": ' + b"7" * 5_000 + b"}"
    nan = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    for path, raw, param in [
        ("/v1/completions", deep, None),
        ("/v1/chat/completions", deep.replace(b'"prompt": "x"', b'"messages": []'), None),
        ("/v1/completions", digits, None),
        ("/v1/chat/completions", nan, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "guided_json": {"$ref": "http://x/s.json"}}', "guided_json"),
    ]:
        status, _, body = http(live.url, "POST", path, raw)
        err = json.loads(body)["error"]
        deep_case = raw.startswith(b'{"prompt": "x", "user"') or b'"messages": [], "user"' in raw
        # json.loads stops at Python's recursion limit (which libraries such as torch raise) before
        # our depth walk does, or not: the walk names the top-level field, the parser cannot
        expected = (None, "user") if deep_case else (param,)
        assert status == 400 and err["param"] in expected, err
        if deep_case:
            assert "deeper than" in err["message"]
    assert tracebacks(caplog) == []


# -- malformed HTTP ---------------------------------------------------------------------------------


def test_malformed_http_gets_an_openai_error_and_one_log_line(
    live: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cases = [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    ]
    for i, raw in enumerate(cases):
        before = len(caplog.records)
        status, body = raw_http(live.port, raw)
        assert status == 400, raw[:80]
        assert_openai_error(body, status)
        mine = [r for r in caplog.records[before:] if not r.name.startswith("aiohttp.access")]
        assert len(mine) == 1 and mine[0].levelno == logging.WARNING, (i, [r.getMessage() for r in mine])
    assert tracebacks(caplog) == []


# -- body size ------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413_from_content_length(live: LiveServer) -> None:
    limit = body_limit(live.engine.max_model_len)
    status, body = raw_http(
        live.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (limit + 1),
    )  # the body is never sent: the answer comes from the header alone
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "--max-model-len 256" in body["error"]["message"] and str(limit) in body["error"]["message"]


def test_chunked_body_over_the_limit_is_413_while_reading(live: LiveServer) -> None:
    limit = body_limit(live.engine.max_model_len)
    chunk = b"1" * 65_536
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (limit // len(chunk) + 2)  # no final 0-chunk
    status, body = raw_http(
        live.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        parts,
    )
    assert status == 413 and body["error"]["code"] == "request_too_large"


class BlockingTemplateTokenizer(FakeTokenizer):
    """Holds a chat request inside its template rendering until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        self.entered.set()
        self.release.wait(60)  # a guard against a deadlocked test, not a timing
        return super().apply_chat_template(messages, add_generation_prompt)


def test_health_answers_while_a_large_request_is_processed() -> None:
    tok = BlockingTemplateTokenizer()
    engine = FakeEngine(max_model_len=100_000, tokenizer=tok)
    live = LiveServer(engine)
    try:
        big = json.dumps(
            {"messages": [{"role": "user", "content": "word " * INLINE_BODY_BYTES}], "max_tokens": 2}
        ).encode()
        result: dict[str, Any] = {}

        def send_big() -> None:
            result["status"] = http(live.url, "POST", "/v1/chat/completions", big)[0]

        sender = threading.Thread(target=send_big)
        sender.start()
        assert tok.entered.wait(30)
        # the large request is now being processed, and stays so until released below
        status, _, body = http(live.url, "GET", "/health", timeout=10)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert "status" not in result  # /health answered before the large request completed
        tok.release.set()
        sender.join(30)
        assert result["status"] == 200
    finally:
        tok.release.set()
        live.close()


# -- admission ------------------------------------------------------------------------------------


def test_more_choices_than_the_queue_holds_is_400_naming_n() -> None:
    live = LiveServer(FakeEngine(max_queue_len=2))
    try:
        for path, req in [
            ("/v1/completions", {"prompt": "x", "n": 3, "max_tokens": 2}),
            ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}),
        ]:
            status, headers, body = http(live.url, "POST", path, json.dumps(req).encode())
            err = json.loads(body)["error"]
            assert status == 400 and err["param"] == "n" and "--max-queue-len" in err["message"]
            assert "Retry-After" not in headers
        status, _, _ = http(live.url, "POST", "/v1/completions", b'{"prompt": "x", "n": 2, "max_tokens": 2}')
        assert status == 200
    finally:
        live.close()


# -- the real engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool(make_engine: Callable[..., Any]) -> Iterator[tuple[LiveServer, Any]]:
    """SmolLM2 with max_model_len 512 but a KV pool of 4 blocks (64 tokens)."""
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    per_block = make_engine(max_model_len=512).runner.geometry.bytes_per_block
    engine = AsyncEngine(make_engine(max_model_len=512, kv_cache_memory=4 * per_block))
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name)
    yield live, engine
    live.close()


def test_small_kv_pool_warns_at_start(
    make_engine: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    probe = make_engine(max_model_len=512)
    caplog.set_level(logging.WARNING, logger="kvpilot.runtime.engine.core")
    engine = make_engine(max_model_len=512, kv_cache_memory=4 * probe.runner.geometry.bytes_per_block)
    assert engine.kv_capacity_tokens == 64
    lines = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    assert len(lines) == 1 and "64" in lines[0] and "512" in lines[0]


def test_small_kv_pool_default_max_tokens_fits(small_pool: tuple[LiveServer, Any]) -> None:
    live, engine = small_pool
    assert engine.kv_capacity_tokens == 64 < engine.max_model_len
    req = {"prompt": "The numbers from one to a hundred: 1, 2, 3,", "temperature": 0, "ignore_eos": True}
    status, _, body = http(live.url, "POST", "/v1/completions", json.dumps(req).encode())
    assert status == 200, body
    usage = json.loads(body)["usage"]
    assert usage["total_tokens"] == 64  # the prompt plus what fits, not the whole context
    too_long = {"prompt": list(range(100, 180))}
    status, _, body = http(live.url, "POST", "/v1/completions", json.dumps(too_long).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"


def test_continuous_usage_stats_streams_usage_in_every_chunk(small_pool: tuple[LiveServer, Any]) -> None:
    live, _ = small_pool
    for path, req in [
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}]}),
    ]:
        req |= {
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        status, _, body = http(live.url, "POST", path, json.dumps(req).encode())
        assert status == 200
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usages = [c["usage"] for c in chunks]
        assert all(u is not None for u in usages)
        completion = [u["completion_tokens"] for u in usages]
        assert completion == sorted(completion) and completion[-1] == 6
        assert len({u["prompt_tokens"] for u in usages}) == 1
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        assert chunks[-1]["choices"] == []


# -- the CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "flag", "message"),
    [
        (["--kv-cache-memory", "64KiB"], "--kv-cache-memory", "holds no block"),
        # SmolLM2's hidden size 576 is not a multiple of 128: the error names the groups that fit
        (
            ["--quantization", "int4", "--quantization-group-size", "128"],
            "--quantization int4",
            "--quantization-group-size 32 or 64 fits every layer",
        ),
    ],
    ids=["kv-cache-memory", "int4-group"],
)
def test_a_setting_the_model_cannot_take_exits_with_one_line_naming_the_flag(
    setting: list[str], flag: str, message: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--dtype", "float32", *setting, "--threads", "1", "--log-level", "error"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if flag in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr
