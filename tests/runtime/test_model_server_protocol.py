"""The Gateway API Inference Extension's Model Server Protocol on a real server's /metrics: the names,
types and labels an endpoint picker reads, with values that are the engine's own readings.

The tiny random Llama of tests/runtime/test_lora.py with two PEFT adapters and one device slot, where a
held model step freezes one adapter running and the other queued behind it; and SmolLM2 on the real
engine without LoRA (the LoRA metric is absent then, as vLLM leaves it out).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fake_engine import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.protocol import EngineStats, LoRAActivity
from kvpilot.runtime.engine.scheduler import SchedulerOutput
from kvpilot.runtime.serving.metrics import ServerMetrics
from tests.needs import require_module
from tests.runtime.test_engine_health import wait_for
from tests.runtime.test_lora import ADAPTERS, random_llama, write_adapter, write_base

pytestmark = pytest.mark.timeout(300)

# The protocol, as gateway-api-inference-extension docs/proposals/003-model-server-protocol/README.md
# states it (release v1.6.0), under the names of its "vLLM metric" column:
# "Metrics Reporting": TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization are Gauges; the
# optional BlockSize and NumGPUBlocks are "Labeled/Gauge", the labels `block_size` and `num_gpu_blocks`
# of `vllm:cache_config_info`. "LoRA Adapter Serving": `vllm:lora_requests_info`, type Gauge, value "the
# last updated timestamp", labels `max_lora` (a number), `running_lora_adapters` and
# `waiting_lora_adapters` (comma-separated adapter names).
# name -> (type, the labels the protocol reads from it, whether the protocol requires it)
PROTOCOL: dict[str, tuple[str, frozenset[str], bool]] = {
    "vllm:num_requests_waiting": ("gauge", frozenset(), True),
    "vllm:num_requests_running": ("gauge", frozenset(), True),
    "vllm:kv_cache_usage_perc": ("gauge", frozenset(), True),
    "vllm:cache_config_info": ("gauge", frozenset({"block_size", "num_gpu_blocks"}), False),
    "vllm:lora_requests_info": (
        "gauge",
        frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
        False,  # required of "model servers that support dynamic LoRA serving"
    ),
}
# The same readings under kvpilot's names (docs/runtime.md's metrics table).
TWINS = {
    "vllm:num_requests_waiting": "kvpilot_num_requests_waiting",
    "vllm:num_requests_running": "kvpilot_num_requests_running",
    "vllm:kv_cache_usage_perc": "kvpilot_kv_cache_usage_ratio",
}
LORA_LABELS = PROTOCOL["vllm:lora_requests_info"][1]

Sample = tuple[dict[str, str], float]


def scrape(url: str) -> dict[str, tuple[str, list[Sample]]]:
    """family -> (type, [(labels, value)])"""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        f.name: (f.type, [(s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def check_protocol(fams: dict[str, tuple[str, list[Sample]]], lora: bool) -> dict[str, Sample]:
    """Every protocol metric the server must expose is there, once, with its type and labels; returns
    name -> its one sample."""
    out = {}
    for name, (kind, labels, required) in PROTOCOL.items():
        expected = required or name == "vllm:cache_config_info" or lora
        assert (name in fams) == expected, f"{name}: {'missing' if expected else 'exposed without LoRA'}"
        if not expected:
            continue
        got_kind, samples = fams[name]
        assert got_kind == kind, name
        assert len(samples) == 1, f"{name}: one series per server, got {samples}"
        assert labels <= set(samples[0][0]), f"{name}: labels {sorted(samples[0][0])}"
        out[name] = samples[0]
    for name, twin in TWINS.items():
        assert out[name][1] == fams[twin][1][0][1], f"{name} differs from {twin} in one scrape"
    assert 0.0 <= out["vllm:kv_cache_usage_perc"][1] <= 1.0
    info = out["vllm:cache_config_info"]
    assert info[1] == 1.0 and int(info[0]["block_size"]) > 0 and int(info[0]["num_gpu_blocks"]) > 0
    return out


class Hold:
    """Blocks the model step whose batch `matches` until released (the engine's fault-injection hook)."""

    def __init__(self, matches: Callable[[SchedulerOutput], bool]) -> None:
        self.matches = matches
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch: SchedulerOutput) -> None:
        if self.matches(batch) and not self.release.is_set():
            self.entered.set()
            self.release.wait(120)


def submit(url: str, body: dict[str, Any], results: list[Any]) -> threading.Thread:
    """A completion in a background thread; its status (or error) lands in `results`."""

    def run() -> None:
        req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                results.append(resp.status)
        except Exception as e:
            results.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- LoRA: the tiny Llama, adapters "sql" and "chat", one device slot --------------------------------


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, AsyncEngine]]:
    require_module("peft", "pip install -e .[test]")
    root = tmp_path_factory.mktemp("msp-lora")
    write_base(root / "base")
    for i, name in enumerate(("sql", "chat")):
        rank, alpha, rslora, targets = ADAPTERS[name]
        write_adapter(random_llama(), root / name, rank, alpha, rslora, targets, seed=300 + i)
    torch.set_num_threads(1)
    cfg = EngineConfig(
        model=str(root / "base"),
        served_model_name="tiny",
        device="cpu",
        dtype="float32",
        threads=1,
        kv_cache_memory=4 << 20,
        block_size=8,
        lora_modules={"sql": str(root / "sql"), "chat": str(root / "chat")},
        max_loras=1,
    )
    engine = AsyncEngine(build_engine(cfg))
    engine.start()
    live = LiveServer(engine, model_name="tiny")
    yield live, engine
    live.close()


