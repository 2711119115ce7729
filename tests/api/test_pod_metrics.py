"""api/pod_metrics.py is the one list of pod metric names the control plane reads: every kvpilot name
in it is one the runtime documents and registers, and the PromQL the autoscaler builds from it reads
kvpilot's family before vLLM's."""

from __future__ import annotations

import pytest

from kvpilot.api import pod_metrics as pm
from tests.metrics_doc import documented_metrics, documented_sample_names

SIGNALS = [v for v in vars(pm).values() if isinstance(v, pm.PodMetric)]


def test_the_list_is_not_empty() -> None:
    assert len(SIGNALS) >= 9


@pytest.mark.parametrize("metric", SIGNALS, ids=lambda m: m.kvpilot)
def test_each_kvpilot_name_is_one_the_runtime_documents(metric: pm.PodMetric) -> None:
    documented = documented_metrics()
    name = metric.kvpilot
    assert name in documented or name in documented_sample_names(), f"{name} is not in docs/runtime.md"
    for alias in metric.vllm:
        assert alias.startswith("vllm:")


def test_the_runtime_registers_them() -> None:
    from kvpilot.runtime.serving.metrics import ServerMetrics
    from tests.runtime.fake_engine import FakeEngine

    m = ServerMetrics("m")
    m.attach_engine(FakeEngine().stats)
    m.request_finished("stop", 3)
    exposed = {s.name for fam in m.registry.collect() for s in fam.samples}
    for metric in SIGNALS:
        assert metric.kvpilot in exposed or f"{metric.kvpilot}_bucket" in exposed, metric.kvpilot


def test_promql_prefers_kvpilot_then_vllm() -> None:
    q = pm.promql_any(pm.REQUEST_SUCCESS.names, '{pod="p"}', "rate({}[1m])")
    assert (
        q
        == 'rate(kvpilot_request_success_total{pod="p"}[1m]) or rate(vllm:request_success_total{pod="p"}[1m])'
    )
