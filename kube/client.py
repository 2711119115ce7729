"""The one door to the Kubernetes API for the operator, the autoscaler and the router: get, list,
server-side apply, merge patches (status, scale, pod annotations), create (Events), delete (an
InferencePool the operator no longer wants), ask whether an API group exists.

It speaks plain dicts (the manifests the builders produce) over the official client's ApiClient, so
there is no model conversion, and every call is retried with backoff on conflicts, throttling and
transient server or network errors. It blocks: async callers run it in a thread
(`asyncio.to_thread`). `Kube` is the Protocol of what the operator calls, so tests can use an
in-memory fake.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from tenacity import (
    retry,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from kvpilot.api.models import API_VERSION, KIND, PLURAL

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {409, 429, 500, 502, 503, 504}
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base


KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in [
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("v1", "Secret", "secrets"),  # read only: the runtime API key of models with adapters
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
        Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
        Kind("coordination.k8s.io/v1", "Lease", "leases"),
        Kind(API_VERSION, KIND, PLURAL),
    ]
}


def kind_of(api_version: str, kind: str) -> Kind:
    return KINDS[(api_version, kind)]


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in RETRYABLE_STATUS or exc.status == 0
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


_retry = retry(
    retry=retry_if_exception(is_retryable),
    wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.2),
    stop=stop_after_attempt(6),
    reraise=True,
)


class Kube(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]: ...

    def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]: ...

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]: ...

    def create(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    def has_api(self, group_version: str) -> bool: ...


class ApiKube:
    """`Kube` over a kubernetes.client.ApiClient (kubeconfig or in-cluster)."""

    def __init__(self, api_client: k8s.ApiClient, timeout: float = 30.0) -> None:
        self.api = api_client
        self.timeout = timeout
        if not api_client.configuration.verify_ssl:
            # The kubeconfig asked for it (insecure-skip-tls-verify); warning on every call is noise.
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        m, url, hdrs, data, post = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(
            m, url, header_params=hdrs, body=data, post_params=post, _request_timeout=self.timeout
        )
        resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data) if resp.data else {}

    @_retry
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", kind_of(api_version, kind).path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @_retry
    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", selector)] if selector else []
        body = self.request("GET", kind_of(api_version, kind).path(namespace), query=query)
        items: list[dict[str, Any]] = body.get("items", [])
        # List items carry no apiVersion/kind; restore them so callers see whole objects.
        for item in items:
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    @_retry
    def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        md = obj["metadata"]
        path = kind_of(obj["apiVersion"], obj["kind"]).path(md.get("namespace"), md["name"])
        return self.request(
            "PATCH",
            path,
            query=[("fieldManager", field_manager), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    @_retry
    def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch of the object (or of its `subresource`: status, scale)."""
        path = kind_of(api_version, kind).path(namespace, name, subresource)
        query = [("fieldManager", field_manager)] if field_manager else []
        return self.request("PATCH", path, query=query, body=patch, content_type=MERGE_PATCH)

    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch `.status` (the patch is for the status object itself) via the status subresource."""
        return self.merge_patch(
            api_version,
            kind,
            namespace,
            name,
            {"status": patch},
            subresource="status",
            field_manager=field_manager,
        )

    @_retry
    def create(self, obj: dict[str, Any], field_manager: str | None = None) -> dict[str, Any]:
        md = obj["metadata"]
        path = kind_of(obj["apiVersion"], obj["kind"]).path(md.get("namespace"))
        query = [("fieldManager", field_manager)] if field_manager else []
        return self.request("POST", path, query=query, body=obj, content_type="application/json")

    @_retry
    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete an object (gone already is fine); its dependents go through garbage collection."""
        try:
            self.request("DELETE", kind_of(api_version, kind).path(namespace, name))
        except ApiException as e:
            if e.status != 404:
                raise

    def has_api(self, group_version: str) -> bool:
        try:
            self.request("GET", f"/apis/{group_version}")
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """In-cluster config when running in a pod (and no kubeconfig given), else the kubeconfig."""
    from kubernetes import config

    configuration = k8s.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration)
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    return k8s.ApiClient(configuration)
