"""Chart copies agree with their sources (deploy/sync.py)."""

from __future__ import annotations

import yaml

from deploy import sync
from tests.charts.tools import ROOT


def test_chart_copies_are_up_to_date() -> None:
    drift = [
        str(p.relative_to(ROOT))
        for p, text in sync.copies().items()
        if not p.exists() or p.read_text() != text
    ]
    assert not drift, f"out of date (run `python deploy/sync.py`): {drift}"
    assert not sync.stale_files()


def test_sync_check_exit_code() -> None:
    assert sync.main(["--check"]) == 0


def test_argocd_cm_carries_the_health_script() -> None:
    cm = yaml.safe_load(sync.ARGOCD_CM.read_text())
    assert (
        cm["data"]["resource.customizations.health.kvpilot.dev_InferenceModel"] == sync.HEALTH_LUA.read_text()
    )


def test_kube_state_metrics_paths_exist_in_the_crd() -> None:
    """Every path the kube-state-metrics config reads is a field of the CRD schema (or under a block the
    CRD keeps open, like status.autoscaler)."""
    crd = yaml.safe_load((ROOT / "crds" / "kvpilot.dev_inferencemodels.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    config = yaml.safe_load((ROOT / "deploy" / "kube-state-metrics" / "inferencemodel-crs.yaml").read_text())

    def check(path: list[str]) -> None:
        node = schema
        for i, part in enumerate(path):
            if node.get("x-kubernetes-preserve-unknown-fields") and part not in node.get("properties", {}):
                return
            if node.get("type") == "array":
                node = node["items"]
            assert part in node.get("properties", {}), f"{'.'.join(path[: i + 1])} is not in the CRD schema"
            node = node["properties"][part]

    for resource in config["spec"]["resources"]:
        assert resource["groupVersionKind"] == {
            "group": "kvpilot.dev",
            "version": "v1alpha1",
            "kind": "InferenceModel",
        }
        for metric in resource["metrics"]:
            each = metric["each"]
            spec = each.get("gauge") or each.get("info") or {}
            base = spec.get("path", [])
            if base and base[0] != "metadata":
                check(base)
            for sub in spec.get("labelsFromPath", {}).values():
                if base and each["type"] == "Gauge" and crd_is_list(schema, base):
                    check([*base, *sub])
                elif not base:
                    check(sub)


def crd_is_list(schema: dict, path: list[str]) -> bool:
    node = schema
    for part in path:
        node = node["properties"][part]
    return node.get("type") == "array"
