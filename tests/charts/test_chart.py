"""The Helm chart: lint, schema, rendering, RBAC, security, and agreement with the code it deploys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.cli import build_parser
from tests.charts.render import Rendered, run_helm, template, template_error
from tests.charts.tools import CHART, ROOT

APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
CRD_KINDS = {"CustomResourceDefinition"}
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
EVERYTHING = (
    "operator.replicas=2",
    "networkPolicy.enabled=true",
    "grafanaDashboard.enabled=true",
    "rbac.secretNames={hf-token}",
    "autoscaler.metricsSource=prometheus",
    "autoscaler.prometheusURL=http://prometheus.monitoring.svc:9090",
    "router.enabled=true",
    "router.flowControl.maxQueuePerPriority.low=8",
    "router.flowControl.queueTimeoutPerPrioritySeconds.low=5",
    "router.flowControl.tenantHeader=Authorization",
    "router.flowControl.maxQueuePerTenant=16",
)


def test_helm_lint_strict() -> None:
    run_helm("lint", "--strict", str(CHART))
    run_helm("lint", "--strict", str(CHART), *[a for s in EVERYTHING for a in ("--set", s)])


def test_chart_crds_are_the_repository_crds() -> None:
    repo = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert chart == repo
    for name in repo:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/kvpilot/crds/{name} differs from crds/{name}: run `python deploy/sync.py`"
        )


@pytest.mark.parametrize(
    "sets",
    [
        (),
        EVERYTHING,
        ("watchNamespaces={ml}",),
        ("watchNamespaces={ml,research}", "autoscaler.enabled=false"),
        ("autoscaler.enabled=false", "metrics.service.enabled=false", "rbac.create=false"),
    ],
    ids=["defaults", "everything", "one-namespace", "two-namespaces", "minimal"],
)
def test_rendered_manifests_are_valid_kubernetes_1_33(sets: tuple[str, ...]) -> None:
    """Every object validates strictly against the Kubernetes 1.33 OpenAPI schemas (unknown fields fail)."""
    import kubernetes_validate

    rendered = template(*sets, monitoring=True)
    assert rendered.objects
    for obj in rendered.objects:
        if obj["kind"] in CRD_KINDS | PROMETHEUS_OPERATOR_KINDS:
            continue  # no upstream schema; the CRD is checked by the apiserver in e2e, the rest below
        try:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_defaults_render_what_a_cluster_wide_install_needs() -> None:
    r = template()
    assert r.kinds() == sorted(
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "Deployment",
            "Deployment",
            "Pod",  # helm test hook
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "Service",  # the operator's metrics
            "Service",  # the autoscaler's metrics
            "ServiceAccount",
            "ServiceAccount",
        ]
    )
    assert all(
        o["metadata"].get("namespace") == "kvpilot-system"
        for o in r.objects
        if o["kind"] in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding")
    )


def test_images_default_to_ghcr_and_the_app_version() -> None:
    r = template()
    op = r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    auto = r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0]
    assert op["image"] == f"ghcr.io/kvpilot/kvpilot-operator:{APP_VERSION}"
    assert auto["image"] == f"ghcr.io/kvpilot/kvpilot-operator:{APP_VERSION}"
    assert f"--image=ghcr.io/kvpilot/kvpilot-runtime:{APP_VERSION}" in op["args"]
    digest = "sha256:" + "a" * 64
    r = template(f"runtime.image.digest={digest}", "operator.image.tag=9.9.9")
    op = r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert op["image"] == "ghcr.io/kvpilot/kvpilot-operator:9.9.9"
    assert f"--image=ghcr.io/kvpilot/kvpilot-runtime@{digest}" in op["args"]


def test_artifacthub_images_annotation_matches_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    images = yaml.safe_load(chart["annotations"]["artifacthub.io/images"])
    assert {i["image"].rsplit(":", 1)[1] for i in images} == {APP_VERSION}


def _cli_args(container: dict[str, Any]) -> Any:
    argv = [*container["command"][1:], *container["args"]]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize(
    "sets", [(), EVERYTHING, ("watchNamespaces={ml}",), ("operator.leaderElection.enabled=false",)]
)
def test_rendered_command_lines_parse_with_the_real_cli(sets: tuple[str, ...]) -> None:
    """The flags the chart passes are flags `kvpilot operator` / `kvpilot autoscaler run` accept today."""
    r = template(*sets)
    op = _cli_args(r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0])
    assert op.health_port == 8081 and op.metrics_port == 8080
    auto = _cli_args(r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0])
    assert auto.autoscaler_command == "run"
    assert auto.health_port == 8081 and auto.metrics_port == 8080


def test_router_flow_control_slo_and_migration_args_follow_values() -> None:
    from kvpilot.router.cli import parse_class_values

    r = template(*EVERYTHING, "router.streamMigration=false", "router.slo.tpotSeconds=1")
    args = _cli_args(r.one("Deployment", "-router")["spec"]["template"]["spec"]["containers"][0])
    assert parse_class_values("--max-queue-per-priority", args.max_queue_per_priority, int) == {"low": 8}
    assert parse_class_values("--queue-timeout-per-priority", args.queue_timeout_per_priority, float) == {
        "low": 5.0
    }
    assert (args.tenant_header, args.max_queue_per_tenant) == ("Authorization", 16)
    assert (args.slo_ttft_seconds, args.slo_tpot_seconds, args.slo_window) == (2.0, 1.0, 300.0)
    assert args.stream_migration == "off"
    args = _cli_args(
        template("router.enabled=true").one("Deployment", "-router")["spec"]["template"]["spec"][
            "containers"
        ][0]
    )
    assert (
        args.max_queue_per_priority == [] and args.tenant_header is None and args.max_queue_per_tenant is None
    )
    assert args.stream_migration == "on"


def test_operator_args_follow_values() -> None:
    r = template("watchNamespaces={ml,research}", "autoscaler.enabled=false", "operator.replicas=2")
    c = r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    args = _cli_args(c)
    assert args.namespace == ["ml", "research"]
    assert args.leader_elect is True
    assert args.leader_election_namespace == "kvpilot-system"
    assert args.leader_election_name == "kvp-kvpilot-operator"
    r = template()
    args = _cli_args(r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0])
    assert args.all_namespaces is True and args.namespace == []


def test_autoscaler_args_follow_values() -> None:
    r = template(*EVERYTHING, "watchNamespaces={ml}", "autoscaler.interval=30")
    args = _cli_args(r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0])
    assert args.namespace == "ml"
    assert args.metrics_source == "prometheus"
    assert args.prometheus_url == "http://prometheus.monitoring.svc:9090"
    assert args.interval == 30
    assert args.no_leader_elect is False and args.leader_namespace == "kvpilot-system"
    r = template("autoscaler.leaderElection.enabled=false")
    dep = r.one("Deployment", "-autoscaler")
    assert _cli_args(dep["spec"]["template"]["spec"]["containers"][0]).no_leader_elect is True
    assert dep["spec"]["strategy"] == {"type": "Recreate"}


# -- RBAC ------------------------------------------------------------------------------------------------

OPERATOR_RULES = {
    ("kvpilot.dev", "inferencemodels"): {"get", "list", "watch"},
    ("kvpilot.dev", "inferencemodels/status"): {"patch"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "list", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch"},
    ("", "events"): {"create"},
    ("monitoring.coreos.com", "servicemonitors"): {"get", "create", "patch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch", "delete"},
}
AUTOSCALER_RULES = {
    ("kvpilot.dev", "inferencemodels"): {"list", "patch"},
    ("kvpilot.dev", "inferencemodels/scale"): {"patch"},
    ("kvpilot.dev", "inferencemodels/status"): {"patch"},
    ("", "pods"): {"list", "patch"},
    ("", "events"): {"create"},
}


def flatten(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (
                    group,
                    resource
                    if not rule.get("resourceNames")
                    else f"{resource}@{','.join(rule['resourceNames'])}",
                )
                out.setdefault(key, set()).update(rule["verbs"])
    return out


def test_cluster_roles_grant_exactly_what_the_code_uses() -> None:
    r = template()
    assert flatten(r.one("ClusterRole", "-operator")["rules"]) == OPERATOR_RULES
    assert flatten(r.one("ClusterRole", "-autoscaler")["rules"]) == AUTOSCALER_RULES
    for role in r.all("ClusterRole") + r.all("Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert "secrets" not in rule["resources"], f"{role['metadata']['name']} grants Secrets"
    for binding in r.all("ClusterRoleBinding") + r.all("RoleBinding"):
        assert binding["roleRef"]["name"] != "cluster-admin"
        assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]


def test_leases_only_in_the_release_namespace_and_by_name() -> None:
    r = template()
    roles = {o["metadata"]["name"]: o for o in r.all("Role")}
    assert set(roles) == {"kvp-kvpilot-operator-leader-election", "kvp-kvpilot-autoscaler-leader-election"}
    assert flatten(roles["kvp-kvpilot-operator-leader-election"]["rules"]) == {
        ("coordination.k8s.io", "leases"): {"create"},
        ("coordination.k8s.io", "leases@kvp-kvpilot-operator"): {"get", "update"},
    }
    assert flatten(roles["kvp-kvpilot-autoscaler-leader-election"]["rules"]) == {
        ("coordination.k8s.io", "leases"): {"create"},
        ("coordination.k8s.io", "leases@kvpilot-autoscaler"): {"get", "update"},
    }
    r = template("operator.leaderElection.enabled=false", "autoscaler.leaderElection.enabled=false")
    assert not r.all("Role")


def test_secret_access_only_by_name() -> None:
    r = template("rbac.secretNames={hf-token,registry-key}")
    rules = flatten(r.one("ClusterRole", "-operator")["rules"])
    assert rules[("", "secrets@hf-token,registry-key")] == {"get"}
    assert not any(k == ("", "secrets") for k in rules)
    assert ("", "secrets@hf-token,registry-key") not in flatten(r.one("ClusterRole", "-autoscaler")["rules"])


def test_service_monitor_rule_can_be_left_out() -> None:
    r = template("rbac.serviceMonitors=false")
    assert ("monitoring.coreos.com", "servicemonitors") not in flatten(
        r.one("ClusterRole", "-operator")["rules"]
    )


def test_inference_pool_rule_can_be_left_out() -> None:
    r = template("rbac.inferencePools=false")
    assert ("inference.networking.k8s.io", "inferencepools") not in flatten(
        r.one("ClusterRole", "-operator")["rules"]
    )


def test_namespaced_install_has_no_cluster_scoped_access() -> None:
    r = template("watchNamespaces={ml,research}", "autoscaler.enabled=false")
    assert not r.all("ClusterRole") and not r.all("ClusterRoleBinding")
    roles = [o for o in r.all("Role") if not o["metadata"]["name"].endswith("-leader-election")]
    assert sorted(o["metadata"]["namespace"] for o in roles) == ["ml", "research"]
    for role in roles:
        assert flatten(role["rules"]) == OPERATOR_RULES
    bindings = [o for o in r.all("RoleBinding") if not o["metadata"]["name"].endswith("-leader-election")]
    assert all(b["subjects"][0]["namespace"] == "kvpilot-system" for b in bindings)


def test_rbac_can_be_brought_by_the_user() -> None:
    r = template("rbac.create=false")
    assert not [
        o for o in r.objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    ]


# -- security --------------------------------------------------------------------------------------------


def assert_hardened(name: str, spec: dict[str, Any]) -> None:
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True, name
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
    assert psc.get("runAsUser", 0) != 0, name
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
        assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
        assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
        assert not sc.get("privileged"), (name, c["name"])
        assert "add" not in sc["capabilities"], (name, c["name"])
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], (name, c["name"])
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name


def test_chart_pods_are_hardened() -> None:
    r = template(*EVERYTHING)
    specs = r.pod_specs()
    assert len(specs) == 4  # operator, autoscaler, router, helm test
    for name, spec in specs:
        assert_hardened(name, spec)
        assert spec["securityContext"]["runAsUser"] == 10001
        if spec.get("automountServiceAccountToken") is not False:
            assert spec["serviceAccountName"].startswith("kvp-kvpilot-")
    # a read-only root needs a writable /tmp (HOME points there)
    for dep in r.all("Deployment"):
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "HOME", "value": "/tmp"} in c["env"]
    for sa in r.all("ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False


def test_operator_rendered_model_pods_are_hardened() -> None:
    """The pods the operator creates for a model meet the same bar as the chart's (operator/builders.py)."""
    from kvpilot.api.models import InferenceModel
    from kvpilot.operator.builders import OperatorSettings, render_children

    for example in ("smollm2-cpu.yaml", "llama-8b-gpu.yaml", "autoscaled.yaml"):
        body = yaml.safe_load((ROOT / "examples" / example).read_text())
        body["metadata"].update({"namespace": "ml", "uid": "uid-1", "generation": 1})
        im = InferenceModel.model_validate(body)
        children = render_children(im, OperatorSettings(image="ghcr.io/kvpilot/kvpilot-runtime:0.1.0"))
        dep = next(c for c in children if c["kind"] == "Deployment")
        spec = dep["spec"]["template"]["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, "read-only root needs a writable /tmp"


def test_api_key_from_a_secret_reaches_the_runtime() -> None:
    """spec.env with a secretKeyRef for KVPILOT_API_KEY ends up in the pod (runtime/config.py reads it)."""
    from kvpilot.api.models import InferenceModel
    from kvpilot.operator.builders import OperatorSettings, render_config_yaml, render_deployment
    from kvpilot.runtime.config import EngineConfig

    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m", "namespace": "ml", "uid": "u", "generation": 1},
        "spec": {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "env": [
                {
                    "name": "KVPILOT_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": "m-api-key", "key": "key"}},
                }
            ],
        },
    }
    im = InferenceModel.model_validate(body)
    config_yaml = render_config_yaml(im)
    env = render_deployment(im, OperatorSettings(), config_yaml)["spec"]["template"]["spec"]["containers"][0][
        "env"
    ]
    assert {
        "name": "KVPILOT_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "m-api-key", "key": "key"}},
    } in env
    settings = yaml.safe_load(config_yaml)
    assert "m-api-key" not in config_yaml  # never in the ConfigMap
    assert "api_key" not in settings and "api_key_file" not in settings
    cfg = EngineConfig.model_validate(yaml.safe_load(config_yaml))
    import os

    old = os.environ.get("KVPILOT_API_KEY")
    os.environ["KVPILOT_API_KEY"] = "from-the-secret"
    try:
        assert cfg.resolved_api_key() == "from-the-secret"
    finally:
        if old is None:
            del os.environ["KVPILOT_API_KEY"]
        else:
            os.environ["KVPILOT_API_KEY"] = old


