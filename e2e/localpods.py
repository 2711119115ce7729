"""A small "local kubelet" for e2e tests: real `kvpilot serve` processes for kwok's fake pods.

kwok marks pods Running and Ready without running containers. `LocalKubelet` watches a label
selector's pods and, for each Running one, runs the pod's container command (`kvpilot serve --config
/etc/kvpilot/config.yaml`, as the operator renders it, or `vllm serve --config ...` for a model with
spec.engine vllm, run by the local vLLM given in `executables`) as a local process on its own
127.0.0.1 port, with the pod's ConfigMap volumes written to a folder and the paths rewritten. Extra
flags (the test's `--device cpu --kv-cache-memory 64MiB --threads 1`; `command_args` gives them per
command, say vLLM's own) come last, so they override the config file, the same precedence both servers
give flags. A process counts as Ready once its container's readiness probe path answers 200 (/ready
for kvpilot's runtime, /health for vLLM).

When the pod goes away (kwok deletes pods at once) it does what a kubelet does on termination: the
endpoint leaves the routing table (`endpoints()`, what a Service would route to), the container's
preStop sleep runs, then SIGTERM, then SIGKILL once terminationGracePeriodSeconds has passed. Exit
codes are recorded; a test asserts that every runtime drained and exited 0.

With `pod_network=True` each process listens where the pod's own address says instead: on the pod's
status.podIP and its container port (8000), as in a real cluster, so a component that reaches pods by
podIP (the operator loading LoRA adapters) reaches the process. kwok takes pod IPs from the node's
spec.podCIDR, so a test gives its node a CIDR inside 127.0.0.0/8 (all of it is loopback on Linux);
a pod IP outside it cannot be bound here and is reported as an error, the pod left unstarted.

It also keeps a Prometheus file_sd targets file: one target per live process, labelled with
namespace, pod and model_name, so a real Prometheus scrapes the runtimes as it would pods.

The container's env is not applied (HOME, XDG_CACHE_HOME... describe the container's filesystem).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.net import free_port

log = logging.getLogger("e2e.localpods")

MODEL_LABEL = "kvpilot.dev/model"


@dataclass
class LocalPod:
    """One pod's runtime process and what happened to it (times are time.time())."""

    name: str
    uid: str
    model: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    prestop_s: float
    grace_s: float
    started_at: float
    ready_path: str = "/ready"
    ready_at: float | None = None
    deleted_at: float | None = None  # when the shim saw the pod deleted or gone
    sigterm_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    killed: bool = False  # SIGKILLed after the grace period
    crashed: bool = False  # exited while its pod still existed
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def terminating(self) -> bool:
        return self.deleted_at is not None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _container_argv(
    pod: Mapping[str, Any],
    configmaps: Callable[[str], Mapping[str, str]],
    workdir: Path,
    executables: Mapping[str, str] | None = None,
) -> list[str]:
    """The first container's command + args, runnable here: `kvpilot` becomes this interpreter's
    `-m kvpilot`, another command named in `executables` that executable (`vllm`: a local vLLM), and
    paths under a ConfigMap volume mount point at a local copy of its data."""
    spec = pod["spec"]
    container = spec["containers"][0]
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if not argv:
        raise ValueError(f"pod {pod['metadata']['name']}: container has no command")
    if argv[0] == "kvpilot":
        argv = [sys.executable, "-m", "kvpilot", *argv[1:]]
    elif executables and argv[0] in executables:
        argv = [executables[argv[0]], *argv[1:]]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"]) or {}
        cm = volume.get("configMap")
        if not cm:
            continue
        local = workdir / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, value in configmaps(cm["name"]).items():
            (local / key).write_text(value)
        mounts[mount["mountPath"].rstrip("/")] = local
    out = []
    for arg in argv:
        for path, local in mounts.items():
            if arg == path or arg.startswith(path + "/"):
                arg = str(local) + arg[len(path) :]
        out.append(arg)
    return out


def _prestop_and_grace(pod: Mapping[str, Any]) -> tuple[float, float]:
    spec = pod["spec"]
    container = spec["containers"][0]
    sleep = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    grace = spec.get("terminationGracePeriodSeconds")
    return float(sleep.get("seconds") or 0), float(30 if grace is None else grace)


def _readiness_path(pod: Mapping[str, Any]) -> str:
    """The path of the first container's HTTP readiness probe (/ready when it has none)."""
    probe = pod["spec"]["containers"][0].get("readinessProbe") or {}
    return str((probe.get("httpGet") or {}).get("path") or "/ready")


def _container_port(pod: Mapping[str, Any]) -> int:
    ports = pod["spec"]["containers"][0].get("ports") or []
    return int(ports[0]["containerPort"]) if ports else 8000


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        return False


