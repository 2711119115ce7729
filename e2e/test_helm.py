"""The Helm chart against the local control plane: a real `helm install`/`upgrade`/`uninstall`, the
chart's RBAC proven sufficient by running the real operator and autoscaler with its ServiceAccounts'
tokens, Pod Security "restricted" enforced on every pod, the GitOps replicas contract, and the Argo CD
health check on statuses the operator really wrote.

kwok stands in for kubelets, so the chart's own operator/autoscaler pods become Ready without running;
the processes that act are started here, as those ServiceAccounts, exactly as the pods would be.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import Cluster, Kubectl, wait_until
from e2e.processes import stop_process
from kvpilot.net import free_port
from tests.charts.lua_health import health
from tests.charts.tools import CHART, helm

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "inferencemodels.kvpilot.dev"
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"
# Set to a folder to keep the InferenceModels this test captures (Argo CD health-check test data).
CAPTURE_DIR = os.environ.get("KVPILOT_CAPTURE_ARGOCD_TESTDATA")


@pytest.fixture(scope="module")
def helm_bin() -> str:
    return helm()


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


class Helm:
    def __init__(self, binary: str, cluster: Cluster, namespace: str) -> None:
        self.binary = binary
        self.cluster = cluster
        self.namespace = namespace

    def __call__(self, *args: str, timeout: float = 240) -> str:
        argv = [
            self.binary,
            "--kubeconfig",
            str(self.cluster.kubeconfig),
            "--namespace",
            self.namespace,
            *args,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.cluster.env())
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout


def token_kubeconfig(cluster: Cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount (a TokenRequest token), like a pod would."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h").strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    cluster_entry = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster_entry}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "e2e", "user": service_account}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Process:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log_path = log
        self.handle = log.open("ab")
        self.proc = subprocess.Popen(argv, stdout=self.handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.log_path.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
        return True

    def stop(self) -> None:
        stop_process(self.proc)
        self.handle.close()


def scrape_metrics(port: int, prefix: str) -> dict[str, float]:
    """Samples on 127.0.0.1:port/metrics whose names start with prefix, keyed by 'name{labels}'."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class FakePrometheus:
    """Answers the autoscaler's /api/v1/query with one value per pod of the model, set by the test."""

    def __init__(self, kubectl: Kubectl, model: str) -> None:
        self.kubectl = kubectl
        self.model = model
        self.kv = 0.0
        self.waiting = 0.0
        self.queries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query).get("query", [""])[0]
                outer.queries += 1
                if "kv_cache_usage" in query:
                    value = outer.kv
                elif "waiting" in query:
                    value = outer.waiting
                else:
                    value = 0.0
                pods = outer.kubectl(
                    "get", "pods", "-l", f"kvpilot.dev/model={outer.model}", "-o", "name"
                ).split()
                result = [{"metric": {"pod": p.removeprefix("pod/")}, "value": [0, str(value)]} for p in pods]
                body = json.dumps(
                    {"status": "success", "data": {"resultType": "vector", "result": result}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def model(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def capture(name: str, obj: dict[str, Any]) -> None:
    if not CAPTURE_DIR:
        return
    md = obj["metadata"]
    clean = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {k: md[k] for k in ("name", "namespace", "generation") if k in md},
        "spec": obj["spec"],
        "status": obj.get("status", {}),
    }
    # the test namespace's random name becomes "ml", so the files do not change from run to run
    text = json.dumps(clean).replace(md["namespace"], "ml")
    Path(CAPTURE_DIR).mkdir(parents=True, exist_ok=True)
    (Path(CAPTURE_DIR) / f"{name}.yaml").write_text(yaml.safe_dump(json.loads(text), sort_keys=False))


@pytest.fixture
def release(cluster: Cluster, helm_bin: str, namespace: str) -> Iterator[str]:
    """A release name unique to this test (ClusterRoles are named after it); removed even if the test fails."""
    name = f"kvp{uuid.uuid4().hex[:6]}"
    yield name
    argv = [
        helm_bin,
        "--kubeconfig",
        str(cluster.kubeconfig),
        "-n",
        namespace,
        "uninstall",
        name,
        "--ignore-not-found",
    ]
    subprocess.run(argv, capture_output=True, timeout=120, env=cluster.env())
    selector = f"app.kubernetes.io/instance={name}"
    cluster.kubectl.run(
        "delete", "clusterrole,clusterrolebinding", "-l", selector, "--ignore-not-found", check=False
    )


@pytest.fixture
def models_namespace(cluster: Cluster, namespace: str) -> Iterator[str]:
    name = f"{namespace[:50]}-m"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, RESTRICTED)
    wait_until(
        lambda: cluster.kubectl.exists("serviceaccount", "default", "-n", name), timeout=30, what="default SA"
    )
    yield name
    cluster.kubectl.run("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def test_install_upgrade_uninstall_with_least_privilege(
    cluster: Cluster,
    crd: None,
    helm_bin: str,
    namespace: str,
    models_namespace: str,
    release: str,
    tmp_path: Path,
) -> None:
    kubectl = cluster.kubectl.in_namespace(namespace)
    models = cluster.kubectl.in_namespace(models_namespace)
    full = f"{release}-kvpilot"
    helm = Helm(helm_bin, cluster, namespace)
    # Pod Security "restricted" in both namespaces: the API server rejects any pod of the chart or the
    # operator that runs as root, keeps capabilities, allows privilege escalation or lacks seccomp.
    cluster.kubectl("label", "namespace", namespace, RESTRICTED)

    # -- install ---------------------------------------------------------------------------------
    # ServiceMonitor/PrometheusRule are off: other suites add and remove a ServiceMonitor CRD in this
    # shared cluster, and a release rendered with one cannot be upgraded after it is gone. The `auto`
    # detection is covered by tests/charts (helm template --api-versions).
    monitoring_off = (
        "--set",
        "metrics.serviceMonitor.enabled=false",
        "--set",
        "prometheusRule.enabled=false",
    )
    helm(
        "install",
        release,
        str(CHART),
        "--set",
        "operator.replicas=2",
        *monitoring_off,
        "--wait",
        "--timeout",
        "180s",
    )
    assert json.loads(helm("status", release, "-o", "json"))["info"]["status"] == "deployed"
    op = kubectl.json("get", "deployment", f"{full}-operator")
    assert op["status"]["readyReplicas"] == 2
    assert kubectl.json("get", "deployment", f"{full}-autoscaler")["status"]["readyReplicas"] == 1
    assert kubectl.exists("poddisruptionbudget", f"{full}-operator")
    assert kubectl.exists("service", f"{full}-operator-metrics")
    for kind in ("clusterrole", "clusterrolebinding"):
        assert cluster.kubectl.exists(kind, f"{full}-operator") and cluster.kubectl.exists(
            kind, f"{full}-autoscaler"
        )
    assert cluster.kubectl.exists("crd", CRD_NAME)

    # -- the chart's RBAC is enough for the real code, and no more ---------------------------------
    sa_op, sa_as = f"{full}-operator", f"{full}-autoscaler"

    def can(sa: str, *args: str) -> bool:
        out = cluster.kubectl.run(
            "auth", "can-i", *args, f"--as=system:serviceaccount:{namespace}:{sa}", check=False
        )
        return out.stdout.strip() == "yes"

    assert can(sa_op, "watch", "inferencemodels.kvpilot.dev", "--all-namespaces")
    assert can(sa_op, "patch", "deployments.apps", "-n", models_namespace)
    # delete: the other mode's Deployments when spec.disaggregation is added or removed (docs/security.md)
    assert can(sa_op, "delete", "deployments.apps", "-n", models_namespace)
    assert not can(sa_op, "delete", "services", "-n", models_namespace)
    assert not can(sa_op, "get", "secrets", "-n", models_namespace)
    assert not can(
        sa_op, "patch", "inferencemodels.kvpilot.dev", "-n", models_namespace
    )  # spec is the user's
    assert can(sa_as, "patch", "inferencemodels.kvpilot.dev", "--subresource=scale", "-n", models_namespace)
    assert not can(sa_as, "patch", "deployments.apps", "-n", models_namespace)
    assert not can(sa_as, "create", "pods", "-n", models_namespace)
    assert can(sa_op, "update", f"leases.coordination.k8s.io/{full}-operator", "-n", namespace)
    assert not can(sa_op, "update", "leases.coordination.k8s.io/someone-else", "-n", namespace)
    assert not can(sa_op, "update", f"leases.coordination.k8s.io/{full}-operator", "-n", models_namespace)

    env = {**cluster.env(), "PYTHONUNBUFFERED": "1"}
    prom = FakePrometheus(models, "chat")
    operator: Process | None = None
    autoscaler: Process | None = None
    try:
        op_port, op_health = free_port(), free_port()
        operator = Process(
            [
                sys.executable, "-m", "kvpilot", "operator",
                "--kubeconfig", str(token_kubeconfig(cluster, namespace, sa_op, tmp_path / "op.kubeconfig")),
                "--namespace", models_namespace,
                "--leader-elect", "--leader-election-namespace", namespace, "--leader-election-name", f"{full}-operator",
                "--image", "ghcr.io/kvpilot/kvpilot-runtime:e2e",
                "--metrics-port", str(op_port), "--health-port", str(op_health),
            ],
            tmp_path / "operator.log",
            env,
        )  # fmt: skip
        as_port, as_health = free_port(), free_port()
        autoscaler = Process(
            [
                sys.executable, "-m", "kvpilot", "autoscaler", "run",
                "--kubeconfig", str(token_kubeconfig(cluster, namespace, sa_as, tmp_path / "as.kubeconfig")),
                "--namespace", models_namespace, "--leader-namespace", namespace, "--interval", "2",
                "--metrics-port", str(as_port), "--health-port", str(as_health),
            ],
            tmp_path / "autoscaler.log",
            env,
        )  # fmt: skip
        wait_until(
            lambda: operator.alive() and kubectl.exists("lease", f"{full}-operator"),
            timeout=60,
            what="operator Lease",
        )

        models.apply(
            model(
                "chat",
                resources={"gpus": 1},
                autoscaling={
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "metricsSource": "prometheus",
                    "prometheus": {"url": prom.url},
                    "scaleDownStabilizationSeconds": 0,
                },
            )
        )
        ready = wait_until(
            lambda: (
                condition(models.json("get", "im", "chat"), "Ready").get("status") == "True"
                and models.json("get", "im", "chat")
            ),
            timeout=90,
            what="model Ready (operator acting as its ServiceAccount)",
        )
        assert models.exists("deployment", "chat") and models.exists("service", "chat")
        assert models.exists("configmap", "chat-config") and models.exists("poddisruptionbudget", "chat")
        assert health(ready)["status"] == "Healthy"
        capture("healthy", ready)

        # saturated: the autoscaler scales up through the scale subresource
        prom.kv = 0.95
        prom.waiting = 20
        wait_until(
            lambda: autoscaler.alive() and models.json("get", "im", "chat")["spec"].get("replicas") == 3,
            timeout=90,
            what="autoscaler scales chat to 3",
        )
        wait_until(
            lambda: models.json("get", "deployment", "chat")["status"].get("readyReplicas") == 3, timeout=60
        )
        scaled = models.json("get", "im", "chat")
        assert scaled["status"]["autoscaler"]["lastDecision"]["toReplicas"] == 3
        reasons = models(
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=chat",
            "-o",
            "jsonpath={.items[*].reason}",
        )
        assert "ScaledUp" in reasons.split()
        # what it decided is on its /metrics, and its probes pass
        as_metrics = scrape_metrics(as_port, "kvpilot_autoscaler_")
        assert as_metrics["kvpilot_autoscaler_leader"] == 1
        assert as_metrics['kvpilot_autoscaler_scale_writes_total{direction="up"}'] >= 1
        chat = f'{{model="chat",namespace="{models_namespace}"}}'
        assert as_metrics[f"kvpilot_autoscaler_desired_replicas{chat}"] == 3
        assert as_metrics["kvpilot_autoscaler_last_successful_sync_timestamp_seconds"] > 0
        for path in ("/healthz", "/readyz"):
            with urllib.request.urlopen(f"http://127.0.0.1:{as_health}{path}", timeout=5) as resp:
                assert resp.status == 200, path

        # idle: scale-down marks the cheapest pod (pods patch) and shrinks the model
        prom.kv = 0.0
        prom.waiting = 0
        wait_until(
            lambda: (models.json("get", "im", "chat")["spec"].get("replicas") or 3) < 3,
            timeout=120,
            what="autoscaler scales chat down",
        )
        pods = models.json("get", "pods", "-l", "kvpilot.dev/model=chat")["items"]
        assert any(
            "controller.kubernetes.io/pod-deletion-cost" in (p["metadata"].get("annotations") or {})
            for p in pods
        )

        # statuses for the Argo CD health check: pods that cannot be placed, and a model scaled to zero
        models.apply(model("capped", replicas=1, resources={"gpus": 9}))
        capped = wait_until(
            lambda: (
                condition(models.json("get", "im", "capped"), "ScalingLimited").get("status") == "True"
                and models.json("get", "im", "capped")
            ),
            timeout=60,
            what="capped ScalingLimited",
        )
        assert health(capped)["status"] == "Progressing"
        assert "Unschedulable" in health(capped)["message"]
        capture("scaling-limited", capped)
        models.apply(model("idle", replicas=0, resources={"gpus": 1}))
        idle = wait_until(
            lambda: (
                condition(models.json("get", "im", "idle"), "Ready").get("reason") == "ScaledToZero"
                and models.json("get", "im", "idle")
            ),
            timeout=60,
            what="idle ScaledToZero",
        )
        assert health(idle)["status"] == "Suspended"
        capture("scaled-to-zero", idle)

        for running in (operator, autoscaler):
            running.alive()
            log = running.log()
            # an RBAC gap shows as Forbidden / status 403 (not as "403" anywhere: log timestamps have
            # milliseconds, and ",403" failed a fresh CI run)
            denied = re.findall(r"forbidden|\b(?:code|status)\W{0,3}403\b|\(403\)", log, flags=re.I)
            assert not denied, log[-3000:]
    finally:
        for started in (operator, autoscaler):
            if started is not None:
                started.stop()
        prom.close()

    # -- upgrade ---------------------------------------------------------------------------------
    helm(
        "upgrade",
        release,
        str(CHART),
        "--reuse-values",
        "--set",
        "operator.replicas=1",
        "--set",
        "operator.logLevel=DEBUG",
        "--wait",
        "--timeout",
        "180s",
    )
    op = kubectl.json("get", "deployment", f"{full}-operator")
    assert op["spec"]["replicas"] == 1
    assert "--log-level=DEBUG" in op["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not kubectl.exists("poddisruptionbudget", f"{full}-operator")  # only with 2+ replicas
    history = json.loads(helm("history", release, "-o", "json"))
    assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"

    # -- uninstall -------------------------------------------------------------------------------
    helm("uninstall", release, "--wait", "--timeout", "120s")
    assert not kubectl.exists("deployment", f"{full}-operator")
    assert not kubectl.exists("serviceaccount", sa_op)
    assert not cluster.kubectl.exists("clusterrole", f"{full}-operator")
    assert not cluster.kubectl.exists("clusterrolebinding", f"{full}-autoscaler")
    # Helm never deletes crds/: the CRD, and with it every InferenceModel, survive an uninstall.
    assert cluster.kubectl.exists("crd", CRD_NAME)
    assert models.exists("im", "chat")


def test_gitops_apply_leaves_autoscaler_replicas_alone(cluster: Cluster, crd: None, kubectl: Kubectl) -> None:
    """What Argo CD does with ServerSideApply=true: the manifest from Git (no spec.replicas) applied again
    after the autoscaler scaled the model changes nothing, and a server-side diff is empty."""
    manifest = (ROOT / "examples" / "autoscaled.yaml").read_text()
    assert "replicas:" not in manifest.replace("minReplicas", "").replace("maxReplicas", "")
    gitops = ("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-")
    kubectl(*gitops, input_text=manifest)
    kubectl(
        "scale", "im/qwen-7b", "--replicas", "3"
    )  # the autoscaler does this through the scale subresource

    kubectl(*gitops, input_text=manifest)
    live = kubectl.json("get", "im", "qwen-7b", "--show-managed-fields")
    assert live["spec"]["replicas"] == 3
    owners = {
        m["manager"]
        for m in live["metadata"]["managedFields"]
        if "f:replicas" in json.dumps(m.get("fieldsV1", {}))
    }
    assert "argocd-controller" not in owners
    diff = kubectl.run(
        "diff",
        "--server-side",
        "--field-manager=argocd-controller",
        "-f",
        "-",
        input_text=manifest,
        check=False,
    )
    assert diff.returncode == 0, f"server-side diff is not empty:\n{diff.stdout}{diff.stderr}"

    # Why spec.replicas must stay out of Git: the scale subresource's write is not recorded in
    # managedFields for custom resources, so an apply that carries spec.replicas gets no conflict and
    # silently resets the autoscaler's decision ...
    with_replicas = yaml.safe_load(manifest)
    with_replicas["spec"]["replicas"] = 1
    kubectl(*gitops, input_text=json.dumps(with_replicas))
    assert kubectl.json("get", "im", "qwen-7b")["spec"]["replicas"] == 1
    # ... and once the GitOps manager owns the field, dropping it from Git deletes it on the next apply
    # (the operator then renders minReplicas until the autoscaler writes spec.replicas again).
    kubectl(*gitops, input_text=manifest)
    assert "replicas" not in kubectl.json("get", "im", "qwen-7b")["spec"]