# -- monitoring ------------------------------------------------------------------------------------------


def test_monitoring_objects_follow_the_cluster_capabilities() -> None:
    assert not {"ServiceMonitor", "PrometheusRule"} & set(template().kinds())
    r = template(monitoring=True)
    assert {"ServiceMonitor", "PrometheusRule"} <= set(r.kinds())
    assert not {"ServiceMonitor", "PrometheusRule"} & set(
        template(
            "metrics.serviceMonitor.enabled=false", "prometheusRule.enabled=false", monitoring=True
        ).kinds()
    )
    forced = template("metrics.serviceMonitor.enabled=true", "prometheusRule.enabled=true")
    assert {"ServiceMonitor", "PrometheusRule"} <= set(forced.kinds())


@pytest.mark.parametrize("component", ["operator", "autoscaler"])
def test_service_monitor_selects_the_metrics_service(component: str) -> None:
    r = template("metrics.serviceMonitor.labels.release=prom", monitoring=True)
    sm = r.one("ServiceMonitor", f"-{component}")
    svc = r.one("Service", f"-{component}-metrics")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    # each ServiceMonitor selects its own Service only (the selector labels include the component)
    others = [
        o["metadata"]["name"]
        for o in r.all("Service")
        if all(o["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    ]
    assert others == [svc["metadata"]["name"]]
    dep = r.one("Deployment", f"-{component}")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
    ports = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    # the autoscaler's per-model series carry the model's namespace: kept, not renamed exported_namespace
    assert sm["spec"]["endpoints"][0].get("honorLabels", False) is (component == "autoscaler")


def test_autoscaler_metrics_objects_follow_autoscaler_enabled() -> None:
    r = template("autoscaler.enabled=false", monitoring=True)
    assert [o["metadata"]["name"] for o in r.all("Service")] == ["kvp-kvpilot-operator-metrics"]
    assert [o["metadata"]["name"] for o in r.all("ServiceMonitor")] == ["kvp-kvpilot-operator"]
    assert not template("metrics.service.enabled=false", monitoring=True).all("ServiceMonitor")


def test_autoscaler_probes_and_ports_follow_values() -> None:
    r = template("autoscaler.healthPort=9091", "autoscaler.metricsPort=9090")
    c = r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0]
    args = _cli_args(c)
    assert (args.health_port, args.metrics_port) == (9091, 9090)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090, "health": 9091}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    # the liveness window (3 failures x 10 s) comes on top of the loop's own max(3 x interval, 60 s)
    assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] <= 60


