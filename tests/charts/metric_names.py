"""Which metric names exist, by who defines them, and which names a PromQL expression uses."""

from __future__ import annotations

import re
from functools import cache
from types import SimpleNamespace

import yaml

from tests.charts.tools import ROOT
from tests.metrics_doc import documented_sample_names

RULES = ROOT / "deploy" / "prometheus" / "kvpilot-rules.yaml"
KSM_CONFIG = ROOT / "deploy" / "kube-state-metrics" / "inferencemodel-crs.yaml"
# Well-known series from Prometheus itself and kube-state-metrics that the alerts read.
EXTERNAL = {
    "up",
    "kube_pod_container_status_last_terminated_reason",
    "kube_pod_container_status_restarts_total",
}
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def contract_metrics() -> frozenset[str]:
    """Sample names of the runtime's metric contract: docs/runtime.md's metrics table (tests/metrics_doc.py;
    tests/runtime/test_metrics.py holds it equal to what the server registers)."""
    return documented_sample_names()


@cache
def runtime_metrics() -> frozenset[str]:
    """Sample names the runtime really exposes (runtime/serving/metrics.py, with every engine value present)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.runtime.serving.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, ServerMetrics

    m = ServerMetrics("m")
    # kv_role: a disaggregated pod's kvpilot_engine_info{kv_role} (docs/disaggregation.md)
    stats = SimpleNamespace(**{attr: 1 for _, _, attr in ENGINE_GAUGES + ENGINE_COUNTERS}, kv_role="decode")
    m.attach_engine(lambda: stats)
    m.request_finished("stop")
    for h in (m.ttft, m.itl, m.e2e, m.queue_time):
        h.observe(0.1)
    m.prompt_tokens.inc()
    m.generation_tokens.inc()
    names = set()
    for family in text_string_to_metric_families(m.render().decode()):
        names |= {s.name for s in family.samples}
    return frozenset(n for n in names if not n.endswith("_created"))


@cache
def operator_metrics() -> frozenset[str]:
    from prometheus_client import REGISTRY

    import kvpilot.operator.metrics  # noqa: F401  (registers the operator's metrics)

    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("kvpilot_operator_"):
            names |= {s.name for s in family.samples}
            if family.type == "gauge":
                names.add(family.name)
    # Labelled metrics have no samples until used; add the conventional sample names too.
    for family in REGISTRY.collect():
        if family.name.startswith("kvpilot_operator_"):
            if family.type == "counter":
                names.add(f"{family.name}_total")
            if family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_count", f"{family.name}_sum"}
    return frozenset(n for n in names if not n.endswith("_created"))


@cache
def autoscaler_metrics() -> frozenset[str]:
    """Sample names `kvpilot autoscaler run` exposes (kvpilot.autoscaler.metrics, a fresh registry)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.autoscaler.metrics import AutoscalerMetrics

    m = AutoscalerMetrics()
    m.desired.labels("ns", "model").set(1)  # per-model gauges have no sample until a decision
    m.current.labels("ns", "model").set(1)
    m.reporting.labels("ns", "model").set(1)
    m.attainment.labels("ns", "model").set(1)
    m.attainment_target.labels("ns", "model").set(1)
    m.capacity_factor.labels("ns", "model").set(1)
    names = set()
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        names |= {s.name for s in family.samples}
    return frozenset(n for n in names if not n.endswith("_created"))


@cache
def ksm_metrics() -> frozenset[str]:
    config = yaml.safe_load(KSM_CONFIG.read_text())
    names = set()
    for resource in config["spec"]["resources"]:
        for metric in resource["metrics"]:
            names.add(f"{resource['metricNamePrefix']}_{metric['name']}")
    return frozenset(names)


@cache
def recorded() -> frozenset[str]:
    rules = yaml.safe_load(RULES.read_text())
    return frozenset(r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r)


def vllm_twins() -> frozenset[str]:
    """vLLM's names of the pod metrics the dashboard and alerts read for both engines
    (api/pod_metrics.TWINS; tests/api/test_vllm_metrics.py finds them on a real vLLM page), with a
    histogram's sample suffixes."""
    from kvpilot.api.pod_metrics import TWINS

    names = {n for m in TWINS for n in m.vllm}
    return frozenset(names | {n + s for n in names for s in ("_bucket", "_count", "_sum")})


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (strings, label matchers, ranges, grouping clauses and function
    calls removed first)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names
