"""LoRA adapters through the HTTP API: `model` picks the base model or an adapter, `/v1/models` lists
both (adapters with their parent), adapters load and unload at run time behind the API key and a
flag, and a bad adapter is a 400 naming it while the server keeps serving what it had.

The real engine on the tiny random Llama and PEFT adapters of tests/runtime/test_lora.py.
"""

from __future__ import annotations

import json
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
from kvpilot.runtime.engine import AsyncEngine, LLMEngine
from kvpilot.runtime.sampling_params import SamplingParams
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
    engine = AsyncEngine(LLMEngine.from_config(config(workdir)))
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
    engine = LLMEngine.from_config(
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
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(workdir / "sql")
    assert cards["sql"]["lora_rank"] == ADAPTERS["sql"][0]


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
    assert status == 200 and ok["id"] == "chat"
    status, models = call(live, "GET", "/v1/models")
    assert {c["id"] for c in models["data"]} == {"tiny", "sql", "chat"}
    status, out = complete(live, "chat")
    assert status == 200 and out["choices"][0]["text"].split() == offline_words(workdir, "chat")
    status, ok = call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and ok["status"] == "unloaded"
    assert complete(live, "chat")[0] == 404
    status, err = call(live, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "'chat' is not loaded" in err["error"]["message"]


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("too-big", "LoRA adapter 'bad': rank 32 is over the limit of 16"),
        ("missing", "does not exist"),
        ("base", "adapter_config.json is missing"),  # a model folder is no adapter
    ],
)
def test_bad_adapter_is_a_400_and_serving_goes_on(
    live: LiveServer, workdir: Path, adapter: str, message: str
) -> None:
    status, err = call(
        live, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(workdir / adapter)}
    )
    assert status == 400 and message in err["error"]["message"], err
    assert err["error"]["param"] == "lora_path"
    assert complete(live, "bad")[0] == 404
    status, out = complete(live, "sql")
    assert status == 200 and len(out["choices"][0]["text"]) > 0


def test_malformed_adapter_requests(live: LiveServer) -> None:
    status, err = call(live, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and err["error"]["param"] == "lora_path"
    status, err = call(live, "POST", "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"})
    assert status == 400 and "base model's name" in err["error"]["message"]
    status, err = call(live, "POST", "/v1/unload_lora_adapter", [1, 2])
    assert status == 400
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
