"""The worst stall a hostile structured-output request causes to another client's short request.

Starts `kvpilot serve` (SmolLM2, CPU) in a subprocess, measures short unconstrained requests
(`max_tokens` 1) back to back for a baseline, then sends one hostile request (a `guided_json` object
of `--props` optional integer properties, the user's reproduction) while the short requests go on,
and reports the longest a short request waited from the hostile request's start until it was
answered (or `--max-wait` seconds passed), with the hostile request's status and time and the
server's peak memory. Prints one JSON object.

It talks HTTP only, so it measures any version of the server: run it with PYTHONPATH at the tree
to measure, and pass new flags with --serve-args.

    .venv/bin/python benchmarks/grammar_bench.py stall [--props 2000] [--max-wait 120] \\
        [--serve-args "--grammar-compile-timeout 10"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from harness import cpu_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, str]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not get ready")


def peak_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


SHORT = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}


class ShortClient:
    """Short requests back to back until `stop`: (start, latency) of each, and when the one in
    flight started (a request stuck behind the hostile one counts with its wait so far)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout
        self.samples: list[tuple[float, float]] = []
        self.pending_since: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = self.pending_since = time.monotonic()
            with contextlib.suppress(OSError):
                post(self.url, SHORT, self.timeout)
            self.pending_since = None
            self.samples.append((t0, time.monotonic() - t0))
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--props", type=int, default=2000, help="optional properties of the hostile schema")
    ap.add_argument("--baseline-s", type=float, default=5.0, help="seconds of short requests alone")
    ap.add_argument("--max-wait", type=float, default=120.0, help="give up on the hostile request after this")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--serve-args", default="", help="more `kvpilot serve` flags")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvpilot", "serve", "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--max-model-len", "256", "--threads", str(args.threads), *shlex.split(args.serve_args)]
    with tempfile.TemporaryFile() as server_log:
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_ready(url, proc, 300)
            post(url, SHORT, 60)  # warm
            time.sleep(5)  # let start-up work in the background finish (grammar setup)
            short = ShortClient(url, args.max_wait + 60)
            short.thread.start()
            time.sleep(args.baseline_s)
            baseline = [lat for _, lat in short.samples]
            schema = {
                "type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(args.props)},
            }
            hostile: dict[str, Any] = {}

            def send() -> None:
                t0 = time.monotonic()
                try:
                    status, body = post(
                        url, {"prompt": "x", "max_tokens": 1, "guided_json": schema}, args.max_wait
                    )
                    hostile.update(status=status, message=json.loads(body).get("error", {}).get("message"))
                except (OSError, TimeoutError) as e:
                    hostile.update(status=None, message=f"no answer: {e}")
                hostile["seconds"] = round(time.monotonic() - t0, 2)

            h_start = time.monotonic()
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            sender.join(args.max_wait + 5)
            h_end = time.monotonic()
            time.sleep(1.0)  # a short request stuck behind the hostile one finishes after it
            short.stop.set()
            short.thread.join(5)
            # the longest wait of a short request in flight while the hostile one was
            during = [lat for t0, lat in list(short.samples) if t0 + lat >= h_start and t0 <= h_end]
            pending = short.pending_since
            if pending is not None:  # still waiting: stuck behind the hostile request
                during.append(time.monotonic() - pending)
            report = {
                "cpu": cpu_model(),
                "hostile": f"guided_json object of {args.props} optional integer properties "
                f"({len(json.dumps(schema))} bytes)",
                "serve_args": args.serve_args,
                "hostile_status": hostile.get("status"),
                "hostile_seconds": hostile.get("seconds"),
                "hostile_message": (hostile.get("message") or "")[:160],
                "short_baseline_ms": {
                    "p50": round(1000 * sorted(baseline)[len(baseline) // 2], 1) if baseline else None,
                    "max": round(1000 * max(baseline), 1) if baseline else None,
                    "n": len(baseline),
                },
                "short_worst_stall_during_hostile_ms": round(1000 * max(during), 1) if during else None,
                "short_requests_during_hostile": len(during),
                "server_peak_rss_mib": peak_rss_mib(proc.pid),
            }
            print(json.dumps(report, indent=2))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
