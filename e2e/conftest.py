"""Fixtures for e2e tests against the local control plane (see e2e/README.md).

- `cluster` (session): the running cluster, started through `e2e/cluster up` when needed.
- `kubectl`: the real kubectl bound to a fresh namespace that is deleted afterwards.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from e2e.harness import (
    CLUSTER,
    Cluster,
    ClusterUnavailable,
    Kubectl,
    binaries_built,
    build_allowed,
    release_cluster,
    start_cluster,
    wait_until,
)
from tests.needs import missing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    e2e_dir = CLUSTER.parent
    for item in items:
        if e2e_dir in item.path.parents:
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries (a one-time, tens-of-minutes job) before any test runs, outside the per-test
    timeout, with the build's output shown live."""
    selected = [item for item in session.items if item.get_closest_marker("e2e")]
    if not selected or not build_allowed() or binaries_built():
        return
    capture = session.config.pluginmanager.get_plugin("capturemanager")
    context = capture.global_and_fixture_disabled() if capture is not None else None
    print("\nbuilding the e2e control plane binaries (once; cached afterwards) ...", flush=True)
    if context is None:
        subprocess.run([str(CLUSTER), "build"], check=True)
        return
    with context:
        subprocess.run([str(CLUSTER), "build"], check=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    try:
        running = start_cluster()
    except ClusterUnavailable as exc:
        missing("the e2e control plane", str(exc))  # skips locally, fails under CI=true
    try:
        yield running
    finally:
        release_cluster(running)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"e2e-{name}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    # Pods are rejected until kube-controller-manager has created the namespace's default ServiceAccount.
    wait_until(
        lambda: cluster.kubectl.exists("serviceaccount", "default", "-n", name),
        timeout=30,
        what=f"default ServiceAccount in {name}",
    )
    yield name
    cluster.kubectl.run("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def kubectl(cluster: Cluster, namespace: str) -> Kubectl:
    return cluster.kubectl.in_namespace(namespace)
