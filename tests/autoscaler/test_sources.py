"""Metric sources against real HTTP servers on 127.0.0.1: a pod's /metrics and Prometheus' /api/v1/query."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvpilot.autoscaler.policy import ArrivalState, PodCounter, admitted_prompt_totals, measure_token_mix
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sources import (
    DEFAULT_KV_QUERY,
    DEFAULT_QUEUE_QUERY,
    DEFAULT_RUNNING_QUERY,
    MetricsParseError,
    ModelRef,
    PodScrapeSource,
    PodTarget,
    PrometheusSource,
    parse_metrics_text,
    parse_query_response,
    render_query,
)
from tests.charts.tools import promtool

MODEL = ModelRef("ml", "llama", "llama")


def kvpilot_page(
    kv: float, waiting: int, running: int = 3, model: str = "llama", finished: dict[str, int] | None = None
) -> str:
    reg = CollectorRegistry()
    Gauge("kvpilot_kv_cache_usage_ratio", "kv", ["model_name"], registry=reg).labels(model).set(kv)
    Gauge("kvpilot_num_requests_waiting", "w", ["model_name"], registry=reg).labels(model).set(waiting)
    Gauge("kvpilot_num_requests_running", "r", ["model_name"], registry=reg).labels(model).set(running)
    if finished is not None:
        # As runtime/serving/metrics.py declares it: one series per finish reason.
        c = Counter("kvpilot_request_success", "done", ["model_name", "finished_reason"], registry=reg)
        for reason, n in finished.items():
            c.labels(model, reason).inc(n)
    return generate_latest(reg).decode()


def surge_page(with_histograms: bool) -> str:
    """The runtime's page after a surge: 3 requests finished (prompts of 1,000 tokens, 100 generated)
    and one was aborted (its client went away) while 9 more arrived with prompts of 3,000 and stream
    (20 tokens each so far); without the histograms, the page of an engine that exports the token
    counters only."""
    from kvpilot.runtime.serving.metrics import ServerMetrics

    m = ServerMetrics("llama")
    m.attach_engine(lambda: type("S", (), {"kv_cache_usage": 0.9, "num_running": 9, "num_waiting": 3})())
    for prompt in (1000,) * 3 + (3000,) * 9:
        m.admitted_prompt_lengths.observe(prompt)
    for _ in range(3):
        m.request_finished("length", 100, 1000)
    m.request_finished("abort")
    m.prompt_tokens.inc(3 * 1000 + 9 * 3000)
    m.generation_tokens.inc(3 * 100 + 9 * 20)
    page = m.render().decode()
    if with_histograms:
        return page
    histograms = ("kvpilot_request_prompt_tokens", "kvpilot_request_generation_tokens", "kvpilot_admitted_")
    return "\n".join(line for line in page.splitlines() if not any(h in line for h in histograms)) + "\n"


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B"} 0.42
"""


def test_parse_kvpilot_family():
    s = parse_metrics_text(kvpilot_page(0.61, 4, 9), "p0", "llama")
    assert s is not None
    assert (s.kv_cache_usage, s.num_waiting, s.num_running) == (pytest.approx(0.61), 4, 9)


def test_parse_vllm_family_with_gpu_cache_fallback_and_other_served_name():
    s = parse_metrics_text(VLLM_PAGE, "p0", "llama")
    assert s is not None
    assert s.kv_cache_usage == pytest.approx(0.42)
    assert (s.num_waiting, s.num_running) == (5, 7)


def test_parse_prefers_new_vllm_name():
    page = VLLM_PAGE + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.9\n'
    s = parse_metrics_text(page, "p0", None)
    assert s is not None and s.kv_cache_usage == pytest.approx(0.9)


def test_parse_missing_family_is_not_reporting():
    page = "# TYPE kvpilot_kv_cache_usage_ratio gauge\nkvpilot_kv_cache_usage_ratio 0.5\n"
    assert parse_metrics_text(page, "p0") is None  # no queue depth: never guessed as 0


def test_parse_garbage_raises():
    with pytest.raises(MetricsParseError):
        parse_metrics_text("this is { not prometheus", "p0")


def test_parse_nan_is_not_reporting():
    page = "kvpilot_kv_cache_usage_ratio NaN\nkvpilot_num_requests_waiting 1\n"
    assert parse_metrics_text(page, "p0") is None


