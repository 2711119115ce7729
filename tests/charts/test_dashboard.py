"""The Grafana dashboard: built from deploy/grafana/build_dashboard.py, valid, and only real metrics."""

from __future__ import annotations

import json
from typing import Any

from tests.charts.metric_names import (
    autoscaler_metrics,
    contract_metrics,
    ksm_metrics,
    operator_metrics,
    promql_metric_names,
    recorded,
    runtime_metrics,
    vllm_twins,
)
from tests.charts.tools import CHART, ROOT

DASHBOARD = ROOT / "examples" / "grafana-dashboard.json"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def queries() -> list[tuple[str, str]]:
    out = []
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"${var['name']}", var["definition"].removeprefix("label_values(").rsplit(",", 1)[0]))
    return out


def test_dashboard_is_what_the_builder_makes() -> None:
    from deploy.grafana.build_dashboard import render

    assert DASHBOARD.read_text() == render(), "run `python deploy/grafana/build_dashboard.py`"


def test_chart_carries_the_same_dashboard() -> None:
    assert (CHART / "files" / "grafana-dashboard.json").read_text() == DASHBOARD.read_text()


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] == "kvpilot" and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and p.get("description")
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "namespace", "model"}


def test_dashboard_covers_the_issue_s_panels() -> None:
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for word in (
        "kv cache",
        "waiting",
        "time to first token",
        "inter-token",
        "throughput",
        "preemptions",
        "replicas",
        "scaling decisions",
    ):
        assert word in titles, word


def families(names: set[str] | frozenset[str]) -> set[str]:
    return {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}


def runtime_names(names: set[str]) -> set[str]:
    return {
        n
        for n in names
        if n.startswith("kvpilot_")
        and not n.startswith(("kvpilot_operator_", "kvpilot_autoscaler_", "kvpilot_inferencemodel_"))
    }


def test_every_query_reads_known_metrics() -> None:
    """Runtime metrics must be in the contract (docs/runtime.md's metrics table) and really exposed by
    runtime/serving/metrics.py; the rest come from the operator, the autoscaler, the kube-state-metrics config or the
    recording rules. And every runtime metric of the contract shows up on some panel."""
    contract = contract_metrics()
    known = contract | operator_metrics() | autoscaler_metrics() | ksm_metrics() | recorded() | vllm_twins()
    used: set[str] = set()
    for title, expr in queries():
        names = promql_metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - known
        assert not unknown, f"{title}: unknown metrics {unknown} in {expr!r}"
        used |= names
    assert runtime_names(used) <= runtime_metrics()
    missing = families(contract) - families(used) - model_server_protocol_names()
    assert not missing, f"runtime metrics on no dashboard panel: {sorted(missing)}"


def model_server_protocol_names() -> set[str]:
    """The runtime's Model Server Protocol series (`vllm:*`), exempt from "every runtime metric has a
    panel": they exist for endpoint pickers, and the dashboard shows each reading once, under kvpilot's
    names. The three gauges are the same readings as kvpilot metrics that do have panels (checked here);
    `vllm:cache_config_info` is fixed per pod and `vllm:lora_requests_info` carries its information in
    label values (its value is a timestamp)."""
    from kvpilot.runtime.serving.metrics import ENGINE_GAUGES, MSP_CACHE_CONFIG, MSP_GAUGES, MSP_LORA

    kvpilot_name = {attr: name for name, _, attr in ENGINE_GAUGES}
    twins = {kvpilot_name[attr] for _, _, attr in MSP_GAUGES}
    used = {n for _, expr in queries() for n in promql_metric_names(expr)}
    assert twins <= used, f"the readings behind the vllm:* gauges need panels: {sorted(twins - used)}"
    return {name for name, _, _ in MSP_GAUGES} | {MSP_CACHE_CONFIG, MSP_LORA}
