"""The few Kubernetes calls the autoscaler makes, behind a Protocol so the controller can be tested
against an in-memory fake. The real implementation wraps the (synchronous) kubernetes client in
threads and always sends merge patches under the field manager kvpilot-autoscaler.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
PLURAL = "inferencemodels"
KIND = "InferenceModel"
FIELD_MANAGER = "kvpilot-autoscaler"
USER_AGENT = "kvpilot-autoscaler"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"

Obj = dict[str, Any]


class KubeApi(Protocol):
    async def list_models(self, namespace: str | None) -> list[Obj]: ...

    async def list_pods(self, namespace: str, selector: str) -> list[Obj]: ...

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None: ...

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None: ...

    async def create_event(
        self, namespace: str, involved: Obj, reason: str, message: str, event_type: str = "Normal"
    ) -> None: ...


def event_body(involved: Obj, reason: str, message: str, event_type: str, now: float | None = None) -> Obj:
    """A core/v1 Event about an InferenceModel, named like client-go's recorder does."""
    t = time.time() if now is None else now
    stamp = datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = involved.get("metadata", {})
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{time.time_ns():x}", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": event_type,
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "reportingInstance": FIELD_MANAGER,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def _drop_none(obj: Obj) -> Obj:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in obj.items() if v is not None}


class KubernetesApi:
    """KubeApi over the official client. Construct with a kubernetes.client.ApiClient."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        api_client.user_agent = USER_AGENT
        self._client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    @staticmethod
    def _json(resp: Any) -> Any:
        return json.loads(resp.data)

    async def list_models(self, namespace: str | None) -> list[Obj]:
        def call() -> Any:
            if namespace:
                return self._custom.list_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, _preload_content=False
                )
            return self._custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _preload_content=False)

        items: list[Obj] = self._json(await asyncio.to_thread(call)).get("items") or []
        return items

    async def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        resp = await asyncio.to_thread(
            self._core.list_namespaced_pod, namespace, label_selector=selector, _preload_content=False
        )
        items: list[Obj] = self._json(resp).get("items") or []
        return items

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        await asyncio.to_thread(
            self._custom.patch_namespaced_custom_object_scale,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"spec": {"replicas": replicas}},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
            _preload_content=False,  # the response is not used; skip the client's model validation
        )

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await asyncio.to_thread(
            self._custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": dict(status)},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
            _preload_content=False,  # the response is not used; skip the client's model validation
        )

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        await asyncio.to_thread(
            self._core.patch_namespaced_pod,
            name,
            namespace,
            {"metadata": {"annotations": dict(annotations)}},
            field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH,
            _preload_content=False,  # the response is not used; skip the client's model validation
        )

    async def create_event(
        self, namespace: str, involved: Obj, reason: str, message: str, event_type: str = "Normal"
    ) -> None:
        from kubernetes.client import CoreV1Event

        body = CoreV1Event.from_dict(_drop_none(event_body(involved, reason, message, event_type)))
        if body is None:
            raise ValueError("could not build the Event")
        await asyncio.to_thread(
            self._core.create_namespaced_event,
            namespace,
            body,
            field_manager=FIELD_MANAGER,
            _preload_content=False,
        )