def test_parse_completed_requests_counter():
    sample = parse_metrics_text(kvpilot_page(0.5, 1, finished={"stop": 7, "length": 5}), "p0", "llama")
    assert sample is not None and sample.completed_total == 12.0
    assert parse_metrics_text(kvpilot_page(0.5, 1), "p0", "llama").completed_total is None  # type: ignore[union-attr]
    vllm = VLLM_PAGE + (
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{finished_reason="stop",model_name="meta-llama/Llama-3.1-8B"} 40.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="meta-llama/Llama-3.1-8B"} 2.0\n'
    )
    sample = parse_metrics_text(vllm, "p0", "llama")
    assert sample is not None and sample.completed_total == 42.0


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


@pytest.fixture
async def pod_server() -> AsyncIterator[tuple[dict[str, object], int]]:
    pages: dict[str, object] = {}

    async def metrics(request: web.Request) -> web.StreamResponse:
        behaviour = pages.get(request.match_info["pod"])
        if behaviour == "slow":
            await asyncio.sleep(5)
        if behaviour == "500":
            return web.Response(status=500, text="boom")
        return web.Response(text=str(behaviour), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/{pod}/metrics", metrics)
    runner, port = await _serve(app)
    yield pages, port
    await runner.cleanup()


async def test_pod_scrape_reads_each_ready_pod(pod_server):
    pages, port = pod_server
    pages.update({"a": kvpilot_page(0.8, 2), "b": VLLM_PAGE, "c": "slow", "d": "500", "e": "garbage {"})
    snaps = []
    for name in "abcde":
        # One test server stands in for five pods: each has its own path prefix.
        src = PodScrapeSource(timeout_s=0.5, path=f"/{name}/metrics")
        try:
            snaps.append(await src.collect(MODEL, [PodTarget(name, "127.0.0.1", port)]))
        finally:
            await src.close()
    reporting = {s.samples[0].pod: s.samples[0] for s in snaps if s.samples}
    assert set(reporting) == {"a", "b"}  # slow, 500 and garbage are "not reporting"
    assert reporting["a"].kv_cache_usage == pytest.approx(0.8)
    assert reporting["b"].num_waiting == 5


async def test_pod_scrape_collect_counts_ready_and_reporting(pod_server):
    pages, port = pod_server
    pages.update({"x": kvpilot_page(0.3, 1)})
    src = PodScrapeSource(timeout_s=0.5, path="/x/metrics")
    try:
        # The second pod's address refuses connections: not reporting.
        snap = await src.collect(MODEL, [PodTarget("x", "127.0.0.1", port), PodTarget("y", "127.0.0.1", 1)])
    finally:
        await src.close()
    assert snap.ready_replicas == 2
    assert [s.pod for s in snap.samples] == ["x"]
    assert snap.missing == 1


def test_render_query_fills_without_touching_promql_braces():
    q = render_query('x{namespace="{namespace}",model_name="{model}"}', "ml", 'we"ird')
    assert q == 'x{namespace="ml",model_name="we\\"ird"}'
    q = render_query(DEFAULT_KV_QUERY, "ml", "llama", ["llama-b", "llama-a", "llama.x"])
    assert 'namespace="ml",pod=~"llama-a|llama-b|llama\\\\.x"' in q  # sorted; the dot escaped for RE2
    assert "{namespace}" not in q and "{pods}" not in q and "max by (pod)" in q


# Series as Prometheus holds them: a kvpilot pod labels model_name with the served name, a vLLM pod
# with its Hugging Face path; another model's pod and the same pod name in another namespace must not
# count.
PROMETHEUS_SERIES = [
    ('kvpilot_kv_cache_usage_ratio{namespace="ml",pod="llama-a",model_name="llama"}', 0.5),
    ('kvpilot_num_requests_waiting{namespace="ml",pod="llama-a",model_name="llama"}', 2),
    ('kvpilot_num_requests_running{namespace="ml",pod="llama-a",model_name="llama"}', 5),
    (
        'vllm:kv_cache_usage_perc{namespace="ml",pod="llama-b",model_name="meta-llama/Llama-3.1-8B-Instruct"}',
        0.7,
    ),
    (
        'vllm:num_requests_waiting{namespace="ml",pod="llama-b",model_name="meta-llama/Llama-3.1-8B-Instruct"}',
        4,
    ),
    (
        'vllm:num_requests_running{namespace="ml",pod="llama-b",model_name="meta-llama/Llama-3.1-8B-Instruct"}',
        9,
    ),
    ('kvpilot_kv_cache_usage_ratio{namespace="ml",pod="other-a",model_name="other"}', 0.9),
    ('kvpilot_num_requests_waiting{namespace="ml",pod="other-a",model_name="other"}', 7),
    ('kvpilot_kv_cache_usage_ratio{namespace="prod",pod="llama-a",model_name="llama"}', 0.1),
]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (DEFAULT_KV_QUERY, {"llama-a": 0.5, "llama-b": 0.7}),
        (DEFAULT_QUEUE_QUERY, {"llama-a": 2, "llama-b": 4}),
        (DEFAULT_RUNNING_QUERY, {"llama-a": 5, "llama-b": 9}),
    ],
    ids=["kv", "queue", "running"],
)
def test_default_queries_find_vllm_pods_labelled_with_the_hf_path(
    template: str, expected: dict[str, float], tmp_path: Path
) -> None:
    """The default PromQL, evaluated by Prometheus' own engine (promtool test rules)."""
    query = render_query(template, "ml", "llama", ["llama-a", "llama-b"])
    case = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": f"{v}x5"} for s, v in PROMETHEUS_SERIES],
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": f'{{pod="{pod}"}}', "value": value} for pod, value in expected.items()
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(case))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{query}\n{result.stdout}\n{result.stderr}"


