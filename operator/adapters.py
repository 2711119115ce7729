"""Bring the LoRA adapters of running pods in line with spec.adapters, without restarting them.

The adapter list is left out of the pods' config hash (builders.rollout_config_yaml), so editing
spec.adapters changes the ConfigMap but not the pod template when the running pods can reach the new
adapter's files. Each reconcile then asks every Ready pod which adapters it serves (GET /v1/models,
the cards with a `parent`; their `lora_path_sha256` says which folder each came from, the runtime
never shows the path) and loads or unloads the difference through the runtime's
/v1/load_lora_adapter and /v1/unload_lora_adapter.

Which adapters a running pod can load (`live_loadable`): a file:// adapter (a path in the image), and
a pvc:// adapter whose claim the pod already mounts (another adapter of the same claim). A pvc://
adapter on a new claim needs a volume and an hf:// adapter needs its init container's download, so
those change the pod template and the pods roll; a pod waiting for that roll reports it as pending,
never as a failure.

`plan()` is the pure decision; `sync_adapters()` the thin I/O shell: short timeouts, one overall
deadline per reconcile, and every failure returned (pod and adapter named) for the status, never raised.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvpilot.api.models import InferenceModel, LoRAAdapter
from kvpilot.operator.builders import (
    API_KEY_ENV,
    CONFIG_HASH_ANNOTATION,
    HTTP_PORT,
    adapter_claim_volume,
    adapter_path,
)
from kvpilot.runtime.lora.request import path_digest

LIST_TIMEOUT_S = 3.0
LOAD_TIMEOUT_S = 30.0  # reading an adapter's safetensors from a volume
SYNC_DEADLINE_S = 20.0  # per reconcile; pods not reached by then wait for the next one


@dataclass(frozen=True)
class AdapterAction:
    op: Literal["load", "unload"]
    name: str
    path: str = ""


@dataclass(frozen=True)
class PodPlan:
    actions: tuple[AdapterAction, ...]
    pending: tuple[str, ...]  # desired here but needs a new pod (a new volume or an hf:// download)


def desired_adapters(im: InferenceModel) -> dict[str, str]:
    """name -> the folder the runtime loads it from inside the pod."""
    return {a.name: adapter_path(a) for a in im.spec.adapters or []}


def live_loadable(adapter: LoRAAdapter, pod: dict[str, Any]) -> bool:
    """Whether a running pod can reach this adapter's files (see the module docstring)."""
    scheme, _, rest = adapter.source.partition("://")
    if scheme == "file":
        return True
    if scheme == "pvc":
        volume = adapter_claim_volume(rest.partition("/")[0])
        return any(v.get("name") == volume for v in (pod.get("spec") or {}).get("volumes") or [])
    return False  # hf://: only the init container at pod start downloads it


def plan(desired: dict[str, str], loadable: set[str], reported: dict[str, str]) -> PodPlan:
    """What one pod must do: unload what is not desired (or is loaded from another folder), then load
    what is desired, missing and reachable. `reported` is name -> the SHA-256 of its folder as the pod
    lists it (`parse_models`)."""
    actions: list[AdapterAction] = []
    pending: list[str] = []
    wanted = {name: path_digest(path) for name, path in desired.items()}
    for name in sorted(reported):
        if name not in desired or reported[name] != wanted[name]:
            actions.append(AdapterAction("unload", name))
    for name in sorted(desired):
        if reported.get(name) == wanted[name]:
            continue
        if name in loadable:
            actions.append(AdapterAction("load", name, desired[name]))
        else:
            pending.append(name)
    return PodPlan(tuple(actions), tuple(pending))


def parse_models(body: Any) -> dict[str, str]:
    """The adapters in a /v1/models answer: cards with a `parent`, name -> the SHA-256 of the folder it
    was loaded from (`lora_path_sha256`; from `root`, the path itself, for runtimes that still show it)."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("/v1/models did not answer with an OpenAI model list")
    return {
        str(card["id"]): source_digest(card)
        for card in body["data"]
        if isinstance(card, dict) and card.get("parent") and "id" in card
    }


def source_digest(card: dict[str, Any]) -> str:
    """Pure: which folder an adapter card says it came from, as `path_digest` ("" when it does not say)."""
    if card.get("lora_path_sha256"):
        return str(card["lora_path_sha256"])
    return path_digest(str(card["root"])) if card.get("root") else ""


def pod_is_ready(pod: dict[str, Any]) -> bool:
    md, status = pod.get("metadata") or {}, pod.get("status") or {}
    if md.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


# -- the I/O shell ------------------------------------------------------------------------------


class AdapterClient(Protocol):
    def list(self, host: str, api_key: str | None) -> dict[str, str]: ...

    def load(self, host: str, api_key: str | None, name: str, path: str) -> None: ...

    def unload(self, host: str, api_key: str | None, name: str) -> None: ...


class HttpAdapterClient:
    """The runtime's adapter endpoints on http://HOST:PORT (urllib; the reconcile runs in a thread)."""

    def __init__(self, port: int = HTTP_PORT) -> None:
        self.port = port

    def _call(self, host: str, api_key: str | None, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://{host}:{self.port}{path}", data=data, method="GET" if body is None else "POST"
        )
        req.add_header("Content-Type", "application/json")
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {_error_message(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"unreachable: {getattr(e, 'reason', e)}") from None

    def list(self, host: str, api_key: str | None) -> dict[str, str]:
        return parse_models(self._call(host, api_key, "/v1/models", None, LIST_TIMEOUT_S))

    def load(self, host: str, api_key: str | None, name: str, path: str) -> None:
        self._call(
            host, api_key, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, LOAD_TIMEOUT_S
        )

    def unload(self, host: str, api_key: str | None, name: str) -> None:
        self._call(host, api_key, "/v1/unload_lora_adapter", {"lora_name": name}, LOAD_TIMEOUT_S)


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read())["error"]["message"])
    except Exception:
        return str(e.reason)


