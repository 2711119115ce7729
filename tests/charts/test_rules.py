"""The Prometheus rules: promtool's syntax check and unit tests, and what every alert must carry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.metric_names import (
    EXTERNAL,
    RULES,
    autoscaler_metrics,
    contract_metrics,
    ksm_metrics,
    operator_metrics,
    promql_metric_names,
    recorded,
    runtime_metrics,
    vllm_twins,
)
from tests.charts.render import template
from tests.charts.tools import ROOT, promtool

RULES_TEST = ROOT / "deploy" / "prometheus" / "kvpilot-rules.test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/kvpilot/kvpilot/blob/main/docs/runbooks.md#"
SEVERITIES = {"critical", "warning", "info"}


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def run(*args: str) -> str:
    result = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_promtool_check_rules() -> None:
    out = run("check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_promtool_unit_tests_pass() -> None:
    """Each alert fires where it should and stays quiet where it should (kvpilot-rules.test.yaml)."""
    out = run("test", "rules", str(RULES_TEST))
    assert "SUCCESS" in out


def test_every_alert_has_a_firing_unit_test() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {
        case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    names = {a["alert"] for a in alerts()}
    assert names - fired == set(), "alerts without a test that shows them firing"
    assert names - quiet == set(), "alerts without a test that shows them quiet"


def test_the_chart_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    rule = template("prometheusRule.additionalAlertLabels.team=ml", monitoring=True).one("PrometheusRule")
    path = tmp_path / "chart-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert "SUCCESS" in run("check", "rules", str(path))


def test_the_issue_s_alerts_are_all_there() -> None:
    exprs = {a["alert"]: a["expr"] for a in alerts()}
    assert "kvpilot_kv_cache_usage_ratio" in exprs["KvpilotKVCacheNearlyFull"]
    assert "0.9" in exprs["KvpilotKVCacheNearlyFull"]
    assert "deriv(kvpilot_num_requests_waiting" in exprs["KvpilotRequestQueueGrowing"]
    assert "rate(kvpilot_num_preemptions_total" in exprs["KvpilotHighPreemptionRate"]
    assert "increase(kvpilot_oom_recoveries_total" in exprs["KvpilotOOMRecovered"]
    assert 'reason="OOMKilled"' in exprs["KvpilotModelOOMKilled"]
    assert "ratio_rate1h" in exprs["KvpilotTTFTBudgetBurnFast"]
    assert "ratio_rate5m" in exprs["KvpilotTTFTBudgetBurnFast"]
    assert "ratio_rate3d" in exprs["KvpilotTTFTBudgetBurnSlow"]
    assert 'type="Ready"' in exprs["KvpilotModelNotReady"]
    assert "autoscaling_max_replicas" in exprs["KvpilotAutoscalerAtMaxReplicas"]
    assert "unless" in exprs["KvpilotMetricsMissing"]
    assert "up{" in exprs["KvpilotRuntimeScrapeFailing"]
    assert "absent(" in exprs["KvpilotOperatorDown"]
    durations = {a["alert"]: a.get("for") for a in alerts()}
    assert durations["KvpilotKVCacheNearlyFull"] == "10m"


def test_slo_threshold_is_a_runtime_histogram_bucket() -> None:
    """A bucket boundary that the runtime does not have would make every request a miss (or none)."""
    from kvpilot.runtime.serving.metrics import TTFT_BUCKETS

    les = set(re.findall(r'le="([0-9.]+)"', RULES.read_text()))
    assert les == {"2.5"}
    assert 2.5 in TTFT_BUCKETS


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_alert_has_severity_summary_description_and_runbook(alert: dict[str, Any]) -> None:
    name = alert["alert"]
    assert re.fullmatch(r"Kvpilot[A-Z][A-Za-z0-9]+", name)
    assert alert["labels"]["severity"] in SEVERITIES
    ann = alert["annotations"]
    assert ann["summary"] and ann["description"] and len(ann["description"]) > 60
    assert ann["runbook_url"] == RUNBOOK_BASE + name.lower()
    headings = {m.lower() for m in re.findall(r"^## (\S+)\s*$", RUNBOOKS.read_text(), flags=re.MULTILINE)}
    assert name.lower() in headings, f"docs/runbooks.md has no '## {name}' section"


def test_every_metric_the_rules_read_is_defined_somewhere() -> None:
    known = (
        runtime_metrics()
        | operator_metrics()
        | autoscaler_metrics()
        | ksm_metrics()
        | recorded()
        | EXTERNAL
        | vllm_twins()
    )
    for rule in rules():
        unknown = promql_metric_names(rule["expr"]) - known
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads unknown metrics {unknown}"


def test_runtime_metrics_in_rules_are_the_contract() -> None:
    names = {n for r in rules() for n in promql_metric_names(r["expr"]) if n.startswith("kvpilot_")}
    runtime = {
        n
        for n in names
        if not n.startswith(("kvpilot_operator_", "kvpilot_autoscaler_", "kvpilot_inferencemodel_"))
    }
    assert runtime <= runtime_metrics()
    assert runtime <= contract_metrics(), runtime - contract_metrics()


def test_the_chart_drops_the_autoscaler_alerts_without_an_autoscaler() -> None:
    """prometheusrule.yaml names the alerts that read the autoscaler's own metrics: exactly these."""
    reads_autoscaler = {
        a["alert"]
        for a in alerts()
        if any(n.startswith("kvpilot_autoscaler_") for n in promql_metric_names(a["expr"]))
    }
    assert reads_autoscaler == {
        "KvpilotAutoscalerDown",
        "KvpilotAutoscalerNoLeader",
        "KvpilotAutoscalerNotSyncing",
        "KvpilotSloAttainmentLow",
    }

    def names(*sets: str) -> set[str]:
        groups = template(*sets, monitoring=True).one("PrometheusRule")["spec"]["groups"]
        return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}

    assert reads_autoscaler <= names()
    without = names("autoscaler.enabled=false")
    assert not reads_autoscaler & without
    assert "KvpilotAutoscalerAtMaxReplicas" in without and "KvpilotOperatorDown" in without