async def test_prometheus_source_asks_nothing_without_ready_pods(prometheus):
    state, port = prometheus
    src = PrometheusSource(f"http://127.0.0.1:{port}/")
    try:
        snap = await src.collect(MODEL, [])
    finally:
        await src.close()
    assert snap.ready_replicas == 0 and snap.samples == () and state["queries"] == []


def test_parse_query_response_shapes():
    body = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"pod": "a"}, "value": [1, "0.5"]},
                {"metric": {"pod": "b"}, "value": [1, "NaN"]},
                {"metric": {}, "value": [1, "1"]},
            ],
        },
    }
    assert parse_query_response(body) == {"a": 0.5}
    with pytest.raises(RuntimeError):
        parse_query_response({"status": "error", "error": "bad query"})


@pytest.fixture
async def prometheus() -> AsyncIterator[tuple[dict[str, object], int]]:
    state: dict[str, object] = {"queries": [], "fail": False}

    async def query(request: web.Request) -> web.StreamResponse:
        q = request.query["query"]
        state["queries"].append(q)  # type: ignore[attr-defined]
        if state["fail"]:
            return web.json_response(
                {"status": "error", "errorType": "bad_data", "error": "nope"}, status=400
            )
        if "kv_cache" in q:
            result = [
                {"metric": {"pod": "a"}, "value": [0, "0.9"]},
                {"metric": {"pod": "b"}, "value": [0, "0.5"]},
                {"metric": {"pod": "gone"}, "value": [0, "0.1"]},  # stale series of a deleted pod
            ]
        elif "generation_tokens_bucket" in q:
            result = [
                {"metric": {"pod": "a", "le": "4.0"}, "value": [0, "30"]},
                {"metric": {"pod": "a", "le": "+Inf"}, "value": [0, "100"]},
                {"metric": {"pod": "b", "le": "4.0"}, "value": [0, "1"]},
            ]
        elif "prompt_tokens_total" in q:
            result = [{"metric": {"pod": "a"}, "value": [0, "300000"]}]
        elif "generation_tokens_total" in q:
            result = [{"metric": {"pod": "a"}, "value": [0, "30000"]}]
        elif "request_success" in q and "rate(" not in q:
            if state.get("fail_counters"):
                return web.json_response({"status": "error", "error": "no such metric"}, status=400)
            result = [{"metric": {"pod": "a"}, "value": [0, "150"]}]
        elif "request_success" in q:
            if state.get("fail_completions"):
                return web.json_response({"status": "error", "error": "no such metric"}, status=400)
            result = [{"metric": {"pod": "a"}, "value": [0, "2.5"]}]
        elif "waiting" in q:
            result = [
                {"metric": {"pod": "a"}, "value": [0, "3"]},
                {"metric": {"pod": "gone"}, "value": [0, "0"]},
            ]
        else:
            result = [{"metric": {"pod": "a"}, "value": [0, "12"]}]
        return web.Response(
            text=json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}),
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner, port = await _serve(app)
    yield state, port
    await runner.cleanup()


