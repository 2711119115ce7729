"""Live adapter changes: the pure plan per pod, and whole reconciles against a real `kvpilot serve`
process started from the config the operator renders (tiny random Llama, PEFT adapters built here)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.api.models import API_VERSION, KIND, InferenceModel
from kvpilot.net import free_port
from kvpilot.operator.adapters import (
    AdapterSync,
    HttpAdapterClient,
    api_key_of,
    live_loadable,
    parse_models,
    plan,
    sync_adapters,
)
from kvpilot.operator.builders import (
    CONFIG_HASH_ANNOTATION,
    OperatorSettings,
    adapter_claim_volume,
    render_config_yaml,
)
from kvpilot.operator.reconcile import Reconciler
from kvpilot.operator.status import adapters_condition
from kvpilot.runtime.lora.request import path_digest
from tests.needs import require_module
from tests.operator.fakes import FakeKube, make_body
from tests.router.test_real_pods import wait_ready

KEY = "adapter-sync-key"


# -- the pure decision ---------------------------------------------------------------------------


def test_plan_loads_missing_unloads_extra_and_reloads_a_moved_adapter() -> None:
    desired = {"sql": "/a/sql", "chat": "/a/chat", "far": "/adapters/far"}
    reported = {"old": path_digest("/a/old"), "chat": path_digest("/a/chat-v1")}  # as parse_models says
    p = plan(desired, loadable={"sql", "chat"}, reported=reported)
    assert [(a.op, a.name, a.path) for a in p.actions] == [
        ("unload", "chat", ""),
        ("unload", "old", ""),
        ("load", "chat", "/a/chat"),
        ("load", "sql", "/a/sql"),
    ]
    assert p.pending == ("far",)  # desired but needs a new pod: waits for the rollout, no load
    every = {name: path_digest(path) for name, path in desired.items()}
    assert plan(desired, {"sql", "chat", "far"}, every).actions == ()
    assert plan({}, set(), {"x": path_digest("/x")}).actions[0].op == "unload"


def test_live_loadable_follows_what_the_pod_mounts() -> None:
    model = InferenceModel.model_validate(
        make_body(
            adapters=[
                {"name": "a", "source": "pvc://claim-a/x"},
                {"name": "b", "source": "pvc://claim-b/x"},
                {"name": "f", "source": "file:///opt/f"},
                {"name": "h", "source": "hf://org/h"},
            ]
        )
    )
    pod = {"spec": {"volumes": [{"name": adapter_claim_volume("claim-a"), "persistentVolumeClaim": {}}]}}
    loadable = {a.name for a in model.spec.adapters or [] if live_loadable(a, pod)}
    assert loadable == {"a", "f"}


def test_parse_models_keeps_only_adapter_cards() -> None:
    """Adapters and the folder each came from: the runtime shows its SHA-256, never the path; a card
    with `root` (a runtime from before that) is read the same way."""
    body = {
        "object": "list",
        "data": [
            {"id": "base", "root": "/m"},
            {"id": "sql", "lora_path_sha256": path_digest("/a/sql"), "parent": "base"},
            {"id": "old", "root": "/a/old", "parent": "base"},
        ],
    }
    assert parse_models(body) == {"sql": path_digest("/a/sql"), "old": path_digest("/a/old")}
    with pytest.raises(ValueError, match="model list"):
        parse_models({"error": "nope"})


def test_api_key_from_a_value_or_a_secret() -> None:
    def model(env: list[dict[str, Any]]) -> InferenceModel:
        return InferenceModel.model_validate(make_body(env=env))

    assert api_key_of(model([{"name": "KVPILOT_API_KEY", "value": "v"}]), lambda _: None) == "v"
    ref = {"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    secret = {"data": {"k": base64.b64encode(b"from-secret\n").decode()}}
    assert api_key_of(model([ref]), lambda name: secret if name == "s" else None) == "from-secret"
    with pytest.raises(RuntimeError, match="secret s has no key 'k'"):
        api_key_of(model([ref]), lambda _: None)
    assert api_key_of(model([]), lambda _: None) is None


def test_condition_names_the_pod_and_adapter_that_failed() -> None:
    failed = adapters_condition(
        AdapterSync(loaded={"p": set()}, failures=["pod p: load adapter x: HTTP 400: bad"])
    )
    assert (failed.status, failed.reason) == (False, "AdapterLoadFailed")
    assert "pod p" in failed.message and "adapter x" in failed.message
    waiting = adapters_condition(AdapterSync(loaded={"p": set()}, pending={"p": ["h"]}))
    assert (waiting.status, waiting.reason) == (False, "WaitingForRollout")
    ok = adapters_condition(AdapterSync(loaded={"p": {"x"}}))
    assert (ok.status, ok.reason) == (True, "AllLoaded")


def test_an_unreachable_pod_is_a_failure_naming_it_not_an_exception() -> None:
    model = InferenceModel.model_validate(make_body(adapters=[{"name": "f", "source": "file:///opt/f"}]))
    pod = {
        "metadata": {"name": "llama-0", "annotations": {CONFIG_HASH_ANNOTATION: "h"}},
        "spec": {},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    not_ready = {**pod, "metadata": {"name": "llama-1"}, "status": {"podIP": "127.0.0.2"}}
    sync = sync_adapters(model, [pod, not_ready], HttpAdapterClient(port=free_port()), None, "h")
    assert len(sync.failures) == 1
    assert sync.failures[0].startswith("pod llama-0: list adapters: unreachable")
    assert sync.loaded == {}  # neither pod counts as serving anything


def test_adapters_without_ready_pods_settle_and_a_second_reconcile_writes_nothing() -> None:
    kube = FakeKube()
    kube.put(make_body(adapters=[{"name": "f", "source": "file:///opt/f"}]))
    reconciler = Reconciler(kube, OperatorSettings())
    body = kube.get(API_VERSION, KIND, "ml", "llama")
    assert body is not None
    reconciler.reconcile(body)
    body = kube.get(API_VERSION, KIND, "ml", "llama")
    assert body is not None
    assert body["status"]["adapters"] == [{"name": "f", "loadedReplicas": 0}]
    cond = next(c for c in body["status"]["conditions"] if c["type"] == "AdaptersLoaded")
    assert (cond["status"], cond["reason"]) == ("False", "NoReadyReplicas")
    assert not reconciler.reconcile(body).wrote


# -- whole reconciles against a real runtime ------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_module("peft", "pip install -e .[test]")
    from tests.runtime.test_lora import ADAPTERS, random_llama, write_adapter, write_base

    root = tmp_path_factory.mktemp("adapter-sync")
    write_base(root / "base")
    for i, name in enumerate(("sql", "chat")):
        rank, alpha, rslora, targets = ADAPTERS[name]
        write_adapter(random_llama(), root / name, rank, alpha, rslora, targets, seed=300 + i)
    return root


def spec_adapters(workdir: Path, *names: str) -> list[dict[str, str]]:
    return [{"name": n, "source": f"file://{workdir / n}"} for n in names]


KEY_ENV = [{"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "rt", "key": "key"}}}]


def model_body(workdir: Path, *adapters: str, env: list[dict[str, Any]] = KEY_ENV) -> dict[str, Any]:
    body = make_body(name="tiny", env=env, adapters=spec_adapters(workdir, *adapters))
    body["spec"]["model"] = {"source": f"file://{workdir / 'base'}"}
    return body


@contextlib.contextmanager
def serve_rendered(
    workdir: Path, body: dict[str, Any], api_key: str | None, tag: str
) -> Iterator[tuple[int, Path]]:
    """`kvpilot serve --config` with the config the operator renders for `body` (CPU-sized), and the
    pod's KVPILOT_API_KEY (None: none). Yields the port and the server's log."""
    config = yaml.safe_load(render_config_yaml(InferenceModel.model_validate(body)))
    assert config["enable_lora_runtime_updates"] is True
    port = free_port()
    config.update(
        host="127.0.0.1",
        device="cpu",
        port=port,
        threads=1,
        dtype="float32",
        kv_cache_memory=4 << 20,
        block_size=8,
        max_loras=2,
    )
    (workdir / f"config-{tag}.yaml").write_text(yaml.safe_dump(config))
    log = workdir / f"serve-{tag}.log"
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_API_KEY"} | {"OMP_NUM_THREADS": "1"}
    if api_key is not None:
        env["KVPILOT_API_KEY"] = api_key
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpilot", "serve", "--config", str(workdir / f"config-{tag}.yaml")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_ready(port, proc, log)
        yield port, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runtime(workdir: Path) -> Iterator[int]:
    """The runtime of a model with adapter `sql` and an API key from a Secret."""
    with serve_rendered(workdir, model_body(workdir, "sql"), KEY, "key") as (port, _):
        yield port


def served(port: int) -> set[str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return set(parse_models(json.loads(r.read())))


def test_adapter_edits_load_into_the_running_pod_without_a_roll(workdir: Path, runtime: int) -> None:
    kube = FakeKube()
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "rt", "namespace": "ml"},
            "data": {"key": base64.b64encode(KEY.encode()).decode()},
        }
    )
    reconciler = Reconciler(kube, OperatorSettings(), adapter_client=HttpAdapterClient(port=runtime))

    def reconcile(*adapters: str) -> dict[str, Any]:
        kube.put(model_body(workdir, *adapters) | {"status": (current() or {}).get("status", {})})
        body = current()
        assert body is not None
        reconciler.reconcile(body)
        after = current()
        assert after is not None
        return after

    def current() -> dict[str, Any] | None:
        return kube.get(API_VERSION, KIND, "ml", "tiny")

    def template() -> dict[str, Any]:
        deployment = kube.get("apps/v1", "Deployment", "ml", "tiny")
        assert deployment is not None
        return dict(deployment["spec"]["template"])

    def condition(body: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in body["status"]["conditions"] if c["type"] == "AdaptersLoaded")

    # The first reconcile creates the Deployment; the "pod" is the real runtime on 127.0.0.1.
    body = reconcile("sql")
    pod_template = template()
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "tiny-0",
                "namespace": "ml",
                "labels": pod_template["metadata"]["labels"],
                "annotations": {
                    CONFIG_HASH_ANNOTATION: pod_template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
                },
            },
            "spec": pod_template["spec"],
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    body = reconcile("sql")
    assert body["status"]["adapters"] == [{"name": "sql", "loadedReplicas": 1}]
    assert condition(body)["status"] == "True"

    # Swap sql for chat: the pod template stays, the running process unloads one and loads the other.
    body = reconcile("chat")
    assert template() == pod_template
    assert served(runtime) == {"chat"}
    assert body["status"]["adapters"] == [{"name": "chat", "loadedReplicas": 1}]

    # An adapter the runtime refuses: a condition and one Event naming pod and adapter, the rest still served.
    (workdir / "broken").mkdir(exist_ok=True)
    events_before = len(kube.events)
    body = reconcile("chat", "broken")
    cond = condition(body)
    assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
    assert "pod tiny-0" in cond["message"] and "adapter broken" in cond["message"]
    assert body["status"]["adapters"] == [
        {"name": "chat", "loadedReplicas": 1},
        {"name": "broken", "loadedReplicas": 0, "missingOn": ["tiny-0"]},
    ]
    new_events = kube.events[events_before:]
    assert [e["reason"] for e in new_events] == ["AdapterLoadFailed"]
    reconcile("chat", "broken")  # the same failure again: no new Event, no exception
    assert len(kube.events) == events_before + 1
    assert served(runtime) == {"chat"}

    # Fixing the spec clears the condition (and says so once).
    body = reconcile("chat", "sql")
    assert condition(body)["status"] == "True"
    assert served(runtime) == {"chat", "sql"}
    assert kube.events[-1]["reason"] == "AdaptersLoaded"
    assert template() == pod_template


def test_a_model_without_an_api_key_still_takes_live_adapter_loads(workdir: Path) -> None:
    """Without KVPILOT_API_KEY the runtime refuses adapter loads (403) unless its config opts in: the
    config the operator renders for such a model does, so the operator's keyless loads still work,
    and the runtime warns about it at start."""
    with serve_rendered(workdir, model_body(workdir, "sql", env=[]), None, "nokey") as (port, log):
        model = InferenceModel.model_validate(model_body(workdir, "sql", "chat", env=[]))
        pod = {
            "metadata": {"name": "tiny-0", "annotations": {CONFIG_HASH_ANNOTATION: "h"}},
            "spec": {},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        sync = sync_adapters(model, [pod], HttpAdapterClient(port=port), api_key_of(model, None), "h")
        assert sync.failures == [] and sync.changed == ["pod tiny-0: load chat"]
        assert served(port) == {"sql", "chat"}
        assert "WARNING kvpilot.serve: --allow-lora-updates-without-api-key" in log.read_text()
