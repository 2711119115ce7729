"""A real Kubernetes control plane on 127.0.0.1 for the e2e tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (standing in for kubelets on fake GPU nodes).

`e2e/cluster` is the command-line entry point; this module does the work. Standard library only,
plus the `go` and `openssl` commands. Binaries are built once from the Go module in e2e/k8s into a
cache folder keyed by the Kubernetes version; everything a running cluster needs (certificates,
kubeconfigs, etcd data, pid files, logs) lives in the state folder, e2e/.state by default.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
GO_MODULE_DIR = E2E_DIR / "k8s"
KWOK_STAGES = E2E_DIR / "kwok" / "stages.yaml"

HOST = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
E2E_NODE_LABEL = "kvpilot.dev/e2e-node"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


@dataclass(frozen=True)
class Settings:
    """Everything that can be overridden from the environment, read once."""

    cache_root: Path
    state_dir: Path
    etcd_port: int
    apiserver_port: int
    controller_manager_port: int
    scheduler_port: int
    kwok_port: int
    nodes: int
    gpus_per_node: int
    timeout_s: float
    assets_dir: Path | None

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("KVPILOT_E2E_CACHE") or str(Path.home() / ".cache" / "kvpilot-e2e")
        state = os.environ.get("KVPILOT_E2E_STATE") or str(E2E_DIR / ".state")
        assets = os.environ.get("KUBEBUILDER_ASSETS")
        return cls(
            cache_root=Path(cache).expanduser().resolve(),
            state_dir=Path(state).expanduser().resolve(),
            etcd_port=_env_int("KVPILOT_E2E_ETCD_PORT", 12379),
            apiserver_port=_env_int("KVPILOT_E2E_APISERVER_PORT", 16443),
            controller_manager_port=_env_int("KVPILOT_E2E_CONTROLLER_MANAGER_PORT", 16257),
            scheduler_port=_env_int("KVPILOT_E2E_SCHEDULER_PORT", 16259),
            kwok_port=_env_int("KVPILOT_E2E_KWOK_PORT", 16247),
            nodes=_env_int("KVPILOT_E2E_NODES", 2),
            gpus_per_node=_env_int("KVPILOT_E2E_GPUS_PER_NODE", 8),
            timeout_s=float(_env_int("KVPILOT_E2E_TIMEOUT", 180)),
            assets_dir=Path(assets).expanduser().resolve() if assets else None,
        )

    # State layout.
    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def run(self) -> Path:
        return self.state_dir / "run"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    def component_kubeconfig(self, name: str) -> Path:
        return self.state_dir / "kubeconfigs" / f"{name}.kubeconfig"

    @property
    def server_url(self) -> str:
        return f"https://{HOST}:{self.apiserver_port}"


# --------------------------------------------------------------------------------------------
# Binaries
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binary:
    name: str
    package: str  # main package built with `go build`
    module: str  # module whose version the binary carries


BINARIES = (
    Binary("etcd", "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/server/v3"),
    Binary("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes"),
    Binary("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager", "k8s.io/kubernetes"),
    Binary("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes"),
    Binary("kubectl", "k8s.io/kubernetes/cmd/kubectl", "k8s.io/kubernetes"),
    Binary("kwok", "sigs.k8s.io/kwok/cmd/kwok", "sigs.k8s.io/kwok"),
)


def module_versions() -> dict[str, str]:
    """Versions required by e2e/k8s/go.mod (the pins), e.g. {"k8s.io/kubernetes": "v1.36.1"}."""
    text = (GO_MODULE_DIR / "go.mod").read_text()
    wanted = {b.module for b in BINARIES}
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(?:require\s+)?(\S+)\s+(v\S+)", line)
        if match and match.group(1) in wanted:
            found[match.group(1)] = match.group(2)
    missing = wanted - found.keys()
    if missing:
        raise SystemExit(f"e2e/k8s/go.mod does not require {sorted(missing)}")
    return found


def cache_bin_dir(settings: Settings) -> Path:
    return settings.cache_root / module_versions()["k8s.io/kubernetes"] / "bin"


def _stamp(binary: Binary, versions: dict[str, str]) -> str:
    return f"{binary.module} {versions[binary.module]}\n"


def resolve_binary(settings: Settings, binary: Binary) -> Path | None:
    """KUBEBUILDER_ASSETS wins when it holds the binary; else the cache, if built from the pinned version."""
    if settings.assets_dir is not None:
        candidate = settings.assets_dir / binary.name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    candidate = cache_bin_dir(settings) / binary.name
    stamp = candidate.with_name(f".{binary.name}.version")
    if candidate.is_file() and stamp.is_file() and stamp.read_text() == _stamp(binary, module_versions()):
        return candidate
    return None


def missing_binaries(settings: Settings) -> list[Binary]:
    return [b for b in BINARIES if resolve_binary(settings, b) is None]


def binary_path(settings: Settings, name: str) -> Path:
    binary = next(b for b in BINARIES if b.name == name)
    path = resolve_binary(settings, binary)
    if path is None:
        raise SystemExit(f"{name} is not built; run: e2e/cluster build")
    return path


def _kube_version_ldflags(version: str) -> str:
    """What hack/lib/version.sh sets, so servers report e.g. v1.36.1 rather than v0.0.0-master."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(flags)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(settings: Settings) -> None:
    """Build whatever is missing, one binary at a time (the link steps are memory hungry)."""
    versions = module_versions()
    out_dir = cache_bin_dir(settings)
    if shutil.which("go") is None:
        raise SystemExit("the `go` command is needed to build the control plane binaries")
    with _file_lock(out_dir.parent / ".build.lock"):
        todo = missing_binaries(settings)
        if not todo:
            print(f"all binaries present in {out_dir}")
            return
        env = {**os.environ, "GOWORK": "off", "CGO_ENABLED": "0"}
        started = time.monotonic()
        for binary in todo:
            target = out_dir / binary.name
            ldflags = "-s -w"
            if binary.module == "k8s.io/kubernetes":
                ldflags += " " + _kube_version_ldflags(versions[binary.module])
            print(f"building {binary.name} ({binary.module} {versions[binary.module]}) ...", flush=True)
            t0 = time.monotonic()
            tmp = target.with_name(f".{binary.name}.tmp")
            subprocess.run(
                ["go", "build", "-trimpath", f"-ldflags={ldflags}", "-o", str(tmp), binary.package],
                cwd=GO_MODULE_DIR,
                env=env,
                check=True,
            )
            tmp.replace(target)
            target.with_name(f".{binary.name}.version").write_text(_stamp(binary, versions))
            print(f"  {binary.name}: {time.monotonic() - t0:.0f}s", flush=True)
        print(f"built {len(todo)} binaries into {out_dir} in {time.monotonic() - started:.0f}s")


