"""LoRA adapters through the HTTP API: `model` picks the base model or an adapter, `/v1/models` lists
both (adapters with their parent, never their path), adapters load and unload at run time behind the
API key (or an explicit opt-in without one) and a flag, a bad adapter is a 400 naming it while the
server keeps serving what it had, and a path it cannot use gets one answer whatever the reason.

The real engine on the tiny random Llama and PEFT adapters of tests/runtime/test_lora.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from fake_engine import LiveServer

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from tests.needs import require_module
from tests.runtime.test_lora import ADAPTERS, random_llama, write_adapter, write_base

pytestmark = pytest.mark.timeout(300)

KEY = "sekret"
PROMPT = [5, 17, 33, 8, 61, 12, 40, 9, 22]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_module("peft", "pip install -e .[test]")
    root = tmp_path_factory.mktemp("lora-server")
    write_base(root / "base")
    for i, name in enumerate(("sql", "chat")):
        rank, alpha, rslora, targets = ADAPTERS[name]
        write_adapter(random_llama(), root / name, rank, alpha, rslora, targets, seed=200 + i)
    write_adapter(random_llama(), root / "too-big", 32, 32, False, ["q_proj"], seed=9)
    return root


def config(workdir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(workdir / "base"),
        served_model_name="tiny",
        device="cpu",
        dtype="float32",
        threads=1,
        kv_cache_memory=4 << 20,
        block_size=8,
        lora_modules={"sql": str(workdir / "sql")},
        enable_lora_runtime_updates=True,
        max_loras=2,
    )


@pytest.fixture(scope="module")
def live(workdir: Path) -> Iterator[LiveServer]:
    torch.set_num_threads(1)
    engine = AsyncEngine(build_engine(config(workdir)))
    engine.start()
    server = LiveServer(engine, api_key=KEY, model_name="tiny")
    server.server.settings.lora_runtime_updates = True  # what --enable-lora-runtime-updates sets
    yield server
    server.close()


def call(
    live: LiveServer, method: str, path: str, body: Any = None, key: str | None = KEY
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(live.url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(live: LiveServer, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return call(live, "POST", "/v1/completions", body)


def offline_words(workdir: Path, lora: str | None) -> list[str]:
    engine = build_engine(
        config(workdir).model_copy(update={"lora_modules": {n: str(workdir / n) for n in ("sql", "chat")}})
    )
    seq = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), loras=[lora]
    )[0]
    return str(engine.tokenizer.decode(seq.output_token_ids)).split()  # word-level tokenizer


def test_models_lists_the_base_and_its_adapters(live: LiveServer, workdir: Path) -> None:
    status, body = call(live, "GET", "/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in body["data"]}
    assert set(cards) == {"tiny", "sql"}
    assert "parent" not in cards["tiny"]
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["lora_rank"] == ADAPTERS["sql"][0]
    # which folder it came from, for whoever knows the path (the operator), but not the path
    assert "root" not in cards["sql"] and str(workdir) not in json.dumps(body)
    assert cards["sql"]["lora_path_sha256"] == hashlib.sha256(str(workdir / "sql").encode()).hexdigest()


def test_model_field_picks_the_adapter(live: LiveServer, workdir: Path) -> None:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY)
    out = client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == "sql"
    assert out.choices[0].text.split() == offline_words(workdir, "sql")
    status, base = complete(live, "tiny")
    assert status == 200 and base["model"] == "tiny"
    assert base["choices"][0]["text"].split() == offline_words(workdir, None)
    assert base["choices"][0]["text"] != out.choices[0].text
    status, err = complete(live, "nope")
    assert status == 404 and err["error"]["param"] == "model"
    assert "'tiny' and the LoRA adapters ['sql']" in err["error"]["message"]


def test_load_use_unload_at_run_time(live: LiveServer, workdir: Path) -> None:
    body = {"lora_name": "chat", "lora_path": str(workdir / "chat")}
    status, err = call(live, "POST", "/v1/load_lora_adapter", body, key=None)
    assert status == 401
    status, ok = call(live, "POST", "/v1/load_lora_adapter", body)
    assert status == 200 and ok["id"] == "chat" and str(workdir) not in json.dumps(ok)
    status, models = call(live, "GET", "/v1/models")
    assert {c["id"] for c in models["data"]} == {"tiny", "sql", "chat"}
    status, out = complete(live, "chat")
    assert status == 200 and out["choices"][0]["text"].split() == offline_words(workdir, "chat")
    status, ok = call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and ok["status"] == "unloaded"
    assert complete(live, "chat")[0] == 404
    status, err = call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "'chat' is not loaded" in err["error"]["message"]


def test_bad_adapter_is_a_400_and_serving_goes_on(live: LiveServer, workdir: Path) -> None:
    status, err = call(
        live, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(workdir / "too-big")}
    )
    assert status == 400 and "LoRA adapter 'bad': rank 32 is over the limit of 16" in err["error"]["message"]
    assert err["error"]["param"] == "lora_path" and str(workdir) not in err["error"]["message"]
    assert complete(live, "bad")[0] == 404
    status, out = complete(live, "sql")
    assert status == 200 and len(out["choices"][0]["text"]) > 0


def unusable_paths(workdir: Path) -> dict[str, Path]:
    """Paths no adapter loads from, each for another reason (the reason goes to the server's log)."""
    root = workdir / "unusable"
    if not root.exists():
        root.mkdir()
        (root / "a-file").write_text("not a folder")
        (root / "bad-json").mkdir()
        (root / "bad-json" / "adapter_config.json").write_text('{"r": 4,')
        (root / "not-an-object").mkdir()
        (root / "not-an-object" / "adapter_config.json").write_text("[1]")
        shutil.copytree(workdir / "sql", root / "no-weights")
        (root / "no-weights" / "adapter_model.safetensors").unlink()
        shutil.copytree(workdir / "sql", root / "bad-weights")
        (root / "bad-weights" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    return {
        "does not exist": root / "nowhere",
        "is not a directory": root / "a-file",
        "adapter_config.json is missing": workdir / "base",  # a model folder is no adapter
        "is not valid JSON": root / "bad-json",
        "must hold a JSON object": root / "not-an-object",
        "adapter_model.safetensors is missing": root / "no-weights",
        "cannot read": root / "bad-weights",
    }


def test_an_unusable_path_gets_one_answer_and_the_reason_goes_to_the_log(
    live: LiveServer, workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whether a server path exists, is a folder, has adapter_config.json or valid JSON: a client
    learns none of it (before: a message per reason, naming the path)."""
    answers = set()
    for reason, path in unusable_paths(workdir).items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvpilot.server"):
            status, err = call(
                live, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)}
            )
        assert status == 400 and err["error"]["param"] == "lora_path", (reason, err)
        assert str(workdir) not in json.dumps(err), (reason, err)
        answers.add(json.dumps(err, sort_keys=True))
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert reason in logged and str(path) in logged, (reason, logged)
    assert len(answers) == 1, answers
    assert "cannot load a PEFT adapter from this lora_path" in answers.pop()
    assert complete(live, "bad")[0] == 404 and complete(live, "sql")[0] == 200


@pytest.mark.parametrize("name", ["../evil name", "a/b", "-lead", "x" * 64, "tab\there", "naïve"])
def test_adapter_names_follow_the_crds_rule(live: LiveServer, workdir: Path, name: str) -> None:
    """The rule of spec.adapters[].name (1-63 letters, digits, '.', '_', '-'; a letter or digit first)."""
    body = {"lora_name": name, "lora_path": str(workdir / "chat")}
    status, err = call(live, "POST", "/v1/load_lora_adapter", body)
    assert status == 400 and err["error"]["param"] == "lora_name", err
    assert "must be 1-63 letters, digits" in err["error"]["message"]
    status, models = call(live, "GET", "/v1/models")
    assert {c["id"] for c in models["data"]} == {"tiny", "sql"}


def test_without_an_api_key_updates_need_the_opt_in(live: LiveServer, workdir: Path) -> None:
    """No API key: the endpoints answer 403 naming the flags, unless the server opted in."""
    settings = live.server.settings
    body = {"lora_name": "chat", "lora_path": str(workdir / "chat")}
    settings.api_key = None
    try:
        for path, payload in (
            ("/v1/load_lora_adapter", body),
            ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
        ):
            status, err = call(live, "POST", path, payload, key=None)
            assert status == 403, (path, err)
            assert "--allow-lora-updates-without-api-key" in err["error"]["message"]
            assert "--api-key" in err["error"]["message"] and err["error"]["type"] == "permission_error"
        settings.lora_updates_without_api_key = True
        assert call(live, "POST", "/v1/load_lora_adapter", body, key=None)[0] == 200
        assert call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}, key=None)[0] == 200
    finally:
        settings.api_key, settings.lora_updates_without_api_key = KEY, False
    # with the key set again, the opt-in does not matter: the key is needed
    settings.lora_updates_without_api_key = True
    try:
        assert call(live, "POST", "/v1/load_lora_adapter", body, key=None)[0] == 401
    finally:
        settings.lora_updates_without_api_key = False


def test_malformed_adapter_requests(live: LiveServer) -> None:
    status, err = call(live, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and err["error"]["param"] == "lora_path"
    status, err = call(live, "POST", "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"})
    assert status == 400 and "base model's name" in err["error"]["message"]
    status, err = call(live, "POST", "/v1/unload_lora_adapter", [1, 2])
    assert status == 400
    req = urllib.request.Request(  # 1,000 levels: the API's one body depth limit, not a 500
        live.url + "/v1/load_lora_adapter", data=b"[" * 1000 + b"]" * 1000, method="POST"
    )
    req.add_header("Authorization", f"Bearer {KEY}")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=60)
    status, err = exc.value.code, json.loads(exc.value.read())
    assert status == 400 and "nests deeper than 64 levels" in err["error"]["message"]
    body = {"model": "sql", "prompt": PROMPT, "lora_request": {"lora_name": "sql"}}
    status, err = call(live, "POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "lora_request"
    assert "name the adapter in 'model'" in err["error"]["message"]


def test_runtime_updates_are_off_unless_enabled(live: LiveServer, workdir: Path) -> None:
    live.server.settings.lora_runtime_updates = False
    try:
        body = {"lora_name": "chat", "lora_path": str(workdir / "chat")}
        status, err = call(live, "POST", "/v1/load_lora_adapter", body)
        assert status == 404 and "--enable-lora-runtime-updates" in err["error"]["message"]
        assert call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
    finally:
        live.server.settings.lora_runtime_updates = True
    assert complete(live, "sql")[0] == 200


def test_serve_with_a_bad_adapter_exits_2_naming_the_flag(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kvpilot.net import free_port
    from kvpilot.runtime import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = [str(workdir / "base"), "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1"]
    argv += ["--port", str(free_port()), "--kv-cache-memory", "4MiB", "--threads", "1"]
    argv += ["--lora-modules", f"sql={workdir / 'sql'}", f"big={workdir / 'too-big'}"]
    assert cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert f"--lora-modules big={workdir / 'too-big'}" in err and "rank 32 is over the limit of 16" in err
