"""Kubernetes discovery: InferenceModels and their Ready pods -> the router's endpoints and policies."""

from __future__ import annotations

import asyncio
import copy
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpilot.api.models import KV_ROLE_LABEL
from kvpilot.api.slo import SloTargets
from kvpilot.router.kube_discovery import KubeSource, model_endpoints
from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint
from kvpilot.router.server import Router, RouterSettings


def im(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }


def pod(
    name: str,
    model: str,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    deleting: bool = False,
    role: str | None = None,
) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": "ml", "labels": {"kvpilot.dev/model": model}}
    if role is not None:
        md["labels"][KV_ROLE_LABEL] = role
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": md,
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class Lister:
    """The Kube adapter's list() over objects in memory; `fail` makes every list raise (API down)."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.fail = False

    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]:
        if self.fail:
            raise ConnectionError("apiserver unreachable")
        return [
            copy.deepcopy(o)
            for o in self.objects
            if o["apiVersion"] == api_version
            and o["kind"] == kind
            and (not selector or selector in o["metadata"].get("labels", {}))
        ]


def test_only_ready_running_pods_with_an_ip_are_endpoints() -> None:
    models = [
        im("llama", runtime={"maxNumSeqs": 8}, routing={"policy": "kv-aware", "fallbackModel": "qwen-chat"}),
        im("qwen", model={"source": "builtin://x", "servedName": "qwen-chat"}),
    ]
    pods = [
        pod("llama-b", "llama", "10.0.0.2"),
        pod("llama-a", "llama", "10.0.0.1"),
        pod("llama-c", "llama", "10.0.0.3", ready=False),
        pod("llama-d", "llama", None),
        pod("llama-e", "llama", "10.0.0.5", deleting=True),
        pod("other", "unknown-model"),
    ]
    table = model_endpoints(models, pods)
    assert table["llama"] == (
        [Endpoint("llama-a", "http://10.0.0.1:8000", 8), Endpoint("llama-b", "http://10.0.0.2:8000", 8)],
        "kv-aware",
        "qwen-chat",
        (),
        None,
        None,
    )
    assert table["qwen-chat"] == (
        [],
        None,
        None,
        (),
        None,
        None,
    )  # scaled to zero: routable, requests wait for a pod


def test_a_disaggregated_model_lists_its_pods_by_role_with_each_roles_capacity() -> None:
    pd = {
        "prefill": {"runtime": {"maxNumSeqs": 2}},
        "decode": {"replicas": 2},
        "minPromptTokens": 300,
        "transferTimeoutSeconds": 4,
    }
    models = [
        im("llama", runtime={"maxNumSeqs": 8}, disaggregation=pd),
        im("plain"),
        im("dflt", disaggregation={}),
    ]
    pods = [
        pod("llama-prefill-a", "llama", "10.0.0.1", role="prefill"),
        pod("llama-decode-a", "llama", "10.0.0.2", role="decode"),
        pod("llama-b", "llama", "10.0.0.3"),  # no role (an aggregated pod during the switch): decodes
        pod("llama-x", "llama", "10.0.0.4", role="sideways"),  # an unknown role is no role
        pod("plain-a", "plain", "10.0.0.5", role="prefill"),  # a role without spec.disaggregation
    ]
    table = model_endpoints(models, pods)
    assert table["llama"][0] == [
        Endpoint("llama-b", "http://10.0.0.3:8000", 8),
        Endpoint("llama-decode-a", "http://10.0.0.2:8000", 8, "decode"),
        Endpoint("llama-prefill-a", "http://10.0.0.1:8000", 2, "prefill"),
        Endpoint("llama-x", "http://10.0.0.4:8000", 8),
    ]
    assert table["llama"][5] == PdSettings(min_prompt_tokens=300, transfer_timeout_s=4.0)
    assert table["dflt"][5] == PdSettings()  # spec.disaggregation's defaults
    assert table["plain"][0] == [Endpoint("plain-a", "http://10.0.0.5:8000", 64, "prefill")]
    assert table["plain"][5] is None  # not disaggregated: the router sends it whole requests


async def test_spec_disaggregation_splits_the_models_pods_into_a_prefill_and_a_decode_pool() -> None:
    m = im("llama", disaggregation={"minPromptTokens": 100}, routing={"policy": "kv-aware"})
    lister = Lister([m, pod("p", "llama", role="prefill"), pod("d", "llama", "10.0.0.2", role="decode")])
    router = Router(RouterSettings(scrape_interval_s=0))
    source = KubeSource(lister, "ml")
    source.apply(source._list(), router.update)
    assert list(router.pools["llama"].pods) == ["d"] and list(router.prefill_pools["llama"].pods) == ["p"]
    # the model's policy routes its prompts; its decode pods go by load, KV use and measured latency
    assert router.prefill_pools["llama"].policy.name == "kv-aware"
    assert router.pools["llama"].policy.name == "least-loaded"
    del m["spec"]["disaggregation"]  # aggregated again: every pod takes whole requests
    source.apply(source._list(), router.update)
    assert sorted(router.pools["llama"].pods) == ["d", "p"] and "llama" not in router.prefill_pools
    assert router.pools["llama"].policy.name == "kv-aware"


def test_adapters_come_from_spec_adapters_in_order() -> None:
    m = im(
        "llama", adapters=[{"name": "sql", "source": "pvc://a/sql"}, {"name": "chat", "source": "hf://o/c"}]
    )
    table = model_endpoints([m, im("qwen")], [pod("llama-a", "llama")])
    assert table["llama"][3] == ("sql", "chat") and table["qwen"][3] == ()


async def test_adapters_reach_the_router_and_follow_spec_changes() -> None:
    m = im("llama", adapters=[{"name": "sql", "source": "pvc://a/sql"}])
    lister = Lister([m, pod("llama-a", "llama")])
    router = Router(RouterSettings(scrape_interval_s=0))
    source = KubeSource(lister, "ml")
    source.apply(source._list(), router.update)
    assert router.adapter_parent == {"sql": "llama"}
    m["spec"]["adapters"] = [{"name": "chat", "source": "pvc://a/chat"}]  # the adapter was replaced
    source.apply(source._list(), router.update)
    assert router.adapter_parent == {"chat": "llama"}
    lister.objects.remove(m)  # the InferenceModel was deleted: its adapters leave with it
    source.apply(source._list(), router.update)
    assert router.adapter_parent == {} and "llama" not in router.pools


async def test_the_slo_comes_from_spec_and_the_autoscalers_published_prefill_terms() -> None:
    slo = {"calibration": "h100/llama-3.1-8b", "ttftSeconds": 0.5, "tpotSeconds": 0.04}
    m = im("llama", autoscaling={"slo": slo})
    lister = Lister([m, im("plain"), pod("llama-a", "llama")])
    router = Router(RouterSettings(scrape_interval_s=0, slo=SloTargets(ttft_s=9.0, tpot_s=0.9)))
    source = KubeSource(lister, "ml")
    source.apply(source._list(), router.update)
    assert router.meter.targets("llama") == SloTargets(ttft_s=0.5, tpot_s=0.04)  # factor: the default
    assert router.meter.targets("plain") == SloTargets(ttft_s=9.0, tpot_s=0.9)  # the router's flags
    m["spec"]["autoscaling"]["slo"]["ttftPrefillFactor"] = 3
    m["status"] = {
        "autoscaler": {"slo": {"prefillSecondsPerToken": 1e-4, "prefillSecondsPerTokenSquared": 2e-9}}
    }
    source.apply(source._list(), router.update)
    assert router.meter.targets("llama") == SloTargets(0.5, 0.04, 3.0, 1e-4, 2e-9)
    m["status"]["autoscaler"]["slo"]["prefillSecondsPerToken"] = -1  # not a valid target: the flags'
    assert model_endpoints([m], [])["llama"][4] is None
    m["status"]["autoscaler"]["slo"] = "garbage"  # read defensively: absent terms are 0
    assert model_endpoints([m], [])["llama"][4] == SloTargets(0.5, 0.04, 3.0)


def test_oom_adaptation_caps_capacity() -> None:
    m = im("llama", runtime={"maxNumSeqs": 32})
    m["status"] = {"oomAdaptation": {"overrides": {"maxNumSeqs": 8}}}
    assert model_endpoints([m], [pod("p", "llama")])["llama"][0][0].capacity == 8


async def test_source_feeds_the_router_and_keeps_endpoints_when_listing_fails() -> None:
    objects = [im("llama", routing={"policy": "round-robin"}), pod("llama-a", "llama")]
    lister = Lister(objects)
    router = Router(RouterSettings(policy="prefix-affinity", scrape_interval_s=0))
    source = KubeSource(lister, "ml", interval_s=0.01)
    task = asyncio.create_task(source.run(router.update, router.mark_synced))
    try:

        async def until(cond: Any) -> None:
            for _ in range(500):
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("not in time")

        await until(lambda: router.synced and "llama" in router.pools)
        pool = router.pools["llama"]
        assert list(pool.pods) == ["llama-a"] and pool.policy.name == "round-robin"
        lister.fail = True  # the API server goes away: nothing is dropped
        await asyncio.sleep(0.1)
        assert list(router.pools["llama"].pods) == ["llama-a"]
        lister.fail = False
        objects.append(pod("llama-b", "llama", "10.0.0.2"))
        objects[0]["spec"]["routing"]["policy"] = "least-loaded"
        await until(lambda: len(router.pools["llama"].pods) == 2)
        assert router.pools["llama"].policy.name == "least-loaded"
        del objects[0]  # the InferenceModel is deleted: the model leaves the router
        await until(lambda: "llama" not in router.pools)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


class QueueWatch:
    """A watch over events put in memory; `fail` makes it raise at once (API server down)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.Queue[str] = queue.Queue()
        self.fail = False
        self.calls = 0

    def events(self, timeout_s: float) -> Iterator[str]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("apiserver unreachable")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.fail:
            try:
                yield self.queue.get(timeout=0.02)
            except queue.Empty:
                continue
        if self.fail:
            raise ConnectionError("watch connection reset")


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("not in time")
        await asyncio.sleep(0.01)