@dataclass
class AdapterSync:
    """What one sync saw and did: per pod the adapters it serves afterwards, failures, pending."""

    loaded: dict[str, set[str]] = field(default_factory=dict)  # pod -> adapters it serves
    failures: list[str] = field(default_factory=list)  # "pod P: load adapter A: why"
    pending: dict[str, list[str]] = field(default_factory=dict)  # pod -> adapters waiting for a roll
    changed: list[str] = field(default_factory=list)  # "pod P: load A"


def api_key_of(im: InferenceModel, read_secret: Any) -> str | None:
    """The runtime's API key from spec.env KVPILOT_API_KEY (a value, or a secretKeyRef read with
    `read_secret(name) -> secret dict | None`)."""
    for var in im.spec.env or []:
        if var.name != API_KEY_ENV:
            continue
        if var.value is not None:
            return var.value
        ref = (var.value_from or {}).get("secretKeyRef") or {}
        if not ref.get("name") or not ref.get("key"):
            raise RuntimeError(f"spec.env {API_KEY_ENV}: only value or valueFrom.secretKeyRef is supported")
        secret = read_secret(ref["name"])
        raw = ((secret or {}).get("data") or {}).get(ref["key"])
        if raw is None:
            raise RuntimeError(f"secret {ref['name']} has no key {ref['key']!r} (spec.env {API_KEY_ENV})")
        return base64.b64decode(raw).decode().strip()
    return None


def sync_adapters(
    im: InferenceModel,
    pods: list[dict[str, Any]],
    client: AdapterClient,
    api_key: str | None,
    config_hash: str,
    deadline_s: float = SYNC_DEADLINE_S,
) -> AdapterSync:
    """List every Ready pod's adapters; load/unload on the pods of the current config (older pods are
    being replaced by the rollout). Never raises for a pod's trouble: it is a failure in the result."""
    out = AdapterSync()
    desired = desired_adapters(im)
    by_name = {a.name: a for a in im.spec.adapters or []}
    stop_at = time.monotonic() + deadline_s
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if not pod_is_ready(pod):
            continue
        name = pod["metadata"]["name"]
        if time.monotonic() > stop_at:
            out.failures.append(
                f"pod {name}: not checked within {deadline_s:.0f}s; retried on the next reconcile"
            )
            continue
        host = pod["status"]["podIP"]
        try:
            reported = client.list(host, api_key)
        except Exception as e:
            out.failures.append(f"pod {name}: list adapters: {e}")
            continue
        served = set(reported)
        current = (pod["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION) == config_hash
        if current:
            loadable = {n for n, a in by_name.items() if live_loadable(a, pod)}
            pod_plan = plan(desired, loadable, reported)
            if pod_plan.pending:
                out.pending[name] = list(pod_plan.pending)
            for action in pod_plan.actions:
                if time.monotonic() > stop_at:
                    out.failures.append(
                        f"pod {name}: {action.op} adapter {action.name}: not done within {deadline_s:.0f}s; "
                        "retried on the next reconcile"
                    )
                    continue
                try:
                    if action.op == "load":
                        client.load(host, api_key, action.name, action.path)
                        served.add(action.name)
                    else:
                        client.unload(host, api_key, action.name)
                        served.discard(action.name)
                    out.changed.append(f"pod {name}: {action.op} {action.name}")
                except Exception as e:
                    out.failures.append(f"pod {name}: {action.op} adapter {action.name}: {e}")
        out.loaded[name] = served
    return out


def adapters_status(im: InferenceModel, sync: AdapterSync) -> list[dict[str, Any]]:
    """status.adapters: each spec adapter with how many Ready replicas serve it and which do not."""
    rows = []
    for adapter in im.spec.adapters or []:
        missing = sorted(pod for pod, names in sync.loaded.items() if adapter.name not in names)
        row: dict[str, Any] = {
            "name": adapter.name,
            "loadedReplicas": sum(1 for names in sync.loaded.values() if adapter.name in names),
        }
        if missing:
            row["missingOn"] = missing[:16]
        rows.append(row)
    return rows
