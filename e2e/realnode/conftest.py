"""The `realnode` e2e group: kvpilot's images as real pods on the cluster's real node (e2e/kubelet_node.py).

An explicit group, like the image tests: `./dev test-realnode` builds the images and runs it;
`KVPILOT_REALNODE=1` selects it (without it nothing here is collected, so `pytest e2e` stays the kwok
suite). Inside the group a missing tool (root, Debian's runc/CNI plugins/iptables/gcc, docker and its
daemon, the built images) skips locally and fails under CI=true (tests/needs.py).

Fixtures:
- `real_node` (session): `kubelet_node.up()` on the session's cluster; stopped at the end (pods deleted,
  kubelet and containerd stopped; images stay in containerd's root) unless KVPILOT_E2E_KEEP=1.
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
from e2e.harness import Cluster
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