class LocalKubelet:
    """Run a real runtime process for each Running pod matching `selector` in `namespace`."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        selector: str,
        workdir: Path,
        extra_args: Sequence[str] = (),
        targets_file: Path | None = None,
        poll_s: float = 0.5,
        max_prestop_s: float | None = None,
        env: Mapping[str, str] | None = None,
        pod_network: bool = False,
        executables: Mapping[str, str] | None = None,
        command_args: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.selector = selector
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.targets_file = targets_file
        self.poll_s = poll_s
        self.max_prestop_s = max_prestop_s
        self.env = dict(env if env is not None else os.environ)
        self.pod_network = pod_network
        self.executables = dict(executables or {})
        # container command (its first word) -> the flags appended instead of extra_args
        self.command_args = {k: list(v) for k, v in (command_args or {}).items()}
        self.pods: dict[str, LocalPod] = {}  # by uid, including finished ones
        self.errors: list[str] = []
        self.refused: set[str] = set()  # uids of pods whose podIP cannot be bound here
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._terminators: list[threading.Thread] = []
        self._written_targets: str | None = None
        if targets_file is not None:
            self._write_targets()

    # -- public ----------------------------------------------------------------------------------

    def start(self) -> LocalKubelet:
        self._thread = threading.Thread(target=self._loop, name="local-kubelet", daemon=True)
        self._thread.start()
        return self

    def endpoints(self) -> list[str]:
        """Base URLs a Service would route to now: Ready processes of pods that still exist."""
        with self._lock:
            return sorted(p.url for p in self.pods.values() if p.ready_at is not None and not p.terminating)

    def ready_urls(self) -> dict[str, str]:
        """{pod name: base URL} of the Ready processes of pods that still exist (pod networking for a
        router that discovers pods by name through the API server)."""
        with self._lock:
            return {p.name: p.url for p in self.pods.values() if p.ready_at is not None and not p.terminating}

    def live(self) -> list[LocalPod]:
        with self._lock:
            return [p for p in self.pods.values() if p.exit_code is None]

    def all_pods(self) -> list[LocalPod]:
        with self._lock:
            return list(self.pods.values())

    def stop(self, timeout: float = 60.0) -> None:
        """Stop watching; terminate every process still running (SIGTERM, then SIGKILL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for p in self.live():
            if p.sigterm_at is None:
                p.deleted_at = p.deleted_at or time.time()
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.live():
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.killed = True
                p.proc.kill()
                p.proc.wait()
            self._record_exit(p)
        for t in self._terminators:
            t.join(timeout=5)

    # -- loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # the API server hiccuped; the next poll retries
                log.warning("local kubelet sync failed: %s", exc)
            self._stop.wait(self.poll_s)

    def sync(self) -> None:
        resp: Any = self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector, _preload_content=False
        )
        items = json.loads(resp.data).get("items") or []
        seen: dict[str, dict[str, Any]] = {p["metadata"]["uid"]: p for p in items}
        for uid, pod in seen.items():
            meta, status = pod["metadata"], pod.get("status") or {}
            if (
                uid not in self.pods
                and uid not in self.refused
                and not meta.get("deletionTimestamp")
                and status.get("phase") == "Running"
                and (status.get("podIP") or not self.pod_network)
            ):
                self._start(pod)
        for uid, lp in list(self.pods.items()):
            current = seen.get(uid)
            gone = current is None or bool(current["metadata"].get("deletionTimestamp"))
            if gone and lp.deleted_at is None:
                self._terminate(lp)
            self._check(lp)
        self._write_targets()

    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta["uid"]
        pod_dir = self.workdir / name
        pod_dir.mkdir(parents=True, exist_ok=True)

        def configmap(cm: str) -> Mapping[str, str]:
            resp: Any = self.core.read_namespaced_config_map(cm, self.namespace, _preload_content=False)
            obj = json.loads(resp.data)
            data: dict[str, str] = obj.get("data") or {}
            return data

        host, port = "127.0.0.1", 0
        if self.pod_network:
            host, port = pod["status"]["podIP"], _container_port(pod)
            if not _loopback(host):
                self.refused.add(uid)
                self.errors.append(f"pod {name}: podIP {host} is not in 127.0.0.0/8; not started")
                return
        else:
            port = free_port()
        command = (pod["spec"]["containers"][0].get("command") or [""])[0]
        argv = [
            *_container_argv(pod, configmap, pod_dir, self.executables),
            "--host",
            host,
            "--port",
            str(port),
            *self.command_args.get(command, self.extra_args),
        ]
        prestop, grace = _prestop_and_grace(pod)
        if self.max_prestop_s is not None:
            prestop = min(prestop, self.max_prestop_s)
        log_path = pod_dir / "runtime.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        model = (meta.get("labels") or {}).get(MODEL_LABEL, "")
        lp = LocalPod(
            name,
            uid,
            model,
            port,
            proc,
            log_path,
            prestop,
            grace,
            time.time(),
            _readiness_path(pod),
            host=host,
        )
        with self._lock:
            self.pods[uid] = lp
        log.info("pod %s: started %s (pid %d, %s:%d)", name, " ".join(argv), proc.pid, host, port)

    def _check(self, lp: LocalPod) -> None:
        """Readiness probe (GET the container's probe path) until Ready; notice processes that exit."""
        if lp.exit_code is not None:
            return
        code = lp.proc.poll()
        if code is not None:
            self._record_exit(lp)
            return
        if lp.ready_at is None and not lp.terminating:
            try:
                with urllib.request.urlopen(f"{lp.url}{lp.ready_path}", timeout=1) as resp:
                    if resp.status == 200:
                        with self._lock:
                            lp.ready_at = time.time()
                        log.info("pod %s: ready after %.1fs", lp.name, lp.ready_at - lp.started_at)
            except OSError:
                pass

    def _record_exit(self, lp: LocalPod) -> None:
        code = lp.proc.poll()
        if code is None or lp.exit_code is not None:
            return
        with self._lock:
            lp.exit_code = code
            lp.exited_at = time.time()
            if lp.sigterm_at is None:
                lp.crashed = True
                self.errors.append(f"pod {lp.name}: runtime exited {code} while its pod existed")
        log.info("pod %s: runtime exited %d", lp.name, code)

    def _terminate(self, lp: LocalPod) -> None:
        """Pod deleted: out of the endpoints now, preStop sleep, SIGTERM, SIGKILL after the grace period."""
        with self._lock:
            lp.deleted_at = time.time()
        log.info("pod %s: deleted; preStop %.0fs then SIGTERM", lp.name, lp.prestop_s)

        def run() -> None:
            deadline = lp.deleted_at + lp.grace_s if lp.deleted_at else time.time() + lp.grace_s
            if lp.prestop_s > 0:
                time.sleep(lp.prestop_s)
            self._signal(lp, signal.SIGTERM)
            try:
                lp.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                lp.killed = True
                self.errors.append(f"pod {lp.name}: still running after the grace period; SIGKILL")
                lp.proc.kill()
                lp.proc.wait()
            self._record_exit(lp)

        t = threading.Thread(target=run, name=f"terminate-{lp.name}", daemon=True)
        self._terminators.append(t)
        t.start()

    def _signal(self, lp: LocalPod, sig: signal.Signals) -> None:
        if lp.proc.poll() is None:
            with self._lock:
                if sig == signal.SIGTERM and lp.sigterm_at is None:
                    lp.sigterm_at = time.time()
            with contextlib.suppress(ProcessLookupError):
                lp.proc.send_signal(sig)

    # -- Prometheus service discovery --------------------------------------------------------------

    def _write_targets(self) -> None:
        """file_sd JSON: every process still running (a terminating pod is scraped until it exits)."""
        if self.targets_file is None:
            return
        with self._lock:
            groups = [
                {
                    "targets": [f"{p.host}:{p.port}"],
                    "labels": {"namespace": self.namespace, "pod": p.name, "model_name": p.model},
                }
                for p in sorted(self.pods.values(), key=lambda p: p.name)
                if p.exit_code is None
            ]
        text = json.dumps(groups, indent=1)
        if text == self._written_targets:
            return
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.targets_file)  # Prometheus never reads a half-written file
        self._written_targets = text


