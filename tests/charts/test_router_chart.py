"""The chart's router: off by default; when on, a 2-replica Deployment the real CLI accepts, its
Services, PodDisruptionBudget, ServiceMonitor, least-privilege Role, and the autoscaler wired to it."""

from __future__ import annotations

from typing import Any

from kvpilot.cli import build_parser
from tests.charts.render import template, template_error


def router_objects(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [
        o for o in objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"
    ]


def test_router_is_off_by_default() -> None:
    r = template(monitoring=True)
    assert router_objects(r.objects) == []
    auto = r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--router-url") for a in auto["args"])


def test_router_renders_a_deployment_the_cli_accepts() -> None:
    r = template("router.enabled=true", "router.policy=kv-aware", "router.namespace=ml", monitoring=True)
    dep = r.one("Deployment", "-router")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    argv = [*c["command"][1:], *c["args"]]
    args = build_parser(argv).parse_args(argv)
    assert (args.command, args.policy, args.namespace, args.port) == ("router", "kv-aware", "ml", 8080)
    assert args.endpoints == []  # Kubernetes discovery, not a static list
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert pod["serviceAccountName"] == "kvp-kvpilot-router"
    assert pod["terminationGracePeriodSeconds"] == 60


def test_router_services_pdb_and_service_monitor() -> None:
    r = template("router.enabled=true", monitoring=True)
    services = {s["metadata"]["name"]: s for s in router_objects(r.objects) if s["kind"] == "Service"}
    main, headless = services["kvp-kvpilot-router"], services["kvp-kvpilot-router-headless"]
    assert main["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert headless["spec"]["clusterIP"] == "None"
    pdb = r.one("PodDisruptionBudget", "-router")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = r.one("Deployment", "-router")["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    monitor = r.one("ServiceMonitor", "-router")
    # it scrapes each pod once: through the main Service, not again through the headless one
    match = monitor["spec"]["selector"]
    for svc, expected in ((main, True), (headless, False)):
        labels = svc["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in match["matchLabels"].items()) and all(
            e["key"] not in labels for e in match["matchExpressions"]
        )
        assert selected is expected, svc["metadata"]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # one replica: no PodDisruptionBudget (it would block every drain)
    single = template("router.enabled=true", "router.replicas=1")
    assert not [o for o in router_objects(single.objects) if o["kind"] == "PodDisruptionBudget"]


def test_router_rbac_lists_and_watches_models_and_pods_in_its_namespace_only() -> None:
    r = template("router.enabled=true", "router.namespace=ml")
    role = r.one("Role", "-router")
    assert role["metadata"]["namespace"] == "ml"
    assert role["rules"] == [
        {"apiGroups": ["kvpilot.dev"], "resources": ["inferencemodels"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]
    binding = r.one("RoleBinding", "-router")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvp-kvpilot-router", "namespace": "kvpilot-system"}
    ]
    assert not [o for o in router_objects(r.objects) if o["kind"].startswith("Cluster")]
    no_rbac = template("router.enabled=true", "rbac.create=false")
    assert not [o for o in router_objects(no_rbac.objects) if o["kind"] in ("Role", "RoleBinding")]


def test_autoscaler_reads_every_router_replica() -> None:
    r = template("router.enabled=true")
    auto = r.one("Deployment", "-autoscaler")["spec"]["template"]["spec"]["containers"][0]
    argv = [*auto["command"][1:], *auto["args"]]
    args = build_parser(argv).parse_args(argv)
    assert args.router_url == ["http://kvp-kvpilot-router-headless.kvpilot-system.svc:8080"]


def test_schema_rejects_an_unknown_router_policy() -> None:
    err = template_error("router.enabled=true", "router.policy=random")
    assert "schema" in err and "policy" in err


def test_operator_shows_the_router_endpoint_in_status() -> None:
    r = template("router.enabled=true", "router.namespace=ml")
    op = r.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    argv = [*op["command"][1:], *op["args"]]
    args = build_parser(argv).parse_args(argv)
    assert args.router_endpoint == ["ml=http://kvp-kvpilot-router.kvpilot-system.svc:80/v1"]
    off = template()
    op = off.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--router-endpoint") for a in op["args"])


def test_router_deadlines_and_outlier_ejection_reach_the_cli() -> None:
    def args_of(*sets: str) -> Any:
        c = template("router.enabled=true", *sets).one("Deployment", "-router")["spec"]["template"]["spec"]
        argv = [*c["containers"][0]["command"][1:], *c["containers"][0]["args"]]
        return build_parser(argv).parse_args(argv)

    defaults = args_of()
    assert (
        defaults.connect_timeout,
        defaults.first_byte_timeout,
        defaults.idle_timeout,
        defaults.probe_timeout,
        defaults.silence_limit,
    ) == (5, 10, 10, 2, 600)
    assert (
        defaults.eject_after,
        defaults.ejection_base,
        defaults.ejection_max,
        defaults.max_ejection_percent,
    ) == (3, 10, 300, 50)
    tuned = args_of(
        "router.upstream.firstByteTimeoutSeconds=30",
        "router.upstream.silenceLimitSeconds=1200",
        "router.outlierDetection.consecutiveFailures=5",
        "router.outlierDetection.maxEjectionPercent=0",
    )
    assert (tuned.first_byte_timeout, tuned.silence_limit) == (30, 1200)
    assert (tuned.eject_after, tuned.max_ejection_percent) == (5, 0)
    assert "consecutiveFailures: Must be greater than or equal to 1" in template_error(
        "router.outlierDetection.consecutiveFailures=0"
    )
