"""`e2e/cluster up` keeps only healthy components: a live pid is not enough.

A stand-in component (a small HTTP server with a health endpoint, run under a component's name from a
throwaway state folder) is started through the same `_start()` that `up` uses for etcd, kube-apiserver
and the rest; no cluster is needed. Like a kube-apiserver that hangs after SIGTERM, it closes its port
on SIGTERM and stays alive.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import control_plane as cp
from kvpilot.net import free_port

NAME = "kvpilot-fake-component"
started: list[int] = []  # every stand-in a test started, killed afterwards
SERVER = """
import http.server, signal, sys, threading, time

port = int(sys.argv[1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", port), Health)


def hang(signum, frame):
    # Close the port and never exit: alive, but no longer serving (a hung shutdown).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, hang)
server.serve_forever()
server.server_close()
while True:
    time.sleep(3600)
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[cp.Settings, cp.Component, Path]]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    binary = bindir / NAME  # argv[0] names the component, as for the real binaries
    binary.symlink_to(Path(getattr(sys, "_base_executable", sys.executable)).resolve())
    settings = dataclasses.replace(cp.Settings.from_env(), state_dir=tmp_path / "state")
    port = free_port()
    component = cp.Component(
        name=NAME,
        # The state folder in the arguments marks the process as this cluster's (as --data-dir etc. do).
        args=["-c", SERVER, str(port), f"{settings.state_dir}/{NAME}"],
        env={},
        health_url=f"http://{cp.HOST}:{port}/healthz",
    )
    monkeypatch.setattr(cp, "UNHEALTHY_GRACE_S", 3.0)
    yield settings, component, binary
    for pid in {*started, cp.running_pid(settings, NAME)} - {None}:
        cp._kill_hard(pid)  # type: ignore[arg-type]
    started.clear()


def test_up_keeps_a_healthy_component_and_replaces_a_hung_one(
    fake: tuple[cp.Settings, cp.Component, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    settings, component, binary = fake
    cp._start(settings, component, binary, time.monotonic() + 30)
    first = cp.running_pid(settings, NAME)
    assert first is not None and cp._health(component) == "ok"
    started.append(first)

    cp._start(settings, component, binary, time.monotonic() + 30)  # healthy: kept
    assert cp.running_pid(settings, NAME) == first
    assert f"{NAME}: already running (pid {first})" in capsys.readouterr().out

    os.kill(first, signal.SIGTERM)  # closes its port, stays alive
    until = time.monotonic() + 10
    while cp._health(component) is not None and time.monotonic() < until:
        time.sleep(0.1)
    assert cp._health(component) is None
    assert cp.running_pid(settings, NAME) == first  # the pid file still names a live process

    cp._start(settings, component, binary, time.monotonic() + 30)
    out = capsys.readouterr().out
    assert f"pid {first} is alive but not healthy" in out and "killing it (SIGKILL)" in out
    second = cp.running_pid(settings, NAME)
    assert second is not None and second != first
    started.append(second)
    assert cp._is_zombie(first)  # gone (or about to be reaped)
    assert cp._health(component) == "ok"