def test_prometheus_rule_is_the_rules_file() -> None:
    source = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kvpilot-rules.yaml").read_text())
    rule = template(monitoring=True).one("PrometheusRule")
    assert rule["spec"]["groups"] == source["groups"]


def test_prometheus_rule_filters_and_labels() -> None:
    r = template(
        "prometheusRule.disabledAlerts={KvpilotModelOOMKilled,KvpilotOperatorDown}",
        "prometheusRule.additionalAlertLabels.team=ml-platform",
        monitoring=True,
    )
    rules = [x for g in r.one("PrometheusRule")["spec"]["groups"] for x in g["rules"]]
    alerts = {x["alert"]: x for x in rules if "alert" in x}
    assert "KvpilotModelOOMKilled" not in alerts and "KvpilotOperatorDown" not in alerts
    assert "KvpilotKVCacheNearlyFull" in alerts
    assert all(a["labels"]["team"] == "ml-platform" for a in alerts.values())
    assert all("severity" in a["labels"] for a in alerts.values())
    assert all("labels" not in x for x in rules if "record" in x)


def test_dashboard_config_map_holds_the_dashboard() -> None:
    r = template("grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring")
    cm = r.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvpilot.json"]) == json.loads(
        (ROOT / "examples" / "grafana-dashboard.json").read_text()
    )


