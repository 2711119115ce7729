"""`kvpilot operator`: run the InferenceModel operator (leader-elected, kopf watches, work queue)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

from kvpilot import __version__
from kvpilot.kube.health import Probe
from kvpilot.kube.health import start_health_server as serve_health

log = logging.getLogger("kvpilot.operator")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_IMAGE = f"kvpilot/kvpilot:{__version__}"


def parse_router_endpoints(specs: list[str]) -> dict[str, str]:
    """`NAMESPACE=URL` flags -> {namespace: url}; raises SystemExit naming the flag on a bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        ns, sep, url = spec.partition("=")
        if not sep or not ns or not url.startswith(("http://", "https://")):
            raise SystemExit(
                f"kvpilot operator: error: --router-endpoint {spec!r}: expected NAMESPACE=http(s)://URL"
            )
        out[ns] = url.rstrip("/")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpilot.operator.builders import DEFAULT_VLLM_CPU_IMAGE, DEFAULT_VLLM_IMAGE

    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces (default)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="runtime image when spec.image is unset")
    parser.add_argument(
        "--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"]
    )
    parser.add_argument(
        "--vllm-image",
        default=DEFAULT_VLLM_IMAGE,
        help="spec.engine vllm: the image of GPU pods when spec.image is unset (default %(default)s)",
    )
    parser.add_argument(
        "--vllm-cpu-image",
        default=DEFAULT_VLLM_CPU_IMAGE,
        help="spec.engine vllm: the image of CPU pods (resources.gpus 0) when spec.image is unset "
        "(default %(default)s, vLLM's x86 CPU build)",
    )
    parser.add_argument(
        "--router-endpoint",
        action="append",
        default=[],
        metavar="NAMESPACE=URL",
        help="a kvpilot router's base URL for a namespace's models, shown as status.routerEndpoint (repeatable)",
    )
    parser.add_argument("--workers", type=int, default=4, help="concurrent reconciles")
    parser.add_argument("--resync-seconds", type=float, default=60.0, help="reconcile every model this often")
    parser.add_argument("--health-port", type=int, default=8081, help="serves /healthz and /readyz (0: off)")
    parser.add_argument("--metrics-port", type=int, default=8080, help="serves Prometheus /metrics (0: off)")
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run only while holding the leader Lease (default on)",
    )
    parser.add_argument("--leader-election-namespace", help="namespace of the Lease (default: own namespace)")
    parser.add_argument("--leader-election-name", default="kvpilot-operator", help="name of the Lease")
    parser.add_argument(
        "--identity", help="leader-election identity (default: POD_NAME or hostname, plus pid)"
    )
    parser.add_argument("--log-level", default=os.environ.get("KVPILOT_LOG_LEVEL", "INFO"))


def _own_namespace() -> str:
    if SA_NAMESPACE_FILE.exists():
        return SA_NAMESPACE_FILE.read_text().strip()
    return os.environ.get("POD_NAMESPACE", "default")


class _Health:
    """What the operator's probes report: 200 on every path as soon as it serves, leader or standby."""

    state: ClassVar[dict[str, bool]] = {"leading": False}

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, "ok (leader)" if cls.state["leading"] else "ok (standby)")


def start_health_server(port: int) -> ThreadingHTTPServer:
    return serve_health(port, {path: _Health.probe for path in ("/healthz", "/livez", "/readyz")})


def make_login(api_client: Any) -> Any:
    """A kopf login handler that reuses the kubernetes client's configuration (kubeconfig or in-cluster)."""
    import kopf

    cfg = api_client.configuration

    def login(**_: Any) -> kopf.ConnectionInfo:
        # Calling through auth_settings() runs the client's refresh hook (exec plugins, token files).
        auth = str(cfg.auth_settings().get("BearerToken", {}).get("value") or "")
        scheme, _sep, token = auth.partition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert,
            insecure=not cfg.verify_ssl,
            scheme=scheme or None,
            token=token or None,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
            username=cfg.username or None,
            password=cfg.password or None,
        )

    return login


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from kvpilot.api.models import API_VERSION, KIND
    from kvpilot.kube.client import ApiKube, load_api_client
    from kvpilot.kube.lease import KubeLeaseStore, LeaderElector, default_identity, run_as_leader
    from kvpilot.operator import metrics
    from kvpilot.operator.builders import OperatorSettings
    from kvpilot.operator.controller import ReconcileController
    from kvpilot.operator.handlers import build_registry, configure_settings
    from kvpilot.operator.reconcile import Reconciler

    router_endpoints = parse_router_endpoints(args.router_endpoint)  # a bad flag fails before anything starts
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kopf logs every handled watch event at INFO; keep its lifecycle messages, drop the per-event ones.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("kopf.activities").setLevel(logging.WARNING)
    identity = args.identity or default_identity()
    api_client = load_api_client(args.kubeconfig, args.context)
    kube = ApiKube(api_client)
    settings = OperatorSettings(
        image=args.image,
        image_pull_policy=args.image_pull_policy,
        vllm_image=args.vllm_image,
        vllm_cpu_image=args.vllm_cpu_image,
        router_endpoints=router_endpoints,
    )
    reconciler = Reconciler(kube, settings, identity=identity)

    def reconcile_key(key: tuple[str, str]) -> None:
        body = kube.get(API_VERSION, KIND, key[0], key[1])  # always act on the latest version
        if body is not None:
            reconciler.reconcile(body)

    if args.health_port:
        start_health_server(args.health_port)
    if args.metrics_port:
        start_http_server(args.metrics_port)

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    def lead(lead_stop: threading.Event) -> int:
        _Health.state["leading"] = True
        metrics.LEADER.set(1)
        controller = ReconcileController(
            reconcile_key, workers=args.workers, resync_seconds=args.resync_seconds
        )
        registry = build_registry(controller, login=make_login(api_client))
        kopf_settings = configure_settings(kopf.OperatorSettings())

        async def main() -> None:
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            threading.Thread(
                target=lambda: (lead_stop.wait(), loop.call_soon_threadsafe(done.set)), daemon=True
            ).start()
            ctrl = asyncio.create_task(controller.run(done))
            try:
                await kopf.operator(
                    registry=registry,
                    settings=kopf_settings,
                    standalone=True,
                    clusterwide=not args.namespace,
                    namespaces=list(args.namespace),
                    stop_flag=lead_stop,
                )
            finally:
                # kopf may have stopped on its own (it handles SIGTERM in the loop); release its
                # executor thread that waits on the flag, else asyncio.run() waits for it forever.
                lead_stop.set()
                done.set()
                await ctrl

        try:
            asyncio.run(main())
        finally:
            controller.shutdown()
            _Health.state["leading"] = False
            metrics.LEADER.set(0)
        return 0

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    scope = ", ".join(args.namespace) if args.namespace else "all namespaces"
    log.info("kvpilot operator %s as %s, watching %s, image %s", __version__, identity, scope, args.image)
    if not args.leader_elect:
        return lead(stop)
    elector = LeaderElector(
        KubeLeaseStore(api_client),
        namespace=args.leader_election_namespace or _own_namespace(),
        name=args.leader_election_name,
        identity=identity,
    )
    return run_as_leader(elector, lead, stop)
