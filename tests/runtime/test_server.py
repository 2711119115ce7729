"""Server protocol tests against a fake engine (tests/runtime/fake_engine.py), with the official
`openai` client (sync and async, streaming and not) and raw HTTP where headers matter."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from fake_engine import FakeEngine, LiveServer

from kvpilot.runtime import cli
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.serving.lifecycle import in_own_thread, serve
from kvpilot.runtime.serving.server import OpenAIServer, ServerSettings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def live(engine: FakeEngine) -> Iterator[LiveServer]:
    server = LiveServer(engine)
    yield server
    server.close()


def client(live: LiveServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=20)


def aclient(live: LiveServer, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=20)


def expected(engine: FakeEngine, n: int, seed: int | None = None) -> str:
    ids = engine.tokenizer.encode(engine.script)
    start = (seed or 0) % len(ids)
    return engine.tokenizer.decode(list(itertools.islice(itertools.cycle(ids), start, start + n)))


def http(
    live: LiveServer, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(live.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# -- basic endpoints ------------------------------------------------------------------------------


def test_models_health_ready(live: LiveServer) -> None:
    models = client(live).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert http(live, "GET", "/health")[0] == 200
    assert http(live, "GET", "/ready")[0] == 200


def test_unknown_route_is_openai_error(live: LiveServer) -> None:
    status, _, body = http(live, "GET", "/v1/nope")
    assert status == 404 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    status, _, body = http(live, "GET", "/v1/completions")
    assert status == 405 and "error" in json.loads(body)


# -- completions ----------------------------------------------------------------------------------


def test_completion_sync(live: LiveServer, engine: FakeEngine) -> None:
    prompt_len = len(engine.tokenizer.encode("Say hi"))
    out = client(live).completions.create(model="fake-model", prompt="Say hi", max_tokens=12)
    assert out.object == "text_completion" and out.model == "fake-model" and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].text == expected(engine, 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 12)
    assert out.usage.total_tokens == prompt_len + 12
    _, ids, params = engine.added[0]
    assert ids == engine.tokenizer.encode("Say hi") and params.max_tokens == 12


def test_completion_default_max_tokens_fills_context(live: LiveServer, engine: FakeEngine) -> None:
    ids = [5, 6, 7]
    out = client(live).completions.create(model="fake-model", prompt=ids)
    assert engine.added[0][2].max_tokens == engine.max_model_len - 3
    assert out.usage is not None and out.usage.completion_tokens == engine.max_model_len - 3


def test_completion_stream_matches_non_stream(live: LiveServer, engine: FakeEngine) -> None:
    c = client(live)
    full = c.completions.create(model="fake-model", prompt="x", max_tokens=30).choices[0].text
    chunks = list(
        c.completions.create(
            model="fake-model", prompt="x", max_tokens=30, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full == expected(engine, 30)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_n_and_batch_prompts(live: LiveServer, engine: FakeEngine) -> None:
    prompts = ["first prompt", "second"]
    out = client(live).completions.create(model="fake-model", prompt=prompts, n=2, max_tokens=4, seed=10)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    for p_idx in range(2):
        for i in range(2):
            assert by_index[p_idx * 2 + i] == expected(engine, 4, seed=10 + i)
    seeds = sorted(p.seed for _, _, p in engine.added)
    assert seeds == [10, 10, 11, 11]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 16


async def test_completion_async_stream_n2(live: LiveServer, engine: FakeEngine) -> None:
    texts = {0: "", 1: ""}
    finish = {}
    async with aclient(live) as c:
        stream = await c.completions.create(
            model="fake-model", prompt="x", n=2, max_tokens=6, seed=3, stream=True
        )
        async for ch in stream:
            for choice in ch.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    assert texts == {0: expected(engine, 6, 3), 1: expected(engine, 6, 4)}
    assert finish == {0: "length", 1: "length"}


def test_stop_string_truncates_and_aborts(live: LiveServer, engine: FakeEngine) -> None:
    c = client(live)
    out = c.completions.create(model="fake-model", prompt="x", max_tokens=200, stop=["STOP"])
    full = expected(engine, 200)
    assert out.choices[0].text == full[: full.index("STOP")]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra is not None and out.choices[0].model_extra.get("stop_reason") == "STOP"
    wait_for(lambda: len(engine.aborted) == 1)
    stream = c.completions.create(model="fake-model", prompt="x", max_tokens=200, stop=["STOP"], stream=True)
    pieces = [ch.choices[0].text for ch in stream]
    assert "".join(pieces) == full[: full.index("STOP")]
    assert all("STOP" not in p for p in pieces)


def test_include_stop_str_and_stop_token_ids(live: LiveServer, engine: FakeEngine) -> None:
    c = client(live)
    out = c.completions.create(
        model="fake-model",
        prompt="x",
        max_tokens=200,
        stop=["STOP"],
        extra_body={"include_stop_str_in_output": True},
    )
    full = expected(engine, 200)
    assert out.choices[0].text == full[: full.index("STOP") + 4]
    ids = engine.tokenizer.encode(engine.script)
    out = c.completions.create(
        model="fake-model", prompt="x", max_tokens=50, extra_body={"stop_token_ids": [ids[3]]}
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_completion_logprobs(live: LiveServer) -> None:
    out = client(live).completions.create(model="fake-model", prompt="x", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text


def test_echo(live: LiveServer, engine: FakeEngine) -> None:
    out = client(live).completions.create(model="fake-model", prompt="Echo me", max_tokens=3, echo=True)
    assert out.choices[0].text == "Echo me" + expected(engine, 3)


# -- chat -----------------------------------------------------------------------------------------


def test_chat_sync(live: LiveServer, engine: FakeEngine) -> None:
    out = client(live).chat.completions.create(
        model="fake-model",
        messages=[{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=8,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(engine, 8)
    assert out.choices[0].finish_reason == "length"
    rendered = (
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert engine.added[0][1] == engine.tokenizer.encode(rendered)
    assert out.usage is not None and out.usage.prompt_tokens == len(engine.added[0][1])


async def test_chat_async_stream(live: LiveServer, engine: FakeEngine) -> None:
    async with aclient(live) as c:
        stream = await c.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == expected(engine, 10)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_sync_stream_and_logprobs(live: LiveServer) -> None:
    stream = client(live).chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        logprobs=True,
        top_logprobs=2,
    )
    entries = [
        e
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []
    ]
    assert len(entries) == 4
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    out = client(live).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True
    )
    assert out.choices[0].logprobs is not None and len(out.choices[0].logprobs.content or []) == 3


def test_chat_n(live: LiveServer, engine: FakeEngine) -> None:
    out = client(live).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=1
    )
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert {c.index: c.message.content for c in out.choices} == {
        i: expected(engine, 5, 1 + i) for i in range(3)
    }
    assert out.usage is not None and out.usage.prompt_tokens == len(engine.added[0][1])
    assert out.usage.completion_tokens == 15


# -- errors ---------------------------------------------------------------------------------------


def test_unknown_model_404(live: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(live).completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert info.value.code == "model_not_found"


def test_bad_requests_400(live: LiveServer) -> None:
    c = client(live)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="fake-model", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="fake-model", prompt="x", max_tokens=10_000)
    assert "256" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="fake-model", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="fake-model", prompt=[10**6], max_tokens=2)
    assert "vocabulary" in str(info.value)
    for raw in (b'{"prompt": ', b'{"prompt": "\xc3\x28"}', b'{"prompt": "x", "max_tokens": "5"}'):
        status, _, body = http(live, "POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        err = json.loads(body)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and err["message"]


def test_api_key() -> None:
    live = LiveServer(FakeEngine(), api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(live, "wrong").models.list()
        status, _, body = http(live, "POST", "/v1/completions", b"{}")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        out = client(live, "sekret").completions.create(model="fake-model", prompt="x", max_tokens=2)
        assert out.choices[0].text
        for path in ("/health", "/ready", "/metrics"):
            assert http(live, "GET", path)[0] == 200
    finally:
        live.close()


def test_queue_full_429_with_retry_after() -> None:
    live = LiveServer(FakeEngine(max_waiting=0))
    try:
        with pytest.raises(openai.RateLimitError):
            client(live).completions.create(model="fake-model", prompt="x", max_tokens=2)
        status, headers, body = http(live, "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
    finally:
        live.close()


def test_partial_submission_failure_aborts_submitted_choices() -> None:
    engine = FakeEngine(max_waiting=2, delay=0.05)
    live = LiveServer(engine)
    try:
        with pytest.raises(openai.RateLimitError):
            client(live).completions.create(model="fake-model", prompt="x", n=3, max_tokens=50)
        wait_for(lambda: len(engine.aborted) == 2)
    finally:
        live.close()


# -- disconnects ----------------------------------------------------------------------------------


async def test_stream_disconnect_aborts() -> None:
    engine = FakeEngine(delay=0.02)
    live = LiveServer(engine)
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}
            )
            assert resp.status == 200
            await resp.content.readline()
            resp.close()  # drop the connection mid-stream
        await asyncio.to_thread(wait_for, lambda: len(engine.aborted) == 1)
        assert engine.aborted[0] == engine.added[0][0]
        assert live.server.num_active_requests == 0
    finally:
        live.close()


async def test_non_stream_disconnect_aborts() -> None:
    engine = FakeEngine(delay=0.02)
    live = LiveServer(engine)
    try:
        c = aclient(live)
        task = asyncio.ensure_future(
            c.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=200
            )
        )
        await asyncio.to_thread(wait_for, lambda: len(engine.added) == 1)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.close()
        await asyncio.to_thread(wait_for, lambda: len(engine.aborted) == 1)
    finally:
        live.close()


# -- lifecycle ------------------------------------------------------------------------------------


def test_drain_finishes_in_flight_then_exits_0() -> None:
    engine = FakeEngine(delay=0.01)
    live = LiveServer(engine, shutdown_timeout=10)
    results: dict[str, Any] = {}

    def long_request() -> None:
        results["out"] = client(live).completions.create(model="fake-model", prompt="x", max_tokens=100)

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: len(engine.added) == 1)
    live.begin_shutdown()
    wait_for(lambda: live.server.draining)
    status, _, _ = http(live, "GET", "/ready")
    assert status == 503
    assert http(live, "GET", "/health")[0] == 200
    with pytest.raises(openai.InternalServerError) as info:
        client(live).completions.create(model="fake-model", prompt="x", max_tokens=2)
    assert info.value.status_code == 503
    t.join(20)
    assert results["out"].choices[0].finish_reason == "length"
    assert live.wait_exit() == 0
    assert engine.aborted == [] and engine.shut_down
    live.close()


def test_drain_timeout_aborts_remaining() -> None:
    engine = FakeEngine(delay=0.05)
    live = LiveServer(engine, shutdown_timeout=0.3)
    chunks: list[Any] = []

    def long_stream() -> None:
        try:
            for ch in client(live).completions.create(
                model="fake-model", prompt="x", max_tokens=250, stream=True
            ):
                chunks.append(ch)
        except Exception as e:  # the stream may be cut
            chunks.append(e)

    t = threading.Thread(target=long_stream)
    t.start()
    wait_for(lambda: len(engine.added) == 1)
    live.begin_shutdown()
    assert live.wait_exit() == 0
    t.join(10)
    assert engine.aborted == [engine.added[0][0]]
    last = [c for c in chunks if not isinstance(c, Exception) and c.choices]
    assert last and last[-1].choices[0].finish_reason == "abort"
    live.close()


def test_ready_503_while_loading() -> None:
    gate = threading.Event()
    engine = FakeEngine()

    def load() -> FakeEngine:
        gate.wait(10)
        return engine

    live = LiveServer(None, load_engine=load)
    try:
        assert http(live, "GET", "/health")[0] == 200
        status, _, body = http(live, "GET", "/ready")
        assert status == 503 and json.loads(body)["status"] == "loading"
        with pytest.raises(openai.InternalServerError):
            client(live).completions.create(model="fake-model", prompt="x", max_tokens=2)
        gate.set()
        wait_for(lambda: http(live, "GET", "/ready")[0] == 200)
        assert engine.started
        assert client(live).completions.create(model="fake-model", prompt="x", max_tokens=2).choices[0].text
    finally:
        gate.set()
        live.close()


def test_the_model_loads_in_a_thread_that_ends() -> None:
    """The load's thread must not outlive it: an executor thread would keep the OpenMP team of the
    load's torch operations alive beside the engine thread's, and libgomp stops spinning at barriers
    once its live teams outnumber the CPUs (runtime/serving/lifecycle.py, `in_own_thread`)."""
    engine = FakeEngine()
    loaders: list[threading.Thread] = []

    def load() -> FakeEngine:
        loaders.append(threading.current_thread())
        return engine

    live = LiveServer(None, load_engine=load)
    try:
        wait_for(lambda: http(live, "GET", "/ready")[0] == 200)
        (loader,) = loaders
        assert loader is not threading.main_thread()
        loader.join(10)
        assert not loader.is_alive()
    finally:
        live.close()


async def test_in_own_thread_returns_the_result_or_raises() -> None:
    assert await in_own_thread(lambda: 42, "t") == 42

    def fail() -> None:
        raise ValueError("no weights")

    with pytest.raises(ValueError, match="no weights"):
        await in_own_thread(fail, "t")


async def test_sigterm_drains_and_returns_0() -> None:
    engine = FakeEngine(delay=0.01)
    server = OpenAIServer(ServerSettings("fake-model"), engine)
    ports: list[int] = []
    task = asyncio.ensure_future(
        serve(server, "127.0.0.1", 0, shutdown_timeout=5, install_signals=True, on_listening=ports.append)
    )
    while not ports:
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession() as session:
        req = asyncio.ensure_future(
            session.post(
                f"http://127.0.0.1:{ports[0]}/v1/completions", json={"prompt": "x", "max_tokens": 30}
            )
        )
        while not engine.added:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        resp = await req
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["finish_reason"] == "length"
    assert await asyncio.wait_for(task, 10) == 0
    assert engine.shut_down


# -- the `kvpilot serve` flags and --config precedence ---------------------------------------------


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_precedence_defaults_file_flags(tmp_path: Path) -> None:
    cfg = cli.build_config(serve_args([]))
    assert cfg == EngineConfig()
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9000\nmax_num_seqs: 8\nenable_prefix_caching: false\nkv_cache_dtype: int8\n")
    cfg = cli.build_config(serve_args(["--config", str(path), "--max-num-seqs", "4", "model.gguf"]))
    assert (cfg.port, cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.kv_cache_dtype) == (
        9000,
        4,
        False,
        "int8",
    )
    assert cfg.model == "model.gguf"
    cfg = cli.build_config(serve_args(["--config", str(path), "--enable-prefix-caching"]))
    assert cfg.enable_prefix_caching is True


def test_cli_enable_expert_parallel_flag_and_file(tmp_path: Path) -> None:
    assert cli.build_config(serve_args([])).enable_expert_parallel is False
    assert cli.build_config(serve_args(["--enable-expert-parallel"])).enable_expert_parallel is True
    path = tmp_path / "serve.yaml"
    path.write_text("tensor_parallel_size: 2\nenable_expert_parallel: true\n")
    cfg = cli.build_config(serve_args(["--config", str(path)]))
    assert (cfg.tensor_parallel_size, cfg.enable_expert_parallel) == (2, True)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000)],
)
def test_cli_kv_cache_memory_suffixes(text: str, value: int) -> None:
    assert serve_args(["--kv-cache-memory", text]).kv_cache_memory == value


def test_cli_bad_size_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        serve_args(["--kv-cache-memory", "lots"])
    assert info.value.code == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_cli_config_errors_name_the_field_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("port: 70000\nmax_num_sqs: 3\n")
    assert cli.run(serve_args(["--config", str(path)])) == 2
    err = capsys.readouterr().err
    assert "port" in err and "max_num_sqs" in err and "unknown setting" in err
    assert cli.run(serve_args(["--gpu-memory-utilization", "1.5"])) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err
    path.write_text("- just\n- a list\n")
    assert cli.run(serve_args(["--config", str(path)])) == 2
    assert cli.run(serve_args(["--config", str(tmp_path / "missing.yaml")])) == 2


# -- the real engine and SmolLM2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_live(make_engine: Callable[..., Any]) -> Iterator[tuple[LiveServer, Any]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_engine(max_model_len=512))
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name)
    yield live, engine
    live.close()


def test_real_engine_chat_greedy_matches_offline(
    real_live: tuple[LiveServer, Any], make_engine: Callable[..., Any]
) -> None:
    live, engine = real_live
    c = client(live)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = c.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=8, temperature=0)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    # A separate engine: the served one is stepped by its own thread.
    offline = make_engine(max_model_len=512).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8)
    )[0]
    text = tok.decode(offline.output_token_ids)
    assert out.choices[0].message.content == text
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(offline.output_token_ids)
    stream = c.chat.completions.create(
        model=engine.model_name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_real_engine_stop_string_and_seeded_n(real_live: tuple[LiveServer, Any]) -> None:
    live, engine = real_live
    c = client(live)
    full = c.completions.create(model=engine.model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert "6" in text
    cut = c.completions.create(
        model=engine.model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop="6"
    )
    assert cut.choices[0].text == text[: text.index("6")] and cut.choices[0].finish_reason == "stop"
    a = c.completions.create(
        model=engine.model_name, prompt="Once", max_tokens=6, n=2, seed=7, temperature=1.0
    )
    b = c.completions.create(
        model=engine.model_name, prompt="Once", max_tokens=6, n=2, seed=7, temperature=1.0
    )
    assert sorted((x.index, x.text) for x in a.choices) == sorted((x.index, x.text) for x in b.choices)
    wait_for(lambda: engine.num_unfinished() == 0)


async def test_real_engine_disconnect_frees_the_sequence(real_live: tuple[LiveServer, Any]) -> None:
    live, engine = real_live
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            live.url + "/v1/completions",
            json={"prompt": "Tell me a story", "max_tokens": 400, "stream": True},
        )
        await resp.content.readline()
        resp.close()
    await asyncio.to_thread(wait_for, lambda: engine.num_unfinished() == 0, 20)


def test_real_engine_cache_salt_isolates_prefix_cache(real_live: tuple[LiveServer, Any]) -> None:
    live, engine = real_live
    c = client(live)
    prompt = "The history of the printing press begins " * 8  # several full KV blocks

    def hits_after(salt: str) -> int:
        before = engine.stats().prefix_cache_hits
        c.completions.create(
            model=engine.model_name,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        wait_for(lambda: engine.num_unfinished() == 0)
        time.sleep(0.6)  # stats are refreshed by the engine thread
        return int(engine.stats().prefix_cache_hits - before)

    assert hits_after("tenant-a") == 0  # first time this prefix is seen under this salt
    assert hits_after("tenant-b") == 0  # same text, another tenant: no sharing
    assert hits_after("tenant-a") > 0  # same tenant again: reused