def test_network_policies() -> None:
    r = template("networkPolicy.enabled=true", "networkPolicy.apiServerCIDRs={10.0.0.1/32}")
    op = r.one("NetworkPolicy", "-operator")["spec"]
    assert op["policyTypes"] == ["Ingress", "Egress"]
    assert [p["port"] for rule in op["ingress"] for p in rule["ports"]] == ["metrics", "health"]
    api_rule = next(e for e in op["egress"] if any(p["port"] == 443 for p in e["ports"]))
    assert api_rule["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert any(p["port"] == 8000 for e in op["egress"] for p in e["ports"])  # LoRA adapters in pods
    auto = r.one("NetworkPolicy", "-autoscaler")["spec"]
    assert auto["policyTypes"] == ["Ingress", "Egress"]
    assert [p["port"] for rule in auto["ingress"] for p in rule["ports"]] == ["metrics", "health"]
    assert any(p["port"] == 8000 for e in auto["egress"] for p in e["ports"])
    peers = template(
        "networkPolicy.enabled=true", "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prom"
    )
    for component in ("operator", "autoscaler"):
        metrics_rule = peers.one("NetworkPolicy", f"-{component}")["spec"]["ingress"][0]
        assert metrics_rule["from"] == [{"podSelector": {"matchLabels": {"app": "prom"}}}]


# -- values and guard rails --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("operator.replicas=two",), "operator.replicas"),
        (("operator.replicaz=2",), "replicaz"),
        (("autoscaler.metricsSource=kafka",), "metricsSource"),
        (("autoscaler.prometheusURL=prometheus:9090",), "prometheusURL"),
        (("securityContext.allowPrivilegeEscalation=true",), "allowPrivilegeEscalation"),
        (("podSecurityContext.runAsNonRoot=false",), "runAsNonRoot"),
        (("prometheusRule.enabled=maybe",), "prometheusRule.enabled"),
        (("watchNamespaces={Bad_NS}",), "watchNamespaces"),
        (("operator.image.digest=latest",), "digest"),
        (("rbac.secretNames={*}",), "secretNames"),
        (("operator.replicas=2", "operator.leaderElection.enabled=false"), "operator"),
        (("autoscaler.replicas=2", "autoscaler.leaderElection.enabled=false"), "autoscaler"),
        (("metrics.serviceMonitor.interval=soon",), "interval"),
    ],
)
def test_schema_rejects_bad_values(sets: tuple[str, ...], message: str) -> None:
    err = template_error(*sets)
    assert "schema" in err and message in err, err