async def test_prometheus_source_groups_by_pod(prometheus):
    state, port = prometheus
    src = PrometheusSource(f"http://127.0.0.1:{port}/")
    try:
        snap = await src.collect(MODEL, [PodTarget("a", "10.0.0.1"), PodTarget("b", "10.0.0.2")])
    finally:
        await src.close()
    # b has KV but no queue series: not reporting. "gone" is not a Ready pod: ignored.
    assert snap.ready_replicas == 2
    assert [(s.pod, s.kv_cache_usage, s.num_waiting, s.num_running) for s in snap.samples] == [
        ("a", 0.9, 3, 12)
    ]
    queries = state["queries"]
    assert any('kvpilot_kv_cache_usage_ratio{namespace="ml",pod=~"a|b"}' in q for q in queries)
    assert any("vllm:gpu_cache_usage_perc" in q for q in queries)
    assert snap.samples[0].completion_rate == 2.5
    assert any('rate(kvpilot_request_success_total{namespace="ml",pod=~"a|b"}[1m])' in q for q in queries)
    # The counters for the SLO planner's token mix, as instant values.
    a = snap.samples[0]
    assert (a.completed_total, a.prompt_tokens_total, a.generation_tokens_total) == (150.0, 300000.0, 30000.0)
    # the length histograms' sums first, the counters per pod where a pod has no histogram
    prompt_q = 'sum by (pod) (kvpilot_request_prompt_tokens_sum{namespace="ml",pod=~"a|b"} or '
    assert any(
        q.startswith(prompt_q) and 'or kvpilot_prompt_tokens_total{namespace="ml"' in q for q in queries
    )
    assert any(
        "vllm:request_generation_tokens_sum" in q and "vllm:generation_tokens_total" in q for q in queries
    )


async def test_prometheus_token_counters_feed_the_planner_token_mix(prometheus):
    """Two syncs through the Prometheus source give measure_token_mix the same inputs as the pod
    scrape: tokens per finished request between them. A failing counter query leaves them out."""
    state, port = prometheus
    src = PrometheusSource(f"http://127.0.0.1:{port}/")
    try:
        first = await src.collect(MODEL, [PodTarget("a", "10.0.0.1")])
        state["fail_counters"] = True
        degraded = await src.collect(MODEL, [PodTarget("a", "10.0.0.1")])
    finally:
        await src.close()
    s = first.samples[0]
    before = ArrivalState(
        counters=(PodCounter("a", 100.0, 0, 300000.0 - 50 * 2000, 30000.0 - 50 * 100),), time=0.0
    )
    assert measure_token_mix(first, before) == (2000.0, 100.0)
    assert s.completion_rate == 2.5  # the arrival estimate still prefers the rate
    assert degraded.samples[0].completed_total is None and degraded.samples[0].num_waiting == 3
    assert measure_token_mix(degraded, before) is None
    off = PrometheusSource(f"http://127.0.0.1:{port}/", token_counters=False)
    try:
        state["queries"] = []
        plain = await off.collect(MODEL, [PodTarget("a", "10.0.0.1")])
    finally:
        await off.close()
    assert plain.samples[0].prompt_tokens_total is None
    assert not any("tokens_total" in q for q in state["queries"])  # type: ignore[attr-defined]


async def test_prometheus_completions_query_failing_only_leaves_the_rate_out(prometheus):
    state, port = prometheus
    state["fail_completions"] = True
    src = PrometheusSource(f"http://127.0.0.1:{port}/")
    try:
        snap = await src.collect(MODEL, [PodTarget("a", "10.0.0.1")])
    finally:
        await src.close()
    assert [(s.pod, s.num_waiting, s.completion_rate) for s in snap.samples] == [("a", 3, None)]


async def test_prometheus_custom_templates_and_failure_means_not_reporting(prometheus):
    state, port = prometheus
    src = PrometheusSource(
        f"http://127.0.0.1:{port}",
        kv_query='my_kv_cache{ns="{namespace}",m="{model}"}',
        queue_query='my_waiting{ns="{namespace}"}',
        running_query=None,
    )
    try:
        snap = await src.collect(MODEL, [PodTarget("a", "10.0.0.1")])
        assert [s.pod for s in snap.samples] == ["a"]
        assert 'my_kv_cache{ns="ml",m="llama"}' in state["queries"]
        state["fail"] = True
        snap = await src.collect(MODEL, [PodTarget("a", "10.0.0.1")])
        assert snap.ready_replicas == 1 and snap.samples == ()
        # Unreachable Prometheus: also nobody reporting, never an exception.
        dead = PrometheusSource("http://127.0.0.1:1", timeout_s=0.5)
        snap = await dead.collect(MODEL, [PodTarget("a", "10.0.0.1")])
        await dead.close()
        assert snap.samples == ()
    finally:
        await src.close()


