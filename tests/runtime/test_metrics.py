from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fake_engine import FakeEngine, FakeStats, LiveServer
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.engine.protocol import LoRAActivity
from kvpilot.runtime.serving.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, ServerMetrics
from tests.metrics_doc import documented_metrics

CONTRACT = {
    "kvpilot_kv_cache_usage_ratio": "gauge",
    "kvpilot_num_requests_running": "gauge",
    "kvpilot_num_requests_waiting": "gauge",
    "kvpilot_num_preemptions": "counter",
    "kvpilot_prefix_cache_queries": "counter",
    "kvpilot_prefix_cache_hits": "counter",
    "kvpilot_prompt_tokens": "counter",
    "kvpilot_generation_tokens": "counter",
    "kvpilot_request_success": "counter",
    "kvpilot_oom_recoveries": "counter",
    "kvpilot_time_to_first_token_seconds": "histogram",
    "kvpilot_inter_token_latency_seconds": "histogram",
    "kvpilot_e2e_request_latency_seconds": "histogram",
    "kvpilot_request_queue_time_seconds": "histogram",
    "kvpilot_request_prompt_tokens": "histogram",
    "kvpilot_request_generation_tokens": "histogram",
    "kvpilot_admitted_prompt_tokens": "histogram",
}


def scrape_text(text: str) -> dict[str, dict[str, float]]:
    """family name -> {sample name + sorted labels: value}"""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        samples = out.setdefault(fam.name, {})
        samples["__type__"] = fam.type  # type: ignore[assignment]
        for s in fam.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("le",))
            if "le" in s.labels:
                continue
            samples[key] = s.value
    return out


@pytest.fixture
def live() -> Iterator[LiveServer]:
    server = LiveServer(FakeEngine())
    yield server
    server.close()