@dataclass
class LoadResult:
    """What a load generator saw: one entry per request."""

    statuses: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    endpoints_used: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.statuses)

    @property
    def failed(self) -> int:
        return sum(1 for s, f in zip(self.statuses, self.finish_reasons, strict=True) if s != 200 or not f)


async def openai_load(
    endpoints: Callable[[], Sequence[str]],
    model: str,
    *,
    concurrency: int,
    max_requests: int,
    duration_s: float,
    max_tokens: int,
    prompt: str = "Write a short story about a lighthouse keeper.",
    stop: Callable[[], bool] | None = None,
    request_timeout_s: float = 300.0,
) -> LoadResult:
    """Closed-loop load with the official `openai` async client: `concurrency` workers each send one
    completion at a time (max_tokens with ignore_eos, so every request has the same length) to the
    current endpoints round-robin, until max_requests were sent, duration_s passed or stop() is true.
    No retries: a 429, 503 or cut connection is recorded as a failure, not hidden."""
    import asyncio

    import openai

    result = LoadResult()
    clients: dict[str, openai.AsyncOpenAI] = {}
    started = time.monotonic()
    sent = 0
    rr = 0

    def client_for(url: str) -> openai.AsyncOpenAI:
        if url not in clients:
            clients[url] = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=request_timeout_s
            )
        return clients[url]

    def more() -> bool:
        return sent < max_requests and time.monotonic() - started < duration_s and not (stop and stop())

    async def worker() -> None:
        nonlocal sent, rr
        while more():
            urls = endpoints()
            if not urls:
                await asyncio.sleep(0.2)
                continue
            url = urls[rr % len(urls)]
            rr += 1
            sent += 1
            t0 = time.monotonic()
            status, finish, error = 0, None, None
            try:
                raw = await client_for(url).completions.with_raw_response.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                status = raw.http_response.status_code
                finish = raw.parse().choices[0].finish_reason
            except openai.APIStatusError as exc:
                status, error = exc.status_code, f"{url}: HTTP {exc.status_code}: {exc.message}"
            except openai.APIError as exc:
                error = f"{url}: {type(exc).__name__}: {exc}"
            result.statuses.append(status)
            result.finish_reasons.append(finish)
            result.latencies_s.append(time.monotonic() - t0)
            result.endpoints_used[url] = result.endpoints_used.get(url, 0) + 1
            if error:
                result.errors.append(error)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for c in clients.values():
            await c.close()
    return result