def test_autoscaler_with_several_namespaces_is_refused_with_a_reason() -> None:
    err = template_error("watchNamespaces={ml,research}")
    assert "autoscaler.enabled needs watchNamespaces to list at most one namespace" in err


def test_every_value_is_documented_in_the_readme() -> None:
    from deploy.sync import all_keys, value_docs

    values_text = (CHART / "values.yaml").read_text()
    documented = {d.key for d in value_docs(values_text)}
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load(values_text)

    def lookup(path: str) -> Any:
        node: Any = values
        for part in path.split("."):
            node = node[part]
        return node

    for key in all_keys(values):
        node = lookup(key)
        is_leaf = not isinstance(node, dict) or not node
        parts = key.split(".")
        covered = any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1))
        if is_leaf:
            assert covered, f"values.yaml: `{key}` has no `# --` comment (nor does a parent)"
    for key in documented:
        assert f"| `{key}` |" in readme, (
            f"charts/kvpilot/README.md lacks `{key}`: run `python deploy/sync.py`"
        )


def test_schema_knows_every_value() -> None:
    """values.yaml itself validates, and every key in it is declared in values.schema.json."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: Any, sch: dict[str, Any], path: str) -> None:
        if not isinstance(node, dict) or sch.get("additionalProperties") is not False:
            return  # free-form maps (labels, securityContext) are Kubernetes' to validate
        for k, v in node.items():
            assert k in sch["properties"], f"values.schema.json lacks {path}{k}"
            walk(v, sch["properties"][k], f"{path}{k}.")

    walk(values, schema, "")
    import jsonschema

    jsonschema.Draft7Validator(schema).validate(values)


def render_notes(tmp_path: Path, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm install --dry-run` still wants a cluster, so render a
    copy of the chart where NOTES.txt is a named template shown through a ConfigMap."""
    chart = tmp_path / "kvpilot"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "test.notes" -}}\n' + notes + "{{- end }}\n")
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: {{ include "test.notes" . | toJson }}\n'
    )
    args = ["template", "kvp", str(chart), "-n", "kvpilot-system", "--show-only", "templates/notes.yaml"]
    out = run_helm(*args, *[a for s in sets for a in ("--set", s)]).stdout
    return str(yaml.safe_load(out)["data"]["notes"])