async def test_watch_events_bring_a_list_at_once_and_errors_fall_back_to_polling() -> None:
    objects = [im("llama"), pod("llama-a", "llama")]
    lister = Lister(objects)
    pods, models = QueueWatch("Pod"), QueueWatch("InferenceModel")
    router = Router(RouterSettings(scrape_interval_s=0))
    # resync and poll far apart: within the test only a watch event (or a watch error) brings a list
    source = KubeSource(
        lister, "ml", interval_s=0.05, watches=[pods, models], resync_s=3600, watch_timeout_s=0.5
    )
    task = asyncio.create_task(source.run(router.update, router.mark_synced))
    try:
        await until(lambda: router.synced and "llama" in router.pools)
        await asyncio.sleep(0.2)
        assert source.watching and source.lists == 1  # nothing changed, nothing listed
        objects.append(pod("llama-b", "llama", "10.0.0.2"))
        await asyncio.sleep(0.2)
        assert len(router.pools["llama"].pods) == 1  # not seen without an event
        pods.queue.put("ADDED")
        await until(lambda: len(router.pools["llama"].pods) == 2)
        objects.append(im("qwen"))
        models.queue.put("ADDED")
        await until(lambda: "qwen" in router.pools)

        # The watch breaks and the API server is down: the known endpoints stay, the source polls.
        lister.fail = True
        pods.fail = True
        await until(lambda: not source.watching)
        lists = source.lists
        await asyncio.sleep(0.3)
        assert sorted(router.pools["llama"].pods) == ["llama-a", "llama-b"] and source.lists == lists
        # The API server is back, the watch not yet: polling sees changes without any event.
        lister.fail = False
        del objects[2]  # llama-b is gone
        await until(lambda: list(router.pools["llama"].pods) == ["llama-a"])
        assert source.lists > lists
        pods.fail = False  # reconnects: events again, no more polling
        await until(lambda: source.watching)
        await asyncio.sleep(0.2)
        settled = source.lists
        await asyncio.sleep(0.3)
        assert source.lists == settled
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
