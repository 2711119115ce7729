"""The hf:// fetch init containers, run: the rendered command and environment against a Hub stand-in.

test_builders.py checks what the operator renders; here the init container's own command (its
FETCH_SCRIPT, the real huggingface_hub client) runs as a subprocess with the environment the pod
would get, the Hub being e2e/hub_standin.py at the HF_ENDPOINT that spec.env names (a cluster's Hub
mirror). The container's /models, /adapters and /tmp are folders of the test; `secretKeyRef` values
are resolved from a dict, as the kubelet resolves them from the Secret.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.hub_standin import HubStandin
from kvpilot.api.models import InferenceModel
from kvpilot.operator.builders import ADAPTERS_DIR, MODELS_DIR, model_path
from kvpilot.runtime.load.loader import resolve_model_path
from tests.operator.test_builders import im, pod_spec

TOKEN = "hf_standin_token"
SECRETS = {("hf", "token"): TOKEN}
GGUF_FILES = ("tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny.Q8_0.gguf")
SPLIT_Q6_K = ("Q6_K/big-Q6_K-00001-of-00002.gguf", "Q6_K/big-Q6_K-00002-of-00002.gguf")


@pytest.fixture
def repos(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "hub" / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    (model / "sub" / "weights.bin").write_bytes(os.urandom(3 << 20))  # several of the client's chunks
    adapter = tmp_path / "hub" / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}\n')
    gguf = tmp_path / "hub" / "gguf"  # a GGUF repository: one model in several quantizations
    gguf.mkdir()
    (gguf / "README.md").write_text("# tiny GGUF\n")
    for name in GGUF_FILES:
        (gguf / name).write_bytes(os.urandom(1 << 16))
    big = tmp_path / "hub" / "big"  # a quantization split into parts, in a folder of its own
    (big / "Q6_K").mkdir(parents=True)
    for name in ("big-Q4_K_M.gguf", *SPLIT_Q6_K):
        (big / name).write_bytes(os.urandom(1 << 16))
    return {"org/tiny": model, "org/tiny-lora": adapter, "org/tiny-GGUF": gguf, "org/big-GGUF": big}


def _env(container: dict[str, Any], root: Path) -> dict[str, str]:
    out = {"PATH": os.environ.get("PATH", ""), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for var in container["env"]:
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            out[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        else:
            out[var["name"]] = _local(var["value"], root)
    return out


def _local(path: str, root: Path) -> str:
    """A path in the container -> the test's folder for it."""
    for mount in (MODELS_DIR, ADAPTERS_DIR, "/tmp"):
        if path == mount or path.startswith(mount + "/"):
            return str(root / mount.strip("/")) + path[len(mount) :]
    return path


def run_init(container: dict[str, Any], root: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *(_local(a, root) for a in container["command"][1:])]
    for mount in container["volumeMounts"]:
        Path(_local(mount["mountPath"], root)).mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, env=_env(container, root), capture_output=True, text=True, timeout=120)


def model(hub: HubStandin, source: str, **spec: Any) -> InferenceModel:
    return im(
        model={"source": source, "hfTokenSecret": {"name": "hf", "key": "token"}},
        env=[{"name": "HF_ENDPOINT", "value": hub.url}],
        **spec,
    )


def same_tree(got: Path, want: Path) -> None:
    files = sorted(p.relative_to(want) for p in want.rglob("*") if p.is_file())
    assert files, want
    for rel in files:
        assert (got / rel).read_bytes() == (want / rel).read_bytes(), rel