def test_parse_output_length_histogram_from_the_runtime_exporter():
    """The runtime's own ServerMetrics page: its kvpilot_request_generation_tokens buckets become the
    sample's cumulative (le, count) pairs; a page without the histogram gives None."""
    from kvpilot.runtime.serving.metrics import ServerMetrics

    m = ServerMetrics("llama")
    m.attach_engine(lambda: type("S", (), {"kv_cache_usage": 0.25, "num_running": 2, "num_waiting": 1})())
    for n in (1, 3, 3, 40, 5000):
        m.request_finished("length", n)
    s = parse_metrics_text(m.render().decode(), "p", "llama")
    assert s is not None and s.output_tokens_buckets is not None
    b = dict(s.output_tokens_buckets)
    assert (b[1.0], b[2.0], b[4.0], b[64.0], b[4096.0], b[8192.0], b[float("inf")]) == (1, 1, 3, 4, 4, 5, 5)
    plain = parse_metrics_text(kvpilot_page(0.5, 1), "p", "llama")
    assert plain is not None and plain.output_tokens_buckets is None


def test_the_token_mix_reads_finished_requests_where_the_length_histograms_exist():
    """The runtime's page after a surge: 3 requests finished (prompts of 1,000 tokens, 100 generated)
    while 9 more arrived (3,000) and stream. The counters count those too (prompts when they arrive,
    tokens as they stream); the sample's token totals are the histograms' sums (the finished
    requests'), so the mix is the finished requests' own, and the prompts admitted are the
    admitted-prompt histogram's count and sum. A page with the counters alone still gives them."""
    s = parse_metrics_text(surge_page(with_histograms=True), "p", "llama")
    assert s is not None
    assert (s.completed_total, s.prompt_tokens_total, s.generation_tokens_total) == (4.0, 3000.0, 300.0)
    assert s.finished_lengths_total == 3.0  # the aborted one is in no length histogram
    assert (s.admitted_total, s.admitted_prompt_tokens_total) == (12.0, 30000.0)
    before = ArrivalState(counters=(PodCounter("p", 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0),), time=0.0)
    snap = MetricsSnapshot(1, (s,))
    assert measure_token_mix(snap, before) == (1000.0, 100.0)
    assert admitted_prompt_totals(snap, before) == (12.0, 30000.0)
    # an engine without the histograms: the counters, which run ahead of the requests finished
    counters_only = surge_page(with_histograms=False)
    c = parse_metrics_text(counters_only, "p", "llama")
    assert c is not None and (c.completed_total, c.prompt_tokens_total, c.generation_tokens_total) == (
        4.0,
        30000.0,
        480.0,
    )
    assert c.finished_lengths_total is None  # divided by the finished counter, aborted one included
    assert measure_token_mix(MetricsSnapshot(1, (c,)), before) == (7500.0, 120.0)
    assert c.admitted_total is None and admitted_prompt_totals(MetricsSnapshot(1, (c,)), before) is None


def test_parse_vllm_output_length_histogram():
    page = VLLM_PAGE + (
        "# HELP vllm:request_generation_tokens Number of generation tokens processed.\n"
        "# TYPE vllm:request_generation_tokens histogram\n"
        'vllm:request_generation_tokens_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B"} 2.0\n'
        'vllm:request_generation_tokens_bucket{le="10.0",model_name="meta-llama/Llama-3.1-8B"} 7.0\n'
        'vllm:request_generation_tokens_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 9.0\n'
        'vllm:request_generation_tokens_count{model_name="meta-llama/Llama-3.1-8B"} 9.0\n'
        'vllm:request_generation_tokens_sum{model_name="meta-llama/Llama-3.1-8B"} 120.0\n'
    )
    s = parse_metrics_text(page, "p", "llama")
    assert s is not None
    assert s.output_tokens_buckets == ((1.0, 2.0), (10.0, 7.0), (float("inf"), 9.0))


async def test_prometheus_output_length_buckets_by_pod(prometheus):
    """The bucket query is grouped by pod and le; a pod whose KV or queue is missing still reports
    nothing, and the snapshot sums the reporting replicas' histograms."""
    state, port = prometheus
    src = PrometheusSource(f"http://127.0.0.1:{port}/")
    try:
        snap = await src.collect(MODEL, [PodTarget("a", "10.0.0.1"), PodTarget("b", "10.0.0.2")])
        state["queries"] = []
        off = PrometheusSource(f"http://127.0.0.1:{port}/", token_counters=False)
        plain = await off.collect(MODEL, [PodTarget("a", "10.0.0.1")])
        await off.close()
    finally:
        await src.close()
    assert snap.samples[0].output_tokens_buckets == ((4.0, 30.0), (float("inf"), 100.0))
    assert snap.output_tokens_buckets == ((4.0, 30.0), (float("inf"), 100.0))
    assert plain.samples[0].output_tokens_buckets is None
    assert not any("generation_tokens_bucket" in q for q in state["queries"])  # type: ignore[attr-defined]
