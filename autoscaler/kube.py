"""The few Kubernetes calls the autoscaler makes, behind a Protocol so the controller can be tested
against an in-memory fake. The real implementation runs the shared adapter (`kvpilot.kube.client`:
retries with backoff) in threads and always sends merge patches under the field manager
kvpilot-autoscaler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from kvpilot.api.models import API_VERSION, KIND
from kvpilot.kube.client import ApiKube
from kvpilot.kube.events import event_manifest

FIELD_MANAGER = "kvpilot-autoscaler"
USER_AGENT = "kvpilot-autoscaler"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

Obj = dict[str, Any]


def roles_patch(prefill: int, decode: int) -> Obj:
    """The merge patch that sizes both roles of a disaggregated model at once (one write: the two
    Deployments move as one unit; spec.replicas is not the autoscaler's there)."""
    return {"spec": {"disaggregation": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}}}


class KubeApi(Protocol):
    async def list_models(self, namespace: str | None) -> list[Obj]: ...

    async def list_pods(self, namespace: str, selector: str) -> list[Obj]: ...

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None: ...

    async def patch_roles(self, namespace: str, name: str, prefill: int, decode: int) -> None: ...

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None: ...

    async def create_event(
        self, namespace: str, involved: Obj, reason: str, message: str, event_type: str = "Normal"
    ) -> None: ...


class KubernetesApi:
    """KubeApi over the shared adapter. Construct with a kubernetes.client.ApiClient."""

    def __init__(self, api_client: Any) -> None:
        api_client.user_agent = USER_AGENT
        self.kube = ApiKube(api_client)

    async def list_models(self, namespace: str | None) -> list[Obj]:
        return await asyncio.to_thread(self.kube.list, API_VERSION, KIND, namespace or None)

    async def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        return await asyncio.to_thread(self.kube.list, "v1", "Pod", namespace, selector)

    async def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        await asyncio.to_thread(
            self.kube.merge_patch,
            API_VERSION,
            KIND,
            namespace,
            name,
            {"spec": {"replicas": replicas}},
            subresource="scale",
            field_manager=FIELD_MANAGER,
        )

    async def patch_roles(self, namespace: str, name: str, prefill: int, decode: int) -> None:
        await asyncio.to_thread(
            self.kube.merge_patch,
            API_VERSION,
            KIND,
            namespace,
            name,
            roles_patch(prefill, decode),
            field_manager=FIELD_MANAGER,
        )

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await asyncio.to_thread(
            self.kube.patch_status, API_VERSION, KIND, namespace, name, dict(status), FIELD_MANAGER
        )

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        await asyncio.to_thread(
            self.kube.merge_patch,
            "v1",
            "Pod",
            namespace,
            name,
            {"metadata": {"annotations": dict(annotations)}},
            field_manager=FIELD_MANAGER,
        )

    async def create_event(
        self, namespace: str, involved: Obj, reason: str, message: str, event_type: str = "Normal"
    ) -> None:
        event = event_manifest(
            involved,
            reason=reason,
            message=message,
            event_type=event_type,
            component=FIELD_MANAGER,
            reporting_component=FIELD_MANAGER,
            reporting_instance=FIELD_MANAGER,
        )
        event["metadata"]["namespace"] = namespace
        await asyncio.to_thread(self.kube.create, event, FIELD_MANAGER)
