"""The /healthz, /livez and /readyz server of the operator and the autoscaler (`--health-port`).

Each path maps to a check: a function, called on the server's thread for every request, that returns
a `Probe`. An ok probe answers 200, any other 503, with the probe's detail as a plain-text body, so
`kubectl port-forward` plus `curl` shows why a probe fails. Checks must be cheap and thread-safe: they
read state the process keeps up to date (a flag, a timestamp), they never do the work themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    ok: bool
    detail: str


Check = Callable[[], Probe]


def _handler(checks: Mapping[str, Check]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, with_body: bool) -> None:
            check = checks.get(self.path.split("?", 1)[0])
            if check is None:
                status, text = 404, "not found"
            else:
                try:
                    probe = check()
                except Exception as exc:  # a broken check is a failing probe, not a dead server
                    log.exception("health check %s failed", self.path)
                    probe = Probe(False, f"check raised {type(exc).__name__}: {exc}")
                status, text = (200 if probe.ok else 503), probe.detail
            body = (text.rstrip("\n") + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a probe every few seconds is not worth a log line

    return Handler


def start_health_server(port: int, checks: Mapping[str, Check], host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `checks` on a daemon thread; port 0 picks a free port (`server.server_address[1]`).

    `server.shutdown()` stops it.
    """
    server = ThreadingHTTPServer((host, port), _handler(dict(checks)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server


__all__ = ["Check", "Probe", "start_health_server"]
