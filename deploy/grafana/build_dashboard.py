"""Build the kvpilot Grafana dashboard: `python deploy/grafana/build_dashboard.py` writes
examples/grafana-dashboard.json (then `python deploy/sync.py` copies it into the chart).

The dashboard is code so that panels stay uniform and every query is reviewable in one place;
tests/charts/test_dashboard.py checks the JSON is what this script builds and that every metric a
query names is one the runtime (docs/runtime.md's metrics table), the operator, the kube-state-metrics config
(deploy/kube-state-metrics/inferencemodel-crs.yaml) or the recording rules define.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpilot.api import pod_metrics as pm

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "examples" / "grafana-dashboard.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'namespace=~"$namespace", model_name=~"$model"'
KSM_SEL = 'namespace=~"$namespace"'
BY_MODEL = "namespace, model_name"
RATE = "rate({}[$__rate_interval])"
SEL_TTFT_OK = SEL + ', le="2.5"'  # the TTFT histograms' bucket at the SLO threshold (both engines have it)
# The variables list what pods report the Model Server Protocol's KV gauge: both engines export it.
MSP_KV = pm.KV_CACHE_USAGE.vllm[0]


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self) -> None:
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1
        self.panels: list[dict[str, Any]] = []

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x, self.row_h = 0, 0
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def pods(metric: str, around: str = "{}", sel: str = SEL, suffix: str = "") -> str:
    """The model pods' series of `metric` (kvpilot's name, plus `suffix`: _bucket, _count) under both
    engines' names (api/pod_metrics.names_of), `around` applied to each, joined with `or`: a kvpilot
    pod exports some readings under both names, and `or` keeps one per pod, the first name's."""
    names = tuple(n + suffix for n in pm.names_of(metric))
    expr = pm.promql_any(names, "{" + sel + "}", around)
    return f"({expr})" if len(names) > 1 else expr


def target(expr: str, legend: str, ref: str = "A", instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    *,
    min_: float | None = 0,
    max_: float | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    stack: bool = False,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if thresholds else "off"},
        },
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])],
        },
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    description: str,
    expr: str,
    unit: str = "short",
    thresholds: list[tuple[float | None, str]] | None = None,
    decimals: int | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])],
        },
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, "", instant=True)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[dict[str, Any]]:
    return [
        target(
            f"histogram_quantile({q}, sum by (le, {BY_MODEL}) ({pods(metric, RATE, suffix='_bucket')}))",
            f"p{round(q * 100)} {{{{model_name}}}}",
            ref=chr(ord("A") + i),
        )
        for i, q in enumerate(qs)
    ]


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "definition": query,
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        query_var("namespace", "Namespace", f"label_values({MSP_KV}, namespace)"),
        query_var(
            "model",
            "Model",
            f'label_values({MSP_KV}{{namespace=~"$namespace"}}, model_name)',
        ),
    ]


# A pod's P/D role (docs/disaggregation.md): the runtime's kvpilot_engine_info{kv_role}, joined by pod.
ROLE = f' * on (namespace, pod) group_left (kv_role) kvpilot_engine_info{{{SEL}, kv_role=~"prefill|decode"}}'
BY_ROLE = f"{BY_MODEL}, kv_role"
KSM_ROLE = (
    f" * on (namespace, name) group_left (model_name) kvpilot:inferencemodel_info:by_model_name{{{SEL}}}"
)