# --------------------------------------------------------------------------------------------
# Certificates and kubeconfigs
# --------------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_ca(pki: Path, name: str, cn: str) -> None:
    if (pki / f"{name}.crt").exists():
        return
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", f"/CN={cn}",
        "-keyout", str(pki / f"{name}.key"), "-out", str(pki / f"{name}.crt"),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign",
    )  # fmt: skip


def _make_cert(
    pki: Path, name: str, ca: str, subject: str, usage: str, sans: list[str] | None = None
) -> None:
    """A key pair signed by `ca`; usage is serverAuth or clientAuth."""
    if (pki / f"{name}.crt").exists():
        return
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    with tempfile.TemporaryDirectory() as tmp:
        csr, extfile = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        extfile.write_text("\n".join(ext) + "\n")
        _openssl(
            "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
            "-keyout", str(pki / f"{name}.key"), "-out", str(csr),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key"),
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "3650",
            "-extfile", str(extfile), "-out", str(pki / f"{name}.crt"),
        )  # fmt: skip


# Client identities: (file name, subject). The component names are the users the bootstrap RBAC
# policy already grants (system:kube-controller-manager, system:kube-scheduler).
CLIENTS = {
    "admin": "/O=system:masters/CN=kvpilot-e2e-admin",
    "kube-controller-manager": "/CN=system:kube-controller-manager",
    "kube-scheduler": "/CN=system:kube-scheduler",
    # kwok plays the kubelet of every fake node at once, so it cannot be a single system:node:<name>.
    "kwok": "/O=system:masters/CN=kwok-controller",
    # kube-apiserver's identity towards a real kubelet (logs, exec, port-forward on e2e/kubelet_node.py's node).
    "kube-apiserver-kubelet-client": "/O=system:masters/CN=kube-apiserver-kubelet-client",
}


