"""A memory limit too small for the runtime's KV pool: the kernel OOM-kills the container for real (the
pod's memory cgroup on the real node), and the operator's OOM adaptation (spec.oomPolicy.adapt) brings
the model back Ready with no status written by hand.

The runtime's CPU KV pool defaults to 1 GiB and is allocated (touched) at start, so a pod limited to
MEMORY, which also holds torch, the model and the batch, is OOMKilled while loading. The operator sees
the container's `OOMKilled` termination, halves kvCacheMemory (and the batch limits), rolls the pods,
and repeats once per OOM of the current config until a pod fits (docs/operator.md, "Out-of-memory
policy"). Figure (REALNODE_FIGURES): first OOMKilled seen -> a pod of the adapted config Ready.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import Kubectl, wait_until
from e2e.processes import OperatorProcess
from e2e.realnode import pods as rp
from e2e.realnode.pods import NAME, SELECTOR, inference_model

pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
MEMORY = "1536Mi"  # less than torch + the model + the default 1 GiB KV pool


def _oom_killed(pods: list[dict[str, Any]]) -> bool:
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            for state in (status.get("state"), status.get("lastState")):
                if (state or {}).get("terminated", {}).get("reason") == "OOMKilled":
                    return True
    return False


def test_oom_killed_pod_is_adapted_back_to_ready(
    real_node: object, operator: OperatorProcess, weights: str, kubectl: Kubectl
) -> None:
    model = inference_model(weights, memory=MEMORY)
    model["spec"]["oomPolicy"] = {"adapt": True}
    kubectl.apply(model)

    try:
        wait_until(
            lambda: _oom_killed(rp.pods(kubectl, SELECTOR)),
            timeout=600,
            interval=0.5,
            what="an OOMKilled container",
        )
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{rp.diagnostics(kubectl, operator.log_path)}", pytrace=False)
    oom_seen = time.monotonic()

    def adapted_ready() -> dict[str, Any] | None:
        im = kubectl.json("get", "inferencemodel", NAME)
        adaptation = (im.get("status") or {}).get("oomAdaptation") or {}
        ready = [p for p in rp.pods(kubectl, SELECTOR) if rp.condition(p, "Ready").get("status") == "True"]
        return adaptation if adaptation.get("count", 0) >= 1 and ready else None

    try:
        adaptation = wait_until(adapted_ready, timeout=1200, interval=1, what="the adapted model Ready")
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{rp.diagnostics(kubectl, operator.log_path)}", pytrace=False)
    ready_after = time.monotonic() - oom_seen

    overrides = adaptation["overrides"]
    assert overrides.get("kvCacheMemory") is not None or overrides.get("memory") is not None, adaptation
    # The Ready pod runs the adapted config (the one the operator rendered after the OOM).
    config = kubectl.json("get", "configmap", f"{NAME}-config")["data"]["config.yaml"]
    if overrides.get("kvCacheMemory") is not None:
        assert "kv_cache_memory" in config, config
    print(
        f"REALNODE_FIGURES oom_to_ready_s={ready_after:.1f} adaptations={adaptation['count']} "
        f"changes={adaptation.get('changes')}"
    )