def lora_sample(url: str) -> Sample:
    return check_protocol(scrape(url), lora=True)["vllm:lora_requests_info"]


def waiting(url: str) -> float:
    return scrape(url)["kvpilot_num_requests_waiting"][1][0][1]


def test_lora_requests_info_names_the_running_and_the_queued_adapters(
    lora_server: tuple[LiveServer, AsyncEngine],
) -> None:
    live, engine = lora_server
    labels, _ = lora_sample(live.url)
    assert {k: labels[k] for k in LORA_LABELS} == {
        "max_lora": "1",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    prompt = [5, 17, 33, 8, 61, 12, 40, 9, 22]

    def body(model: str) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    # A base-model request's step is held, so "sql" and then "chat" reach the scheduler together.
    plug = Hold(lambda batch: True)
    on_sql = Hold(
        lambda batch: any(s.seq.lora is not None and s.seq.lora.name == "sql" for s in batch.scheduled)
    )
    engine.engine.before_execute = plug
    results: list[Any] = []
    threads = []
    try:
        threads.append(submit(live.url, body("tiny"), results))
        assert plug.entered.wait(60)
        threads.append(submit(live.url, body("sql"), results))
        wait_for(lambda: waiting(live.url) == 1, timeout=60)
        threads.append(submit(live.url, body("chat"), results))
        wait_for(lambda: waiting(live.url) == 2, timeout=60)
        # Next step: "sql" takes the one slot, "chat" waits for it; hold that step.
        engine.engine.before_execute = on_sql
        plug.release.set()
        assert on_sql.entered.wait(60)
        before = time.time()
        labels, value = lora_sample(live.url)
        assert {k: labels[k] for k in LORA_LABELS} == {
            "max_lora": "1",
            "running_lora_adapters": "sql",
            "waiting_lora_adapters": "chat",
        }
        assert before <= value <= time.time()  # the time of the reading
        fams = scrape(live.url)
        assert fams["vllm:num_requests_running"][1][0][1] == 2  # the base request and "sql"
        assert fams["vllm:num_requests_waiting"][1][0][1] == 1
    finally:
        plug.release.set()
        on_sql.release.set()
        engine.engine.before_execute = None
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]
    labels, _ = lora_sample(live.url)
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")


# -- SmolLM2 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(make_engine: Any) -> Iterator[tuple[LiveServer, AsyncEngine]]:
    engine = AsyncEngine(make_engine(max_model_len=256))
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name)
    yield live, engine
    live.close()


def test_smollm2_exposes_the_protocol_with_the_engine_s_values(
    smollm2: tuple[LiveServer, AsyncEngine],
) -> None:
    live, engine = smollm2
    hold = Hold(lambda batch: True)
    engine.engine.before_execute = hold
    results: list[Any] = []
    try:
        t = submit(live.url, {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}, results)
        assert hold.entered.wait(60)
        busy = check_protocol(scrape(live.url), lora=False)
        assert busy["vllm:num_requests_running"][1] == 1  # the request whose step is held
        assert busy["vllm:num_requests_waiting"][1] == 0
    finally:
        hold.release.set()
        engine.engine.before_execute = None
    t.join(120)
    assert results == [200]
    stats = engine.stats()
    idle = check_protocol(scrape(live.url), lora=False)
    assert idle["vllm:num_requests_running"][1] == 0
    labels = idle["vllm:cache_config_info"][0]
    assert (int(labels["block_size"]), int(labels["num_gpu_blocks"])) == (stats.block_size, stats.num_blocks)
    assert stats.block_size * stats.num_blocks == engine.engine.kv_capacity_tokens
    assert labels["model_name"] == engine.model_name


# -- the collector on its own ------------------------------------------------------------------------


def stats(**values: Any) -> EngineStats:
    base: dict[str, Any] = dict(
        model_name="m", kv_cache_usage=0.25, num_running=3, num_waiting=5, num_blocks=100, block_size=16,
        num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, oom_recoveries=0, prompt_tokens=0,
        generation_tokens=0, num_steps=0,
    )  # fmt: skip
    return EngineStats(**{**base, **values})


def test_protocol_series_are_absent_while_the_model_loads() -> None:
    m = ServerMetrics("m")
    assert "vllm:" not in m.render().decode()
    m.attach_engine(lambda: stats(lora=LoRAActivity(4, ("a", "b"), ("c",))))
    text = m.render().decode()
    assert 'vllm:num_requests_waiting{model_name="m"} 5.0' in text
    assert 'vllm:num_requests_running{model_name="m"} 3.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="100"} 1.0' in text
    assert 'max_lora="4",model_name="m",running_lora_adapters="a,b",waiting_lora_adapters="c"}' in text


def test_a_queue_changed_while_read_keeps_the_last_lora_snapshot(
    lora_server: tuple[LiveServer, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loop may change a queue while a scrape copies it (RuntimeError): the reading falls
    back to the engine thread's last snapshot instead of failing the scrape."""
    from kvpilot.runtime.engine import async_engine

    _, engine = lora_server
    last = engine.stats().lora
    assert last is not None

    def changed(scheduler: Any) -> None:
        raise RuntimeError("deque mutated during iteration")

    monkeypatch.setattr(async_engine, "lora_activity", changed)
    assert engine.stats().lora == engine._stats.lora