def get_metrics(live: LiveServer) -> tuple[str, str]:
    with urllib.request.urlopen(live.url + "/metrics", timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def test_contract_names_types_and_labels(live: LiveServer) -> None:
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    c.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    c.completions.create(model="fake-model", prompt="hello", max_tokens=50, stop=["STOP"])
    ctype, text = get_metrics(live)
    assert ctype.startswith("text/plain")
    fams = scrape_text(text)
    for name, kind in CONTRACT.items():
        assert name in fams, name
        assert fams[name]["__type__"] == kind, name
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("kvpilot_"):
            for s in fam.samples:
                assert s.labels.get("model_name") == "fake-model", s
    prompt_len = len(FakeEngine().tokenizer.encode("hello"))
    assert (
        fams["kvpilot_prompt_tokens"]["kvpilot_prompt_tokens_total,model_name=fake-model"] == 2 * prompt_len
    )
    success = fams["kvpilot_request_success"]
    assert success["kvpilot_request_success_total,finished_reason=length,model_name=fake-model"] == 1
    assert success["kvpilot_request_success_total,finished_reason=stop,model_name=fake-model"] == 1
    ttft = fams["kvpilot_time_to_first_token_seconds"]
    assert ttft["kvpilot_time_to_first_token_seconds_count,model_name=fake-model"] == 2
    assert (
        fams["kvpilot_inter_token_latency_seconds"][
            "kvpilot_inter_token_latency_seconds_count,model_name=fake-model"
        ]
        > 0
    )
    assert (
        fams["kvpilot_request_queue_time_seconds"][
            "kvpilot_request_queue_time_seconds_count,model_name=fake-model"
        ]
        == 2
    )
    stats = FakeStats()
    assert fams["kvpilot_kv_cache_usage_ratio"]["kvpilot_kv_cache_usage_ratio,model_name=fake-model"] == (
        stats.kv_cache_usage
    )
    assert fams["kvpilot_num_preemptions"]["kvpilot_num_preemptions_total,model_name=fake-model"] == 3
    assert fams["kvpilot_prefix_cache_hits"]["kvpilot_prefix_cache_hits_total,model_name=fake-model"] == 40
    assert fams["kvpilot_oom_recoveries"]["kvpilot_oom_recoveries_total,model_name=fake-model"] == 1


def test_engine_metrics_live_and_absent_without_engine() -> None:
    m = ServerMetrics("m")
    text = m.render().decode()
    assert "kvpilot_kv_cache_usage_ratio" not in text  # missing, never a fake zero
    stats = FakeStats(kv_cache_usage=0.1)
    m.attach_engine(lambda: stats)
    assert 'kvpilot_kv_cache_usage_ratio{model_name="m"} 0.1' in m.render().decode()
    stats.kv_cache_usage = 0.9
    stats.num_waiting = 7
    text = m.render().decode()
    assert 'kvpilot_kv_cache_usage_ratio{model_name="m"} 0.9' in text
    assert 'kvpilot_num_requests_waiting{model_name="m"} 7.0' in text


def test_failing_stats_does_not_break_scrape() -> None:
    m = ServerMetrics("m")

    def broken() -> FakeStats:
        raise RuntimeError("boom")

    m.attach_engine(broken)
    m.prompt_tokens.inc(3)
    assert 'kvpilot_prompt_tokens_total{model_name="m"} 3.0' in m.render().decode()


def test_separate_registries() -> None:
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.generation_tokens.inc(5)
    assert 'kvpilot_generation_tokens_total{model_name="b"} 0.0' in b.render().decode()


def test_speculative_decoding_metrics_present_only_when_it_is_on() -> None:
    from kvpilot.runtime.engine.protocol import EngineStats

    base = dict(
        model_name="m",
        kv_cache_usage=0.0,
        num_running=1,
        num_waiting=0,
        num_blocks=10,
        block_size=16,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        oom_recoveries=0,
        prompt_tokens=0,
        generation_tokens=0,
        num_steps=0,
    )
    m = ServerMetrics("m")
    off = EngineStats(**base)  # type: ignore[arg-type]
    m.attach_engine(lambda: off)
    assert "kvpilot_spec_decode" not in m.render().decode()
    on = EngineStats(
        **base,  # type: ignore[arg-type]
        spec_num_drafts=10,
        spec_num_draft_tokens=40,
        spec_num_accepted_tokens=30,
        spec_num_emitted_tokens=40,
    )
    m.attach_engine(lambda: on)
    text = m.render().decode()
    assert 'kvpilot_spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert 'kvpilot_spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'kvpilot_spec_decode_num_accepted_tokens_total{model_name="m"} 30.0' in text
    assert 'kvpilot_spec_decode_num_emitted_tokens_total{model_name="m"} 40.0' in text
    assert 'kvpilot_spec_decode_draft_acceptance_rate{model_name="m"} 0.75' in text


def buckets(text: str, family: str) -> dict[float, float]:
    """le -> cumulative count of one histogram family."""
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            return {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    raise AssertionError(f"{family} not exported")


def test_output_length_histogram_observes_each_finished_generation() -> None:
    m = ServerMetrics("m")
    for n, prompt in ((1, 100), (3, 7), (3, 7), (40, 5000)):
        m.request_finished("length", n, prompt)
    m.request_finished("abort")  # no length: counted as finished, not as an output or prompt length
    m.prompt_tokens.inc(9000)  # a prompt that arrived and has not finished: the counter only
    text = m.render().decode()
    b = buckets(text, "kvpilot_request_generation_tokens")
    assert (b[1.0], b[2.0], b[4.0], b[32.0], b[64.0], b[float("inf")]) == (1, 1, 3, 3, 4, 4)
    fams = scrape_text(text)["kvpilot_request_generation_tokens"]
    assert fams["kvpilot_request_generation_tokens_sum,model_name=m"] == 47
    p = buckets(text, "kvpilot_request_prompt_tokens")
    assert (p[4.0], p[8.0], p[128.0], p[4096.0], p[8192.0], p[131072.0]) == (0, 2, 3, 3, 4, 4)
    prompts = scrape_text(text)["kvpilot_request_prompt_tokens"]
    assert prompts["kvpilot_request_prompt_tokens_sum,model_name=m"] == 5114
    assert prompts["kvpilot_request_prompt_tokens_count,model_name=m"] == 4


@pytest.fixture(scope="module")
def real_server(make_engine: Any) -> Iterator[tuple[LiveServer, Any]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_engine(max_model_len=256))
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name)
    yield live, engine
    live.close()


def test_output_length_histogram_through_the_real_engine(real_server: tuple[LiveServer, Any]) -> None:
    """SmolLM2 on the real engine: each choice's generated length lands in its bucket (n > 1 counts each
    choice), and the histogram's sum is the usage the responses report."""
    live, engine = real_server
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    keep_going = {"ignore_eos": True}
    a = c.completions.create(
        model=engine.model_name, prompt="1, 2, 3,", max_tokens=3, temperature=0, extra_body=keep_going
    )
    b = c.completions.create(
        model=engine.model_name,
        prompt="Once upon a time",
        max_tokens=20,
        n=2,
        seed=1,
        temperature=1.0,
        extra_body=keep_going,
    )
    assert a.usage is not None and b.usage is not None
    assert (a.usage.completion_tokens, b.usage.completion_tokens) == (3, 40)
    _, text = get_metrics(live)
    fams = scrape_text(text)["kvpilot_request_generation_tokens"]
    name = engine.model_name
    assert fams[f"kvpilot_request_generation_tokens_count,model_name={name}"] == 3
    assert fams[f"kvpilot_request_generation_tokens_sum,model_name={name}"] == 43
    counts = buckets(text, "kvpilot_request_generation_tokens")
    assert (counts[2.0], counts[4.0], counts[16.0], counts[32.0]) == (0, 1, 1, 3)
    # each finished choice's prompt, once per choice (n = 2 counts b's twice); the token counter
    # counts each prompt once, when it arrives
    prompts = scrape_text(text)["kvpilot_request_prompt_tokens"]
    assert prompts[f"kvpilot_request_prompt_tokens_count,model_name={name}"] == 3
    assert prompts[f"kvpilot_request_prompt_tokens_sum,model_name={name}"] == (
        a.usage.prompt_tokens + 2 * b.usage.prompt_tokens
    )
    # the prompts admitted, once per choice as it is submitted: the same three here (all finished)
    admitted = scrape_text(text)["kvpilot_admitted_prompt_tokens"]
    assert admitted[f"kvpilot_admitted_prompt_tokens_count,model_name={name}"] == 3
    assert admitted[f"kvpilot_admitted_prompt_tokens_sum,model_name={name}"] == (
        a.usage.prompt_tokens + 2 * b.usage.prompt_tokens
    )


def test_a_prompt_is_counted_as_admitted_before_it_finishes(real_server: tuple[LiveServer, Any]) -> None:
    """A streaming request shows in the admitted-prompt histogram while it runs, before any finished
    request's histogram counts it (the autoscaler's prompt mix leads the finished requests')."""
    live, engine = real_server
    name = engine.model_name

    def counts() -> tuple[float, float]:
        fams = scrape_text(get_metrics(live)[1])
        return (
            fams["kvpilot_admitted_prompt_tokens"][f"kvpilot_admitted_prompt_tokens_count,model_name={name}"],
            fams["kvpilot_request_prompt_tokens"][f"kvpilot_request_prompt_tokens_count,model_name={name}"],
        )

    admitted0, finished0 = counts()
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    stream = c.completions.create(
        model=name,
        prompt="Count: 1, 2, 3,",
        max_tokens=150,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    assert first.choices
    assert counts() == (admitted0 + 1, finished0)  # admitted, not finished
    for _ in stream:
        pass
    assert counts() == (admitted0 + 1, finished0 + 1)


def registered_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric a server exposes, with an engine attached whose every optional series is on
    (speculative decoding, LoRA) and one finished request: exposed name -> (type, labels)."""
    from kvpilot.runtime.engine.protocol import EngineStats

    stats = EngineStats(
        model_name="m", kv_cache_usage=0.5, num_running=1, num_waiting=2, num_blocks=10, block_size=16,
        num_preemptions=1, prefix_cache_queries=8, prefix_cache_hits=4, oom_recoveries=0,
        prompt_tokens=8, generation_tokens=4, num_steps=3, spec_num_drafts=2, spec_num_draft_tokens=8,
        spec_num_accepted_tokens=6, spec_num_emitted_tokens=8, engine_stalled=0,
        engine_heartbeat_age_seconds=0.1, kv_transfers_pending=1,
    )  # fmt: skip
    m = ServerMetrics("m")
    m.attach_engine(lambda: dataclasses.replace(stats, lora=LoRAActivity(2, ("sql",), ("chat",))))
    m.request_finished("stop", 4)
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in m.registry.collect():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        out[name] = (fam.type, frozenset(labels))
    engine_side = {n for n, _, _ in ENGINE_GAUGES} | {n for n, _, _ in ENGINE_COUNTERS}
    missing = sorted(engine_side - {n.removesuffix("_total") for n in out} - set(out))
    assert not missing, f"give the stats above a value for {missing}: they were not exposed"
    return out


def test_the_docs_metrics_table_lists_every_registered_metric() -> None:
    docs, code = documented_metrics(), registered_metrics()
    assert len(code) >= 20  # the scrape above exposed the whole set
    assert sorted(set(code) - set(docs)) == [], "metrics registered but missing from docs/runtime.md"
    assert sorted(set(docs) - set(code)) == [], "metrics in docs/runtime.md that the server does not register"
    wrong = {n: (docs[n], code[n]) for n in code if docs[n] != code[n]}
    assert wrong == {}, "type or labels in docs/runtime.md differ from the registry (doc, code)"