def disaggregation_row(g: Layout) -> None:
    """Per-role panels of disaggregated models (spec.disaggregation) and their KV transfers."""
    g.row("Prefill/decode disaggregation")
    g.add(
        timeseries(
            "Replicas by role",
            "Ready and desired replicas of each role (status.roles), for models with spec.disaggregation. "
            "Ready needs a Ready pod in both roles.",
            [
                target(
                    f"kvpilot_inferencemodel_status_role_ready_replicas{{{KSM_SEL}}}{KSM_ROLE}",
                    "ready {{role}} {{model_name}}",
                ),
                target(
                    f"kvpilot_inferencemodel_status_role_desired_replicas{{{KSM_SEL}}}{KSM_ROLE}",
                    "desired {{role}} {{model_name}}",
                    "B",
                ),
            ],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "KV cache usage by role",
            "Average share of KV-cache blocks in use per role: decode pods hold every running request's KV, "
            "prefill pods only prompts until their blocks are pulled (the autoscaler's decode signal).",
            [
                target(
                    f"avg by ({BY_ROLE}) (kvpilot_kv_cache_usage_ratio{{{SEL}}}{ROLE})",
                    "{{kv_role}} {{model_name}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Requests waiting by role",
            "Requests queued for admission per role: a prefill backlog delays first tokens, a decode "
            "backlog every token.",
            [
                target(
                    f"sum by ({BY_ROLE}) (kvpilot_num_requests_waiting{{{SEL}}}{ROLE})",
                    "{{kv_role}} {{model_name}}",
                )
            ],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "KV transfer throughput",
            "Block bytes per second prefill pods sent and decode pods pulled (kvpilot_kv_transfer_bytes_total).",
            [
                target(
                    f"sum by ({BY_MODEL}, direction) (rate(kvpilot_kv_transfer_bytes_total{{{SEL}}}[$__rate_interval]))",
                    "{{direction}} {{model_name}}",
                )
            ],
            "Bps",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "KV transfer time (one pull)",
            "Decode side: one KV pull from the prefill pod until its blocks are checked (p50, p90, p99); "
            "past spec.disaggregation.transferTimeoutSeconds the decode pod recomputes the prompt.",
            quantiles("kvpilot_kv_transfer_seconds"),
            "s",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "KV transfer failures and fallbacks",
            "Transfers that failed and prompts a decode pod recomputed instead (fallbacks), by reason, per "
            "second; and transfers pinned on prefill pods waiting for a pull. KvpilotKVTransferFallbacks "
            "fires above 5% of pulls for 10 minutes.",
            [
                target(
                    f"sum by ({BY_MODEL}, reason) (rate(kvpilot_kv_transfer_fallbacks_total{{{SEL}}}[$__rate_interval]))",
                    "fallback {{reason}} {{model_name}}",
                ),
                target(
                    f"sum by ({BY_MODEL}, reason) (rate(kvpilot_kv_transfer_failures_total{{{SEL}}}[$__rate_interval]))",
                    "failure {{reason}} {{model_name}}",
                    "B",
                ),
                target(
                    f"sum by ({BY_MODEL}) (kvpilot_kv_transfers_pending{{{SEL}}})",
                    "pending {{model_name}}",
                    "C",
                ),
            ],
        ),
        8,
        8,
    )


def build() -> dict[str, Any]:
    g = Layout()

    g.row("Overview")
    g.add(
        stat(
            "Replicas reporting",
            "Model pods whose /metrics Prometheus scraped (one KV-cache usage series each, kvpilot's or vLLM's).",
            f"count({pods('kvpilot_kv_cache_usage_ratio')})",
        ),
        4,
        4,
    )
    g.add(
        stat(
            "KV cache used (avg)",
            "Average share of KV-cache blocks in use across the selected replicas.",
            f"avg({pods('kvpilot_kv_cache_usage_ratio')})",
            "percentunit",
            [(None, "green"), (0.7, "yellow"), (0.9, "red")],
        ),
        4,
        4,
    )
    g.add(
        stat(
            "Requests waiting",
            "Requests queued, not yet admitted to a batch.",
            f"sum({pods('kvpilot_num_requests_waiting')})",
            thresholds=[(None, "green"), (10, "yellow"), (50, "red")],
        ),
        4,
        4,
    )
    g.add(
        stat(
            "Generation throughput",
            "Output tokens per second, all selected replicas.",
            f"sum({pods('kvpilot_generation_tokens_total', RATE)})",
            "short",
            decimals=1,
        ),
        4,
        4,
    )
    g.add(
        stat(
            "TTFT p99",
            "99th percentile time to first token over the last 5 minutes.",
            "histogram_quantile(0.99, sum by (le) "
            f"({pods('kvpilot_time_to_first_token_seconds', 'rate({}[5m])', suffix='_bucket')}))",
            "s",
            [(None, "green"), (1, "yellow"), (2.5, "red")],
        ),
        4,
        4,
    )
    g.add(
        stat(
            "First token within 2.5 s",
            "Share of requests whose first token came within 2.5 s over the last hour (objective: 99%).",
            f"sum({pods('kvpilot_time_to_first_token_seconds', 'rate({}[1h])', SEL_TTFT_OK, '_bucket')}) / "
            f"sum({pods('kvpilot_time_to_first_token_seconds', 'rate({}[1h])', suffix='_count')})",
            "percentunit",
            [(None, "red"), (0.99, "green")],
            decimals=2,
        ),
        4,
        4,
    )

    g.row("KV cache and queue")
    g.add(
        timeseries(
            "KV cache usage by model",
            "Average and busiest replica's share of KV-cache blocks in use. The autoscaler's default "
            "target is 70%; KvpilotKVCacheNearlyFull fires over 90% for 10 minutes.",
            [
                target(f"avg by ({BY_MODEL}) ({pods('kvpilot_kv_cache_usage_ratio')})", "avg {{model_name}}"),
                target(
                    f"max by ({BY_MODEL}) ({pods('kvpilot_kv_cache_usage_ratio')})", "max {{model_name}}", "B"
                ),
            ],
            "percentunit",
            max_=1,
            thresholds=[(None, "green"), (0.7, "yellow"), (0.9, "red")],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "KV cache usage by pod",
            "Each replica's share of KV-cache blocks in use.",
            [target(pods("kvpilot_kv_cache_usage_ratio"), "{{pod}}")],
            "percentunit",
            max_=1,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Requests running and waiting",
            "Requests in the running batch and requests queued for admission, per model.",
            [
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_num_requests_running')})", "running {{model_name}}"
                ),
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_num_requests_waiting')})",
                    "waiting {{model_name}}",
                    "B",
                ),
            ],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Queue time",
            "Time requests waited before admission (p50, p90, p99).",
            quantiles("kvpilot_request_queue_time_seconds"),
            "s",
        ),
        12,
        8,
    )

    g.row("Latency")
    g.add(
        timeseries(
            "Time to first token",
            "TTFT percentiles per model. The SLO alerts use 2.5 s as the threshold.",
            quantiles("kvpilot_time_to_first_token_seconds"),
            "s",
            thresholds=[(None, "green"), (2.5, "red")],
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "Inter-token latency",
            "Time between output tokens of a stream (p50, p90, p99).",
            quantiles("kvpilot_inter_token_latency_seconds"),
            "s",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "End-to-end request latency",
            "Arrival to last token (p50, p90, p99).",
            quantiles("kvpilot_e2e_request_latency_seconds"),
            "s",
        ),
        8,
        8,
    )
    g.add(
        timeseries(
            "TTFT error-budget burn (5m)",
            "Share of requests over 2.5 s to first token (recording rule kvpilot:ttft_slo_errors:ratio_rate5m) "
            "against the 1% objective; 14.4% is the fast-burn page threshold.",
            [
                target(
                    f"kvpilot:ttft_slo_errors:ratio_rate5m{{{SEL}}}",
                    "{{model_name}}",
                )
            ],
            "percentunit",
            thresholds=[(None, "green"), (0.01, "yellow"), (0.144, "red")],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Requests finished",
            "Finished requests per second by reason (stop, length, abort, ...).",
            [
                target(
                    f"sum by (model_name, finished_reason) ({pods('kvpilot_request_success_total', RATE)})",
                    "{{model_name}} {{finished_reason}}",
                )
            ],
            "reqps",
            stack=True,
        ),
        12,
        8,
    )

    g.row("Throughput")
    g.add(
        timeseries(
            "Token throughput",
            "Prompt (prefill) and generated tokens per second, per model.",
            [
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_prompt_tokens_total', RATE)})",
                    "prompt {{model_name}}",
                ),
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_generation_tokens_total', RATE)})",
                    "generated {{model_name}}",
                    "B",
                ),
            ],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache.",
            [
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_prefix_cache_hits_total', RATE)}) / "
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_prefix_cache_queries_total', RATE)})",
                    "{{model_name}}",
                )
            ],
            "percentunit",
            max_=1,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Speculative decoding",
            "Share of proposed tokens accepted (windowed, and since start), and tokens per verification "
            "step (accepted proposals plus the target's own token). Empty while it is off.",
            [
                target(
                    f"sum by ({BY_MODEL}) (rate(kvpilot_spec_decode_num_accepted_tokens_total{{{SEL}}}"
                    "[$__rate_interval])) / "
                    f"sum by ({BY_MODEL}) (rate(kvpilot_spec_decode_num_draft_tokens_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "acceptance {{model_name}}",
                ),
                target(
                    f"max by ({BY_MODEL}) (kvpilot_spec_decode_draft_acceptance_rate{{{SEL}}})",
                    "acceptance since start {{model_name}}",
                    "B",
                ),
                target(
                    f"sum by ({BY_MODEL}) (rate(kvpilot_spec_decode_num_emitted_tokens_total{{{SEL}}}"
                    "[$__rate_interval])) / "
                    f"sum by ({BY_MODEL}) (rate(kvpilot_spec_decode_num_drafts_total{{{SEL}}}[$__rate_interval]))",
                    "tokens per step {{model_name}}",
                    "C",
                ),
            ],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Output length per request",
            "Tokens generated per finished choice (p50, p90, p99; aborted ones not counted). The "
            "autoscaler's TPOT tail rule reads this distribution: long outputs stay in the batch longer.",
            quantiles("kvpilot_request_generation_tokens"),
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Prompt length per request",
            "Prompt tokens per finished choice (p50, p90, p99; aborted ones not counted), and the median "
            "of the prompts admitted (as they arrive; kvpilot pods only). The autoscaler's SLO planner "
            "sizes for the prompts admitted and the outputs finished: when the mix shifts, the admitted "
            "line moves a request's duration before the finished ones.",
            [
                *quantiles("kvpilot_request_prompt_tokens"),
                target(
                    f"histogram_quantile(0.5, sum by (le, {BY_MODEL}) "
                    f"({pods('kvpilot_admitted_prompt_tokens', RATE, suffix='_bucket')}))",
                    "p50 admitted {{model_name}}",
                    ref="D",
                ),
            ],
            "short",
        ),
        12,
        8,
    )

    g.row("Preemptions, OOM and engine loop")
    g.add(
        timeseries(
            "Preemptions",
            "Sequences preempted for lack of KV blocks, per second (recomputed later).",
            [
                target(
                    f"sum by ({BY_MODEL}) ({pods('kvpilot_num_preemptions_total', RATE)})",
                    "{{model_name}}",
                )
            ],
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "OOM recoveries",
            "Out-of-memory conditions the runtime recovered from, per 15 minutes.",
            [
                target(
                    f"sum by ({BY_MODEL}) (increase(kvpilot_oom_recoveries_total{{{SEL}}}[15m]))",
                    "{{model_name}}",
                )
            ],
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Stalled engine loops",
            "Replicas whose engine loop the watchdog reports stuck or stopped (kvpilot_engine_stalled: "
            "/health and /ready answer 503, so the kubelet restarts the pod).",
            [
                target(
                    f"sum by ({BY_MODEL}) (kvpilot_engine_stalled{{{SEL}}})",
                    "{{model_name}}",
                )
            ],
            "short",
            thresholds=[(None, "green"), (1, "red")],
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Engine heartbeat age",
            "Seconds since each replica's engine loop last made progress: under 0.5 while idle, the step "
            "time while busy; past --engine-stall-timeout with work to do the replica reports stalled.",
            [target(f"kvpilot_engine_heartbeat_age_seconds{{{SEL}}}", "{{pod}}")],
            "s",
        ),
        12,
        8,
    )

    g.row("Replicas and scaling")
    g.add(
        timeseries(
            "Replicas: desired, ready, reporting",
            "spec.replicas (the autoscaler's decision), ready replicas (InferenceModel status, from "
            "kube-state-metrics) and pods reporting metrics.",
            [
                target(
                    f"kvpilot_inferencemodel_spec_replicas{{{KSM_SEL}}}"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "desired {{model_name}}",
                ),
                target(
                    f"kvpilot_inferencemodel_status_ready_replicas{{{KSM_SEL}}}"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "ready {{model_name}}",
                    "B",
                ),
                target(
                    f"count by ({BY_MODEL}) ({pods('kvpilot_kv_cache_usage_ratio')})",
                    "reporting {{model_name}}",
                    "C",
                ),
                target(
                    f"kvpilot_inferencemodel_autoscaling_max_replicas{{{KSM_SEL}}}"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "max {{model_name}}",
                    "D",
                ),
            ],
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Scaling decisions",
            "Changes of spec.replicas per 5 minutes: each one is an autoscaler decision (or a manual "
            "kubectl scale). `kubectl describe im` shows the reasons as ScaledUp/ScaledDown Events.",
            [
                target(
                    f"changes(kvpilot_inferencemodel_spec_replicas{{{KSM_SEL}}}[5m])"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "{{model_name}}",
                )
            ],
            "short",
            stack=True,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Autoscaler readings",
            "What the autoscaler saw at its last decision: average KV-cache use and waiting requests.",
            [
                target(
                    f"kvpilot_inferencemodel_autoscaler_kv_cache_usage{{{KSM_SEL}}}"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "KV use {{model_name}}",
                ),
                target(
                    f"kvpilot_inferencemodel_autoscaler_queue_depth{{{KSM_SEL}}}"
                    " * on (namespace, name) group_left (model_name) "
                    f"kvpilot:inferencemodel_info:by_model_name{{{SEL}}}",
                    "waiting {{model_name}}",
                    "B",
                ),
            ],
            "short",
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "SLO attainment (measured)",
            "Share of requests that met the SLO over the autoscaler's window (status.autoscaler.slo: the "
            "router's kvpilot_router_slo_requests_total, else a bound from the pods' latency histograms), "
            "against spec.autoscaling.slo.attainmentTarget. Below target, the autoscaler grows the fleet; "
            "it scales down only with headroom. Absent: not measured (never read as 100%).",
            [
                target(
                    f"max by (namespace, model) (kvpilot_autoscaler_slo_attainment{{{KSM_SEL}}})", "{{model}}"
                ),
                target(
                    f"max by (namespace, model) (kvpilot_autoscaler_slo_attainment_target{{{KSM_SEL}}})",
                    "target {{model}}",
                    "B",
                ),
                target(
                    f"max by (namespace, model) (kvpilot_autoscaler_slo_capacity_factor{{{KSM_SEL}}})",
                    "capacity factor {{model}}",
                    "C",
                ),
            ],
            "percentunit",
            min_=None,
        ),
        12,
        8,
    )
    g.add(
        timeseries(
            "Operator reconciles",
            "The operator's reconciles per second by result, and whether a replica leads.",
            [
                target(
                    "sum by (result) (rate(kvpilot_operator_reconcile_total[$__rate_interval]))",
                    "{{result}}",
                ),
                target("max(kvpilot_operator_leader)", "leader", "B"),
            ],
            "short",
        ),
        12,
        8,
    )

    disaggregation_row(g)

    return {
        "__inputs": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "kvpilot: KV cache, queue, latency, throughput, preemptions and autoscaling per model.",
        "editable": True,
        "graphTooltip": 1,
        "links": [
            {
                "title": "Runbooks",
                "type": "link",
                "url": "https://github.com/kvpilot/kvpilot/blob/main/docs/runbooks.md",
                "targetBlank": True,
            }
        ],
        "panels": g.panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["kvpilot", "llm", "inference"],
        "templating": {"list": variables()},
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "kvpilot",
        "uid": "kvpilot-overview",
        "version": 1,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build examples/grafana-dashboard.json")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the build")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run `python deploy/grafana/build_dashboard.py`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