def test_a_mirror_that_never_answers_fails_the_fetch_after_the_stall_limit(tmp_path: Path) -> None:
    """An HF_ENDPOINT that accepts connections and never replies (a stalled proxy or mirror): the
    client's listing call has no timeout, so without the watchdog the pod stays in Init forever. With
    KVPILOT_FETCH_STALL_S=2 (spec.env) the init container exits 1 in seconds, saying why."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in range(8)], daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    spec = im(
        model={"source": "hf://org/tiny"},
        env=[{"name": "HF_ENDPOINT", "value": url}, {"name": "KVPILOT_FETCH_STALL_S", "value": "2"}],
    )
    (init,) = pod_spec(spec)["initContainers"]
    started = time.monotonic()
    done = run_init(init, tmp_path / "pod")
    took = time.monotonic() - started
    server.close()
    assert held  # the client did connect, and waited
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"hf://org/tiny: no progress for 2s from {url} (0 bytes written); giving up" in done.stderr
    assert took < 60, took
    bad = im(model={"source": "hf://org/tiny"}, env=[{"name": "KVPILOT_FETCH_STALL_S", "value": "2m"}])
    done = run_init(pod_spec(bad)["initContainers"][0], tmp_path / "pod2")
    assert done.returncode == 1 and "KVPILOT_FETCH_STALL_S: expected seconds > 0, got '2m'" in done.stderr


@pytest.mark.parametrize("pin", ["", "@main", "@commit"])
def test_fetch_init_container_downloads_the_model_from_the_mirror_spec_env_names(
    tmp_path: Path, repos: dict[str, Path], pin: str
) -> None:
    with HubStandin(repos, token=TOKEN) as hub:
        if pin == "@commit":
            pin = f"@{hub.commit('org/tiny')}"
        (init,) = pod_spec(model(hub, f"hf://org/tiny{pin}"))["initContainers"]
        done = run_init(init, tmp_path / "pod")
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"/org/tiny/resolve/{hub.commit('org/tiny')}/sub/weights.bin" in " ".join(hub.requests)
    same_tree(tmp_path / "pod" / "models" / "org--tiny", repos["org/tiny"])


def test_fetch_init_container_for_an_adapter_gets_the_same_environment(
    tmp_path: Path, repos: dict[str, Path]
) -> None:
    with HubStandin(repos, token=TOKEN) as hub:
        spec = pod_spec(
            model(hub, "hf://org/tiny", adapters=[{"name": "tone", "source": "hf://org/tiny-lora"}])
        )
        fetch_model, fetch_adapter = spec["initContainers"]
        assert fetch_adapter["name"] == "fetch-adapter-0"
        for init in (fetch_model, fetch_adapter):
            done = run_init(init, tmp_path / "pod")
            assert done.returncode == 0, done.stderr[-2000:]
    same_tree(tmp_path / "pod" / "adapters" / "tone", repos["org/tiny-lora"])
    same_tree(tmp_path / "pod" / "models" / "org--tiny", repos["org/tiny"])


@pytest.mark.parametrize(
    ("source", "token", "says"),
    [
        ("hf://org/tiny@v9", TOKEN, "v9"),  # a revision the repository does not have
        ("hf://org/missing", TOKEN, "org/missing"),
        ("hf://org/tiny", "hf_wrong", "401"),  # the Secret holds a token the Hub refuses
    ],
)
def test_fetch_init_container_fails_the_pod_start_with_a_message_that_names_the_problem(
    tmp_path: Path, repos: dict[str, Path], source: str, token: str, says: str
) -> None:
    with HubStandin(repos, token=token) as hub:
        (init,) = pod_spec(model(hub, source))["initContainers"]
        done = run_init(init, tmp_path / "pod")
    assert done.returncode != 0  # the init container fails: the pod does not start on missing weights
    assert says in done.stderr
    assert not list((tmp_path / "pod" / "models").rglob("weights.bin"))


@pytest.mark.parametrize(("quant", "file"), [("Q4_K_M", "tiny-Q4_K_M.gguf"), ("q8_0", "tiny.Q8_0.gguf")])
def test_quant_fetches_only_that_gguf_and_the_runtime_loads_it_from_the_folder(
    tmp_path: Path, repos: dict[str, Path], quant: str, file: str
) -> None:
    source = f"hf://org/tiny-GGUF:{quant}"
    with HubStandin(repos, token=TOKEN) as hub:
        (init,) = pod_spec(model(hub, source))["initContainers"]
        done = run_init(init, tmp_path / "pod")
        assert done.returncode == 0, done.stderr[-2000:]
        fetched = [r for r in hub.requests if r.startswith("GET /org/tiny-GGUF/resolve/")]
    assert [r.rsplit("/", 1)[-1] for r in fetched] == [file]  # not the other quantizations
    folder = Path(_local(model_path(source), tmp_path / "pod"))
    assert (folder / file).read_bytes() == (repos["org/tiny-GGUF"] / file).read_bytes()
    assert resolve_model_path(folder) == folder / file  # the runtime's --model is the folder


def test_quant_fetches_every_part_of_a_split_model_and_the_runtime_opens_the_first(
    tmp_path: Path, repos: dict[str, Path]
) -> None:
    """A large quantization is published in parts (the Hub's 50 GB file limit): :Q6_K is the two parts,
    not the other quantization; a repository of one split model and no config.json is that model."""
    with HubStandin(repos, token=TOKEN) as hub:
        (init,) = pod_spec(model(hub, "hf://org/big-GGUF:Q6_K"))["initContainers"]
        done = run_init(init, tmp_path / "pod")
        assert done.returncode == 0, done.stderr[-2000:]
        fetched = sorted(
            r.rsplit("/resolve/", 1)[-1] for r in hub.requests if r.startswith("GET /org/big-GGUF/resolve/")
        )
    assert [f.split("/", 1)[-1] for f in fetched] == list(SPLIT_Q6_K)
    folder = Path(_local(model_path("hf://org/big-GGUF:Q6_K"), tmp_path / "pod"))
    assert resolve_model_path(folder) == folder / SPLIT_Q6_K[0]
    without = tmp_path / "hub" / "split-only"
    (without / "Q6_K").mkdir(parents=True)
    for name in SPLIT_Q6_K:
        shutil.copy(repos["org/big-GGUF"] / name, without / name)
    with HubStandin({"org/split-only": without}, token=TOKEN) as hub:
        (init,) = pod_spec(model(hub, "hf://org/split-only"))["initContainers"]
        done = run_init(init, tmp_path / "pod2")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("hf://org/tiny-GGUF", "hf://org/tiny-GGUF holds 3 .gguf models (tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny.Q8_0.gguf): "
         "name one as hf://org/tiny-GGUF:QUANT"),
        ("hf://org/tiny-GGUF:Q5_K_M", "hf://org/tiny-GGUF: 0 .gguf models end in -Q5_K_M.gguf or .Q5_K_M.gguf (none); the "
         "repository has: tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny.Q8_0.gguf"),
        ("hf://org/tiny-GGUF:Q4_K", "0 .gguf models end in -Q4_K.gguf"),  # a prefix of Q4_K_M and Q4_K_S picks neither
        ("hf://org/big-GGUF", "hf://org/big-GGUF holds 2 .gguf models (Q6_K/big-Q6_K-00001-of-00002.gguf, "
         "Q6_K/big-Q6_K-00002-of-00002.gguf, big-Q4_K_M.gguf)"),  # a split model counts once
    ],
)  # fmt: skip
def test_a_gguf_repository_without_one_file_named_is_refused_before_any_download(
    tmp_path: Path, repos: dict[str, Path], source: str, says: str
) -> None:
    with HubStandin(repos, token=TOKEN) as hub:
        (init,) = pod_spec(model(hub, source))["initContainers"]
        done = run_init(init, tmp_path / "pod")
        assert not [r for r in hub.requests if "/resolve/" in r]
    assert done.returncode != 0
    assert says in done.stderr