def test_notes_render_next_steps(tmp_path: Path) -> None:
    notes = render_notes(tmp_path)
    assert "kubectl -n kvpilot-system rollout status deployment/kvp-kvpilot-operator" in notes
    assert "kind: InferenceModel" in notes and "namespace: default" in notes
    assert "kubectl apply --server-side" in notes  # the CRD upgrade step
    assert "No PrometheusRule rendered" in notes
    notes = render_notes(tmp_path / "ns", "watchNamespaces={ml}", "autoscaler.enabled=false")
    assert "namespace: ml" in notes and "Autoscaler: disabled" in notes
    assert "Router:     disabled" in notes
    notes = render_notes(tmp_path / "router", "router.enabled=true")
    assert (
        "Router:     2 replica(s) serving namespace kvpilot-system at http://kvp-kvpilot-router.kvpilot-system.svc:80/v1"
        in notes
    )


def test_rendered_output_is_deterministic() -> None:
    a = run_helm("template", "kvp", str(CHART), *[a for s in EVERYTHING for a in ("--set", s)]).stdout
    b = run_helm("template", "kvp", str(CHART), *[a for s in EVERYTHING for a in ("--set", s)]).stdout
    assert a == b


def _objects(r: Rendered, kind: str) -> list[str]:
    return [o["metadata"]["name"] for o in r.all(kind)]


def test_operator_pdb_only_with_several_replicas() -> None:
    assert not _objects(template(), "PodDisruptionBudget")
    assert _objects(template("operator.replicas=2"), "PodDisruptionBudget") == ["kvp-kvpilot-operator"]


@pytest.mark.parametrize("autoscaler", [True, False])
def test_helm_test_pod_checks_each_metrics_service(autoscaler: bool) -> None:
    pod = template(f"autoscaler.enabled={str(autoscaler).lower()}").one("Pod", "-test")
    code = pod["spec"]["containers"][0]["command"][2]
    compile(code, "helm-test", "exec")
    assert "http://kvp-kvpilot-operator-metrics.kvpilot-system.svc:8080/metrics" in code
    assert ("http://kvp-kvpilot-autoscaler-metrics.kvpilot-system.svc:8080/metrics" in code) is autoscaler
