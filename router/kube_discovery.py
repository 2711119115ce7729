"""Kubernetes discovery: each InferenceModel's Ready pods in a namespace, and its routing policy.

`model_endpoints()` is the pure part: InferenceModels + pods -> {served name: (endpoints, policy,
fallback model)}.
`KubeSource` lists both every `interval_s` through the Kube adapter (a list, not a watch: the adapter
has no watch yet, and a 1 s list of one namespace is cheap) and tells the router what changed. A
failed list keeps every endpoint already known: an API-server hiccup never empties a model.
The adapter sits behind the `Kube`-like `Lister` protocol so it can move to a shared layer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvpilot.api.models import API_VERSION, KIND, MODEL_LABEL
from kvpilot.router.pool import Endpoint
from kvpilot.router.server import UpdateEndpoints

log = logging.getLogger("kvpilot.router.kube")

HTTP_PORT = 8000
DEFAULT_CAPACITY = 64  # the runtime's default --max-num-seqs

ModelTable = dict[str, tuple[list[Endpoint], str | None, str | None]]


class Lister(Protocol):
    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]: ...


def _is_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating: draining, takes no new requests
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _port(pod: Mapping[str, Any]) -> int:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return HTTP_PORT


def model_endpoints(
    models: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    default_capacity: int = DEFAULT_CAPACITY,
) -> ModelTable:
    """{served model name: (Ready pods as endpoints, spec.routing.policy, spec.routing.fallbackModel)}."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        owner = (pod.get("metadata", {}).get("labels") or {}).get(MODEL_LABEL)
        if owner and _is_ready(pod):
            by_model.setdefault(owner, []).append(pod)
    table: ModelTable = {}
    for im in models:
        name = im["metadata"]["name"]
        spec = im.get("spec") or {}
        served = (spec.get("model") or {}).get("servedName") or name
        capacity = int((spec.get("runtime") or {}).get("maxNumSeqs") or default_capacity)
        # an OOM adaptation that lowered maxNumSeqs is what the pods run now
        oom = ((im.get("status") or {}).get("oomAdaptation") or {}).get("overrides") or {}
        if oom.get("maxNumSeqs"):
            capacity = min(capacity, int(oom["maxNumSeqs"]))
        endpoints = sorted(
            (
                Endpoint(p["metadata"]["name"], f"http://{p['status']['podIP']}:{_port(p)}", capacity)
                for p in by_model.get(name, [])
            ),
            key=lambda e: e.name,
        )
        routing = spec.get("routing") or {}
        table[served] = (endpoints, routing.get("policy"), routing.get("fallbackModel"))
    return table


class KubeSource:
    def __init__(self, kube: Lister, namespace: str, interval_s: float = 1.0) -> None:
        self.kube = kube
        self.namespace = namespace
        self.interval_s = interval_s
        self.known: ModelTable = {}

    def _list(self) -> ModelTable:
        models = self.kube.list(API_VERSION, KIND, self.namespace)
        pods = self.kube.list("v1", "Pod", self.namespace, MODEL_LABEL) if models else []
        return model_endpoints(models, pods)

    def apply(self, table: ModelTable, update: UpdateEndpoints) -> None:
        for model, (endpoints, policy, fallback) in table.items():
            if self.known.get(model) != (endpoints, policy, fallback):
                update(model, endpoints, policy, fallback)
        for model in self.known.keys() - table.keys():
            update(model, None)  # the InferenceModel was deleted
        self.known = table

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None:
        first = True
        while True:
            try:
                table = await asyncio.to_thread(self._list)
            except Exception as e:  # the adapter already retried; keep what is known and try again
                log.warning(
                    "listing %s failed (%s); keeping %d models' endpoints", self.namespace, e, len(self.known)
                )
            else:
                self.apply(table, update)
                if first:
                    synced()
                    first = False
            await asyncio.sleep(self.interval_s)


def kube_source(namespace: str | None, kubeconfig: str | None = None) -> KubeSource:
    """A KubeSource on the shared Kube adapter (in-cluster or kubeconfig)."""
    from kvpilot.kube.client import ApiKube, load_api_client

    if not namespace:
        raise ValueError("--namespace is required without --endpoints (which namespace's models to route)")
    return KubeSource(ApiKube(load_api_client(kubeconfig)), namespace)
