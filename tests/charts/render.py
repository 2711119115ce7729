"""Render the chart with the real helm binary and look at the result as Python objects."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml

from tests.charts.tools import CHART, helm

MONITORING_APIS = (
    "monitoring.coreos.com/v1",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)


@dataclass(frozen=True)
class Rendered:
    objects: tuple[dict[str, Any], ...]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, (
            f"expected one {kind} named *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
        )
        return found[0]

    def pod_specs(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for o in self.objects:
            if o["kind"] == "Deployment":
                out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
            elif o["kind"] == "Pod":
                out.append((o["metadata"]["name"], o["spec"]))
        return out


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


@cache
def _template(sets: tuple[str, ...], api_versions: tuple[str, ...], namespace: str) -> str:
    args = ["template", "kvp", str(CHART), "--namespace", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    for api in api_versions:
        args += ["--api-versions", api]
    return run_helm(*args).stdout


def template(*sets: str, monitoring: bool = False, namespace: str = "kvpilot-system") -> Rendered:
    """`helm template` with --set values; monitoring=True pretends prometheus-operator is installed."""
    text = _template(tuple(sets), MONITORING_APIS if monitoring else (), namespace)
    docs = [d for d in yaml.safe_load_all(text) if d]
    return Rendered(tuple(docs))


def template_error(*sets: str) -> str:
    """stderr of a `helm template` that must fail."""
    args = ["template", "kvp", str(CHART)]
    for s in sets:
        args += ["--set", s]
    result = run_helm(*args, check=False)
    assert result.returncode != 0, f"helm template {' '.join(sets)} should have failed"
    return result.stderr