def ensure_pki(settings: Settings) -> None:
    pki = settings.pki
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    _make_ca(pki, "ca", "kvpilot-e2e-ca")
    _make_ca(pki, "front-proxy-ca", "kvpilot-e2e-front-proxy-ca")
    sans = [
        "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local", f"IP:{HOST}", f"IP:{KUBERNETES_SERVICE_IP}",
    ]  # fmt: skip
    _make_cert(pki, "apiserver", "ca", "/CN=kube-apiserver", "serverAuth", sans)
    for name, subject in CLIENTS.items():
        _make_cert(pki, name, "ca", subject, "clientAuth")
    _make_cert(pki, "front-proxy-client", "front-proxy-ca", "/CN=front-proxy-client", "clientAuth")
    if not (pki / "sa.key").exists():
        _openssl(
            "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki / "sa.key")
        )
        _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def _kubeconfig(settings: Settings, user: str) -> str:
    def data(name: str) -> str:
        return b64encode((settings.pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kvpilot-e2e",
                "cluster": {"server": settings.server_url, "certificate-authority-data": data("ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": data(f"{user}.crt"),
                    "client-key-data": data(f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "kvpilot-e2e", "context": {"cluster": "kvpilot-e2e", "user": user}}],
        "current-context": "kvpilot-e2e",
    }
    return json.dumps(config, indent=2) + "\n"  # JSON is YAML; kubectl reads it as is.


def ensure_kubeconfigs(settings: Settings) -> None:
    # Rewritten on every `up`: cheap, and picks up a changed apiserver port.
    (settings.state_dir / "kubeconfigs").mkdir(parents=True, exist_ok=True)
    for user in CLIENTS:
        path = settings.kubeconfig if user == "admin" else settings.component_kubeconfig(user)
        path.write_text(_kubeconfig(settings, user))
        path.chmod(0o600)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    name: str  # also the binary name
    args: list[str]
    env: dict[str, str]
    health_url: str
    # Client certificate for the health check: (cert, key), or None for no client certificate.
    client_cert: tuple[Path, Path] | None = None
    verify_ca: Path | None = None


def components(settings: Settings) -> list[Component]:
    """Start order; `down` stops them in reverse."""
    s, pki = settings, settings.pki
    etcd_peer = s.etcd_port + 1
    certs = s.state_dir / "serving-certs"

    def auth(name: str) -> list[str]:
        kc = str(s.component_kubeconfig(name))
        return [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"]

    return [
        Component(
            "etcd",
            [
                "--name=kvpilot-e2e",
                f"--data-dir={s.state_dir / 'etcd'}",
                f"--listen-client-urls=http://{HOST}:{s.etcd_port}",
                f"--advertise-client-urls=http://{HOST}:{s.etcd_port}",
                f"--listen-peer-urls=http://{HOST}:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://{HOST}:{etcd_peer}",
                f"--initial-cluster=kvpilot-e2e=http://{HOST}:{etcd_peer}",
                "--unsafe-no-fsync=true",  # throwaway data; fsync dominates on a busy disk
                "--log-level=warn",
            ],
            {},
            f"http://{HOST}:{s.etcd_port}/health",
        ),
        Component(
            "kube-apiserver",
            [
                f"--etcd-servers=http://{HOST}:{s.etcd_port}",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                # The `kubernetes` Service cannot have a loopback endpoint (validation rejects it, every
                # 10 s); nothing runs in pods here, so leave its endpoints unmanaged.
                "--endpoint-reconciler-type=none",
                f"--secure-port={s.apiserver_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",  # added to the default set, as kubeadm does
                "--allow-privileged=true",
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                f"--cert-dir={certs / 'kube-apiserver'}",
                # Only the real node (e2e/kubelet_node.py) has a kubelet: reached by its InternalIP
                # (its name does not resolve), with a client certificate its webhook authorizer accepts.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-client-certificate={pki / 'kube-apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kube-apiserver-kubelet-client.key'}",
                "--profiling=false",
            ],
            {},
            f"{s.server_url}/readyz",
            client_cert=(pki / "admin.crt", pki / "admin.key"),
            verify_ca=pki / "ca.crt",
        ),
        Component(
            "kube-controller-manager",
            [
                *auth("kube-controller-manager"),
                f"--bind-address={HOST}",
                f"--secure-port={s.controller_manager_port}",
                f"--cert-dir={certs / 'kube-controller-manager'}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=kvpilot-e2e",
                "--leader-elect=false",
                # kwokctl's defaults: notice a stopped kwok quickly.
                "--node-monitor-period=5s",
                "--node-monitor-grace-period=40s",
                "--profiling=false",
            ],
            {},
            f"https://{HOST}:{s.controller_manager_port}/healthz",
        ),
        Component(
            "kube-scheduler",
            [
                *auth("kube-scheduler"),
                f"--bind-address={HOST}",
                f"--secure-port={s.scheduler_port}",
                f"--cert-dir={certs / 'kube-scheduler'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
            {},
            f"https://{HOST}:{s.scheduler_port}/healthz",
        ),
        Component(
            "kwok",
            [
                f"--kubeconfig={s.component_kubeconfig('kwok')}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.240.0.1",
                f"--server-address={HOST}:{s.kwok_port}",
            ],
            # kwok also loads $KWOK_WORKDIR/kwok.yaml when present; keep a user's ~/.kwok out of it.
            {"KWOK_WORKDIR": str(s.state_dir / "kwok")},
            f"http://{HOST}:{s.kwok_port}/healthz",
        ),
    ]


def _pid_file(settings: Settings, name: str) -> Path:
    return settings.run / f"{name}.pid"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _belongs_to(settings: Settings, pid: int, name: str) -> bool:
    """A live process running `name` with this state folder in its arguments (guards against pid reuse
    and against another checkout's cluster)."""
    argv = _cmdline(pid)
    if not argv or Path(argv[0]).name != name or _is_zombie(pid):
        return False
    state = f"{settings.state_dir}/"
    return any(state in arg for arg in argv[1:])


def running_pid(settings: Settings, name: str) -> int | None:
    try:
        pid = int(_pid_file(settings, name).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _belongs_to(settings, pid, name) else None


def _stray_pids(settings: Settings) -> list[tuple[int, str]]:
    """Processes of any component for this state folder, with or without a pid file."""
    names = {b.name for b in BINARIES}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            argv = _cmdline(pid)
            if argv and Path(argv[0]).name in names and _belongs_to(settings, pid, Path(argv[0]).name):
                found.append((pid, Path(argv[0]).name))
    return found


def _port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def _health(component: Component, timeout: float = 3.0) -> str | None:
    """The body of the health endpoint when it answers 200, else None."""
    context: ssl.SSLContext | None = None
    if component.health_url.startswith("https"):
        if component.verify_ca is not None:
            context = ssl.create_default_context(cafile=str(component.verify_ca))
        else:  # kube-controller-manager and kube-scheduler serve a self-signed in-memory certificate
            context = ssl._create_unverified_context()
        if component.client_cert is not None:
            context.load_cert_chain(str(component.client_cert[0]), str(component.client_cert[1]))
    try:
        with urllib.request.urlopen(component.health_url, timeout=timeout, context=context) as response:
            return response.read().decode(errors="replace") if response.status == 200 else None
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return None


def _log_tail(settings: Settings, name: str, lines: int = 30) -> str:
    path = settings.logs / f"{name}.log"
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait(what: str, check: Callable[[], bool], deadline: float, failed: Callable[[], str | None]) -> None:
    while True:
        if check():
            return
        reason = failed()
        if reason is not None:
            raise SystemExit(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


# How long `up` gives a live component to answer its health check before it counts as hung (a process
# that is still starting answers well within this; one that hangs after SIGTERM never does).
UNHEALTHY_GRACE_S = 20.0


def _healthy_within(component: Component, grace_s: float) -> bool:
    until = time.monotonic() + grace_s
    while True:
        if _health(component) is not None:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.5)


def _kill_hard(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL a component's process group (and the process) and wait until it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    until = time.monotonic() + timeout_s
    while not _is_zombie(pid) and time.monotonic() < until:
        time.sleep(0.1)


def _start(settings: Settings, component: Component, binary: Path, deadline: float) -> None:
    pid = running_pid(settings, component.name)
    if pid is None:  # running but its pid file is gone: adopt it rather than start a second one
        strays = [p for p, name in _stray_pids(settings) if name == component.name]
        if strays:
            pid = strays[0]
            settings.run.mkdir(parents=True, exist_ok=True)
            _pid_file(settings, component.name).write_text(f"{pid}\n")
    if pid is not None:
        # A live pid is not a working component: one can hang after SIGTERM (alive, port closed) or
        # wedge. Only a healthy one is kept; a hung one is killed hard and replaced.
        if _healthy_within(component, min(UNHEALTHY_GRACE_S, max(0.0, deadline - time.monotonic()))):
            print(f"{component.name}: already running (pid {pid})")
            return
        print(
            f"{component.name}: pid {pid} is alive but not healthy ({component.health_url}) for "
            f"{UNHEALTHY_GRACE_S:.0f} s: killing it (SIGKILL) and starting a new one"
        )
        for stray in {pid, *(p for p, name in _stray_pids(settings) if name == component.name)}:
            _kill_hard(stray)
        _pid_file(settings, component.name).unlink(missing_ok=True)
    port = int(component.health_url.rsplit(":", 1)[1].split("/")[0])
    if pid is not None:  # the killed process's listening socket can outlive it by a moment
        until = time.monotonic() + 10
        while _port_in_use(port) and time.monotonic() < until:
            time.sleep(0.2)
    if _port_in_use(port):
        raise SystemExit(
            f"{component.name}: port {HOST}:{port} is taken by another process; "
            f"stop it or choose other ports (see e2e/README.md)"
        )
    settings.logs.mkdir(parents=True, exist_ok=True)
    settings.run.mkdir(parents=True, exist_ok=True)
    log = (settings.logs / f"{component.name}.log").open("ab")
    log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {component.name}\n".encode())
    log.flush()
    proc = subprocess.Popen(
        [str(binary), *component.args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=settings.state_dir,
        env={**os.environ, **component.env},
        start_new_session=True,  # its own process group: survives this command, stopped by `down`
    )
    log.close()
    _pid_file(settings, component.name).write_text(f"{proc.pid}\n")

    def exited() -> str | None:
        code = proc.poll()
        if code is None:
            return None
        return f"exited with code {code}; last lines of {settings.logs / component.name}.log:\n" + _log_tail(
            settings, component.name
        )

    _wait(f"{component.name} health ({component.health_url})", lambda: _health(component) is not None,
          deadline, exited)  # fmt: skip
    print(f"{component.name}: started (pid {proc.pid}), log {settings.logs / component.name}.log")


def _stop_pid(pid: int, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)  # the component leads its own process group
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not _is_zombie(pid):
        time.sleep(0.1)
    if not _is_zombie(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Fake GPU nodes
# --------------------------------------------------------------------------------------------


def node_manifests(settings: Settings) -> dict[str, object]:
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(settings.gpus_per_node),
    }
    items = []
    for index in range(settings.nodes):
        name = f"kvpilot-gpu-{index}"
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        "nvidia.com/gpu.present": "true",
                        "nvidia.com/gpu.product": GPU_PRODUCT,
                        "nvidia.com/gpu.count": str(settings.gpus_per_node),
                        "kvpilot.dev/gpu-type": "h100",
                        E2E_NODE_LABEL: "true",
                    },
                },
                "spec": {},
                # Status on create is kept; kwok's node-initialize stage preserves capacity/allocatable.
                "status": {"capacity": resources, "allocatable": resources},
            }
        )
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _kubectl(settings: Settings, *args: str, input_text: str | None = None) -> str:
    result = subprocess.run(
        [str(binary_path(settings, "kubectl")), f"--kubeconfig={settings.kubeconfig}", *args],
        input=input_text,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _nodes_ready(settings: Settings) -> tuple[bool, str]:
    """All fake nodes Ready, untainted and showing their GPUs (so pods can land on them now)."""
    listing = _kubectl(settings, "get", "nodes", "-l", f"{E2E_NODE_LABEL}=true", "-o", "json")
    nodes = json.loads(listing)["items"]
    if len(nodes) < settings.nodes:
        return False, f"{len(nodes)}/{settings.nodes} nodes exist"
    for node in nodes:
        name = node["metadata"]["name"]
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        if conditions.get("Ready") != "True":
            return False, f"{name} not Ready"
        if node.get("spec", {}).get("taints"):
            return False, f"{name} still tainted {node['spec']['taints']}"
        if "nvidia.com/gpu" not in node.get("status", {}).get("allocatable", {}):
            return False, f"{name} has no nvidia.com/gpu allocatable"
    return True, "ready"


def ensure_nodes(settings: Settings, deadline: float) -> None:
    _kubectl(settings, "apply", "-f", "-", input_text=json.dumps(node_manifests(settings)))
    last = ""

    def ready() -> bool:
        nonlocal last
        ok, last = _nodes_ready(settings)
        return ok

    _wait("fake GPU nodes to become Ready", ready, deadline, lambda: None)
    # Pods need the default ServiceAccount, which kube-controller-manager creates asynchronously.
    _wait(
        "the default ServiceAccount",
        lambda: subprocess.run(
            [str(binary_path(settings, "kubectl")), f"--kubeconfig={settings.kubeconfig}",
             "get", "serviceaccount", "default", "-n", "default"],
            capture_output=True,
        ).returncode == 0,
        deadline,
        lambda: None,
    )  # fmt: skip
    print(f"nodes: {settings.nodes} x {settings.gpus_per_node} nvidia.com/gpu Ready")


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def up(settings: Settings) -> None:
    missing = missing_binaries(settings)
    if missing:
        if os.environ.get("KVPILOT_E2E_BUILD") == "0":
            raise SystemExit(
                f"binaries not built ({', '.join(b.name for b in missing)}) and KVPILOT_E2E_BUILD=0"
            )
        build(settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(settings.state_dir / ".lock"):
        deadline = time.monotonic() + settings.timeout_s
        ensure_pki(settings)
        ensure_kubeconfigs(settings)
        for component in components(settings):
            _start(settings, component, binary_path(settings, component.name), deadline)
        ensure_nodes(settings, deadline)
    print(f"export KUBECONFIG={settings.kubeconfig}")


def down(settings: Settings, purge: bool) -> int:
    if not settings.state_dir.exists():
        print("nothing to stop")
        return 0
    with _file_lock(settings.state_dir / ".lock"):
        for component in reversed(components(settings)):
            pid = running_pid(settings, component.name)
            if pid is not None:
                _stop_pid(pid)
                print(f"{component.name}: stopped (pid {pid})")
            _pid_file(settings, component.name).unlink(missing_ok=True)
        for pid, name in _stray_pids(settings):  # e.g. started by an `up` that crashed before its pid file
            _stop_pid(pid)
            print(f"{name}: stopped stray process (pid {pid})")
        left = _stray_pids(settings)
        if left:
            print(f"still running: {left}", file=sys.stderr)
            return 1
    if purge:
        shutil.rmtree(settings.state_dir)
        print(f"removed {settings.state_dir}")
    return 0


def status(settings: Settings, quiet: bool) -> int:
    all_up = True
    for component in components(settings):
        pid = running_pid(settings, component.name)
        healthy = pid is not None and _health(component) is not None
        all_up = all_up and healthy
        if not quiet:
            state = f"running (pid {pid})" if pid else "stopped"
            health = "healthy" if healthy else "unhealthy" if pid else ""
            print(f"{component.name:<24} {state:<22} {health:<10} {component.health_url}")
    if all_up and not quiet:
        ok, detail = _nodes_ready(settings)
        print(f"{'nodes':<24} {detail}")
        all_up = ok
    if not quiet:
        print(f"kubeconfig: {settings.kubeconfig}")
    return 0 if all_up else 3


def env(settings: Settings, as_json: bool) -> None:
    if as_json:
        paths = {b.name: resolve_binary(settings, b) for b in BINARIES}
        info = {
            "kubeconfig": str(settings.kubeconfig),
            "server": settings.server_url,
            "state_dir": str(settings.state_dir),
            "binaries": {name: str(path) if path else None for name, path in paths.items()},
        }
        print(json.dumps(info, indent=2))
        return
    dirs = []
    for binary in BINARIES:
        path = resolve_binary(settings, binary)
        if path is not None and str(path.parent) not in dirs:
            dirs.append(str(path.parent))
    if dirs:
        print(f"export PATH={':'.join(dirs)}:$PATH")
    print(f"export KUBECONFIG={settings.kubeconfig}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="e2e/cluster", description="Local Kubernetes control plane with fake GPU nodes for e2e tests."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build the binaries into the cache (once)")
    build_cmd.add_argument("--check", action="store_true", help="only report; exit 1 when any is missing")
    sub.add_parser("up", help="start the control plane and fake GPU nodes (idempotent)")
    down_cmd = sub.add_parser("down", help="stop every process `up` started")
    down_cmd.add_argument("--purge", action="store_true", help="also delete the state folder")
    status_cmd = sub.add_parser("status", help="show components; exit 0 only when all are healthy")
    status_cmd.add_argument("--quiet", "-q", action="store_true")
    env_cmd = sub.add_parser("env", help="print shell exports for KUBECONFIG and the binaries' PATH")
    env_cmd.add_argument("--json", action="store_true", help="print kubeconfig and binary paths as JSON")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `e2e/cluster status | head` should not trace back
    settings = Settings.from_env()
    if args.command == "build":
        if args.check:
            missing = missing_binaries(settings)
            for binary in BINARIES:
                path = resolve_binary(settings, binary)
                print(f"{binary.name:<24} {path or 'MISSING'}")
            return 1 if missing else 0
        build(settings)
    elif args.command == "up":
        up(settings)
    elif args.command == "down":
        return down(settings, args.purge)
    elif args.command == "status":
        return status(settings, args.quiet)
    elif args.command == "env":
        env(settings, args.json)
    return 0
