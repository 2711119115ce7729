"""`kvpilot operator` flags and the kopf wiring (no cluster)."""

from __future__ import annotations

import argparse

import kopf

from kvpilot.operator.cli import DEFAULT_IMAGE, add_arguments, make_login
from kvpilot.operator.controller import ReconcileController
from kvpilot.operator.handlers import build_registry, configure_settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    args = parse()
    assert args.namespace == [] and not args.all_namespaces
    assert args.image == DEFAULT_IMAGE
    assert (args.health_port, args.metrics_port) == (8081, 8080)
    assert args.leader_elect is True and args.leader_election_name == "kvpilot-operator"


def test_flags() -> None:
    args = parse(
        "--kubeconfig", "/k", "-n", "a", "-n", "b", "--image", "x:1", "--no-leader-elect", "--workers", "8"
    )
    assert (args.kubeconfig, args.namespace, args.image, args.leader_elect, args.workers) == (
        "/k", ["a", "b"], "x:1", False, 8,
    )  # fmt: skip


def test_registry_has_stateless_event_handlers_only() -> None:
    ctrl = ReconcileController(lambda key: None)
    registry = build_registry(ctrl, login=lambda **_: None)
    selectors = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert selectors == {("kvpilot.dev", "inferencemodels"), ("apps", "deployments"), ("", "pods")}
    assert (
        not registry._changing.get_all_handlers()
    )  # no on.create/update: kopf writes nothing to our objects
    settings = configure_settings(kopf.OperatorSettings())
    assert settings.peering.standalone and not settings.posting.enabled


def test_login_reuses_the_client_configuration() -> None:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = "https://127.0.0.1:6443"
    cfg.api_key = {"BearerToken": "Bearer abc"}
    cfg.verify_ssl = False
    info = make_login(client.ApiClient(cfg))()
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://127.0.0.1:6443",
        "Bearer",
        "abc",
        True,
    )


async def test_status_only_updates_do_not_enqueue() -> None:
    keys: list[tuple[str, str]] = []

    class Recorder(ReconcileController):
        def enqueue(self, key: tuple[str, str]) -> None:
            keys.append(key)

    registry = build_registry(Recorder(lambda key: None))
    handler = next(
        h for h in registry._watching.get_all_handlers() if h.selector.any_name == "inferencemodels"
    )
    body = {"metadata": {"namespace": "ns", "name": "m", "uid": "u", "generation": 1}, "status": {}}

    async def send(kind: str | None, raw: dict) -> None:
        await handler.fn(type=kind, body=kopf.Body(raw))

    await send(None, body)  # listed at start
    await send("MODIFIED", {**body, "status": {"readyReplicas": 1}})  # our own status write
    await send("MODIFIED", {**body, "metadata": {**body["metadata"], "generation": 2}})  # a spec change
    await send("DELETED", body)
    await send("ADDED", body)  # re-created with the same name
    assert keys == [("ns", "m"), ("ns", "m"), ("ns", "m")]


def test_health_server_answers_200_as_leader_and_standby() -> None:
    import urllib.error
    import urllib.request

    from kvpilot.operator.cli import _Health, start_health_server

    server = start_health_server(0)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path in ("/healthz", "/livez", "/readyz"):
            with urllib.request.urlopen(base + path, timeout=5) as resp:
                assert (resp.status, resp.read()) == (200, b"ok (standby)\n")
        _Health.state["leading"] = True
        with urllib.request.urlopen(base + "/healthz", timeout=5) as resp:
            assert resp.read() == b"ok (leader)\n"
        try:
            urllib.request.urlopen(base + "/metrics", timeout=5)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as err:
            assert err.code == 404
    finally:
        _Health.state["leading"] = False
        server.shutdown()
        server.server_close()


def test_router_endpoint_flags() -> None:
    import pytest

    from kvpilot.operator.cli import parse_router_endpoints

    args = parse("--router-endpoint", "ml=http://r.kvpilot-system.svc:80/v1/")
    assert parse_router_endpoints(args.router_endpoint) == {"ml": "http://r.kvpilot-system.svc:80/v1"}
    with pytest.raises(SystemExit, match="--router-endpoint 'ml': expected NAMESPACE="):
        parse_router_endpoints(["ml"])
