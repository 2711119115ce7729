"""The e2e cluster's real node: a kubelet that runs containers, beside kwok's fake GPU nodes.

    python -m e2e.kubelet_node {build,up,down,status,load IMAGE_TAR...}

`up` (after `e2e/cluster up`) starts, for the cluster in KVPILOT_E2E_STATE:
- containerd 2.x (built from its Go module, e2e/node/go.mod) with Debian's runc and CNI plugins
  (bridge + host-local + portmap; loopback is containerd's own), on the bridge `kvpilot0`
  (10.244.0.1/24, the pod network; the host reaches pod IPs directly);
- kubelet v1.36.1 (built from e2e/k8s/go.mod, as the control plane) registering node
  `kvpilot-real-0` (label kvpilot.dev/real-node=true), cgroupfs driver, `failCgroupV1: false` (this
  host is cgroup v1), serving on 10.244.0.1 with the cluster CA for client certificates;
- the pod sandbox image built here (e2e/node_images.py; no registry is reachable).

No kube-proxy runs: Services have no ClusterIP routing, so tests reach pods by IP. One rule stands in
for the `kubernetes` Service: pods' connections to 10.96.0.1:443 are DNAT'ed to the API server on
127.0.0.1 (route_localnet on the bridge), so in-cluster clients (the chart's operator) work.

containerd's root (its images) and the kubelet's root live under the binary cache
(~/.cache/kvpilot-e2e/node), so loaded images survive `down` and new clusters; one real node per
machine. Everything per cluster (configs, sockets, pid files, logs) is in the state folder's node/.
Needs root (containers, cgroups, iptables). See e2e/README.md ("The real node").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from e2e import control_plane as cp
from e2e.node_images import PAUSE_IMAGE, pause_archive

NODE_NAME = "kvpilot-real-0"
REAL_NODE_LABEL = "kvpilot.dev/real-node"  # also the key of the node's NoSchedule taint
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
BRIDGE = "kvpilot0"
POD_CIDR = "10.244.0.0/24"
GATEWAY = "10.244.0.1"
NODE_MODULE_DIR = cp.E2E_DIR / "node"
K8S_NAMESPACE = "k8s.io"  # containerd namespace the CRI plugin (and so the kubelet) uses
# Debian packages the node needs from the host: the OCI runtime, CNI plugins, iptables, and gcc with a
# static libc for the pause binary.
HOST_PACKAGES = {
    "runc": Path("/usr/sbin/runc"),
    "containernetworking-plugins": Path("/usr/lib/cni/bridge"),
    "iptables": Path("/usr/sbin/iptables"),
    "gcc": Path("/usr/bin/gcc"),
    "libc6-dev": Path("/usr/lib/x86_64-linux-gnu/libc.a"),
}
CNI_BIN_DIR = Path("/usr/lib/cni")
RUNC = HOST_PACKAGES["runc"]
# What kubelet's container manager writes at start (setupKernelTunables); restored afterwards on a
# machine the node shares with others (see restore_sysctls).
KUBELET_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops")


@dataclass(frozen=True)
class NodeBinary:
    name: str
    package: str
    module: str
    module_dir: Path
    tags: str = ""


NODE_BINARIES = (
    NodeBinary("kubelet", "k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes", cp.GO_MODULE_DIR),
    *(
        NodeBinary(
            name,
            f"github.com/containerd/containerd/v2/cmd/{name}",
            "github.com/containerd/containerd/v2",
            NODE_MODULE_DIR,
            "no_btrfs no_devmapper",  # those snapshotters need cgo; overlayfs is what the node uses
        )
        for name in ("containerd", "containerd-shim-runc-v2", "ctr")
    ),
)


def _module_version(module_dir: Path, module: str) -> str:
    for line in (module_dir / "go.mod").read_text().splitlines():
        parts = line.replace("require", "").split()
        if len(parts) >= 2 and parts[0] == module and parts[1].startswith("v"):
            return parts[1]
    raise SystemExit(f"{module_dir}/go.mod does not require {module}")


def _stamp(binary: NodeBinary) -> str:
    return f"{binary.module} {_module_version(binary.module_dir, binary.module)} {binary.tags}\n"


def binary_file(settings: cp.Settings, name: str) -> Path:
    return cp.cache_bin_dir(settings) / name


def missing_node_binaries(settings: cp.Settings) -> list[NodeBinary]:
    out = []
    for binary in NODE_BINARIES:
        path = binary_file(settings, binary.name)
        stamp = path.with_name(f".{binary.name}.version")
        if not (path.is_file() and stamp.is_file() and stamp.read_text() == _stamp(binary)):
            out.append(binary)
    return out


def build(settings: cp.Settings) -> dict[str, float]:
    """Build the missing node binaries into the control plane's cache; returns seconds per binary."""
    if shutil.which("go") is None:
        raise SystemExit("the `go` command is needed to build the node binaries")
    out_dir = cp.cache_bin_dir(settings)
    seconds: dict[str, float] = {}
    with cp._file_lock(out_dir.parent / ".build.lock"):
        for binary in missing_node_binaries(settings):
            version = _module_version(binary.module_dir, binary.module)
            ldflags = "-s -w"
            if binary.module == "k8s.io/kubernetes":
                ldflags += " " + cp._kube_version_ldflags(version)
            else:
                ldflags += f" -X {binary.module}/version.Version={version}"
            print(f"building {binary.name} ({binary.module} {version}) ...", flush=True)
            t0 = time.monotonic()
            target = out_dir / binary.name
            tmp = target.with_name(f".{binary.name}.tmp")
            out_dir.mkdir(parents=True, exist_ok=True)
            argv = ["go", "build", "-trimpath", f"-ldflags={ldflags}", "-o", str(tmp)]
            if binary.tags:
                argv += ["-tags", binary.tags]
            env = {**os.environ, "GOWORK": "off", "CGO_ENABLED": "0"}
            subprocess.run([*argv, binary.package], cwd=binary.module_dir, env=env, check=True)
            tmp.replace(target)
            target.with_name(f".{binary.name}.version").write_text(_stamp(binary))
            seconds[binary.name] = round(time.monotonic() - t0, 1)
            print(f"  {binary.name}: {seconds[binary.name]:.0f}s", flush=True)
    return seconds


def missing_host_tools() -> list[str]:
    """Debian packages (by name) whose files the node needs and that are not installed."""
    return [name for name, path in HOST_PACKAGES.items() if not path.exists()]


def install_host_tools() -> None:
    """apt-get install what missing_host_tools() names (root)."""
    missing = missing_host_tools()
    if not missing:
        return
    print(f"installing Debian packages for the real node: {' '.join(missing)}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
        timeout=1200,
    )


# --------------------------------------------------------------------------------------------
# Layout and configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    settings: cp.Settings
    kubelet_port: int
    kubelet_healthz_port: int
    containerd_metrics_port: int

    @classmethod
    def from_env(cls, settings: cp.Settings | None = None) -> Node:
        return cls(
            settings or cp.Settings.from_env(),
            cp._env_int("KVPILOT_E2E_KUBELET_PORT", 16250),
            cp._env_int("KVPILOT_E2E_KUBELET_HEALTHZ_PORT", 16248),
            cp._env_int("KVPILOT_E2E_CONTAINERD_METRICS_PORT", 16338),
        )

    @property
    def home(self) -> Path:  # kept across clusters: images, kubelet root
        return self.settings.cache_root / "node"

    @property
    def state(self) -> Path:  # per cluster
        return self.settings.state_dir / "node"

    @property
    def socket(self) -> Path:
        return self.state / "containerd.sock"

    def bin(self, name: str) -> Path:
        return binary_file(self.settings, name)

    def ctr(self, *args: str, timeout: float = 600, input_path: Path | None = None) -> str:
        argv = [str(self.bin("ctr")), "--address", str(self.socket), "--namespace", K8S_NAMESPACE, *args]
        stdin = input_path.open("rb") if input_path is not None else subprocess.DEVNULL
        try:
            result = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, timeout=timeout)
        finally:
            if input_path is not None:
                stdin.close()  # type: ignore[union-attr]
        if result.returncode != 0:
            raise SystemExit(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout


def containerd_config(node: Node) -> str:
    return f"""version = 3
root = "{node.home / "containerd"}"
state = "{node.state / "containerd"}"

[grpc]
  address = "{node.socket}"

[metrics]
  address = "127.0.0.1:{node.containerd_metrics_port}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # Root here lacks CAP_SYS_RESOURCE, so runc cannot lower oom_score_adj below containerd's own (the
  # sandbox's -998 fails with "nsexec: failed to update /proc/self/oom_score_adj: Permission denied").
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{node.state / "cni"}"
    max_conf_num = 1
"""


def cni_config(node: Node) -> dict[str, object]:
    return {
        "cniVersion": "1.0.0",
        "name": "kvpilot-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,  # nothing outside this machine is reachable, nor should be
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.state / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(node: Node) -> dict[str, object]:
    pki = node.settings.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # v1.35+ refuses cgroup v1 hosts without it; this host is cgroup v1
        "cgroupDriver": "cgroupfs",  # no systemd here
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "address": GATEWAY,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": cp.HOST,
        "healthzPort": node.kubelet_healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "failSwapOn": False,
        # The disk is shared and fuller than kubelet's defaults allow: no disk-pressure evictions and no
        # image garbage collection (it would delete the images the tests loaded).
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "podPidsLimit": 4096,
        "nodeStatusReportFrequency": "10s",
    }


def ensure_node_pki(settings: cp.Settings) -> None:
    pki = settings.pki
    cp._make_cert(pki, "kubelet", "ca", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth")
    cp._make_cert(
        pki, "kubelet-serving", "ca", f"/CN=system:node:{NODE_NAME}", "serverAuth", [f"IP:{GATEWAY}"]
    )


# --------------------------------------------------------------------------------------------
# Host networking
# --------------------------------------------------------------------------------------------


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def _sysctl(key: str, value: str | None = None) -> str:
    path = Path("/proc/sys") / key.replace(".", "/")
    if value is not None:
        path.write_text(value)
    return path.read_text().strip()


def ensure_network(node: Node) -> None:
    """The bridge with the gateway address (the kubelet serves there, so it must exist before the
    first pod), bridged traffic through iptables, and the `kubernetes` Service stand-in."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    if GATEWAY not in _run("ip", "-4", "addr", "show", BRIDGE).stdout:
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    if not Path("/proc/sys/net/bridge").exists():
        _run("modprobe", "br_netfilter", check=False)
    _sysctl("net.ipv4.ip_forward", "1")
    with contextlib.suppress(OSError):
        _sysctl("net.bridge.bridge-nf-call-iptables", "1")
    _sysctl(f"net.ipv4.conf.{BRIDGE}.route_localnet", "1")
    rule = [
        "PREROUTING", "-i", BRIDGE, "-d", cp.KUBERNETES_SERVICE_IP, "-p", "tcp", "--dport", "443",
        "-j", "DNAT", "--to-destination", f"{cp.HOST}:{node.settings.apiserver_port}",
        "-m", "comment", "--comment", "kvpilot-e2e kubernetes Service",
    ]  # fmt: skip
    if _run("iptables", "-t", "nat", "-C", *rule, check=False).returncode != 0:
        _run("iptables", "-t", "nat", "-A", *rule)
    # Pod to pod across the bridge passes the filter table's FORWARD chain (bridge-nf-call-iptables),
    # whose policy is DROP wherever dockerd runs: without this a router pod's connections to a model pod
    # time out while the host reaches both.
    forward = [
        "FORWARD",
        "-i",
        BRIDGE,
        "-o",
        BRIDGE,
        "-m",
        "comment",
        "--comment",
        "kvpilot-e2e pod to pod",
        "-j",
        "ACCEPT",
    ]
    if _run("iptables", "-C", *forward, check=False).returncode != 0:
        _run("iptables", "-I", *forward)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def components(node: Node) -> list[cp.Component]:
    return [
        cp.Component(
            "containerd",
            ["--config", str(node.state / "containerd.toml")],
            # the shim is found on PATH; runc and the CNI plugins by absolute path in the config
            {"PATH": f"{cp.cache_bin_dir(node.settings)}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
            f"http://{cp.HOST}:{node.containerd_metrics_port}/v1/metrics",
        ),
        cp.Component(
            "kubelet",
            [
                f"--config={node.state / 'kubelet.json'}",
                f"--kubeconfig={node.state / 'kubelet.kubeconfig'}",
                f"--root-dir={node.home / 'kubelet'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={GATEWAY}",
                f"--node-labels={REAL_NODE_LABEL}=true",
                # Only pods that ask for it land here: a kwok-suite pod without a nodeSelector would
                # otherwise really start (and fail to find its image) when the node is up.
                f"--register-with-taints={REAL_NODE_LABEL}=true:NoSchedule",
                "--v=1",
            ],
            {},
            f"http://{cp.HOST}:{node.kubelet_healthz_port}/healthz",
        ),
    ]


def write_configs(node: Node) -> None:
    for path in (node.state / "cni", node.state / "ipam", node.home / "containerd", node.home / "kubelet"):
        path.mkdir(parents=True, exist_ok=True)
    (node.state / "containerd.toml").write_text(containerd_config(node))
    (node.state / "cni" / "10-kvpilot.conflist").write_text(json.dumps(cni_config(node), indent=2))
    (node.state / "kubelet.json").write_text(json.dumps(kubelet_config(node), indent=2))
    kubeconfig = node.state / "kubelet.kubeconfig"
    kubeconfig.write_text(cp._kubeconfig(node.settings, "kubelet"))
    kubeconfig.chmod(0o600)


def image_names(node: Node) -> set[str]:
    return {line.split()[0] for line in node.ctr("images", "ls", "-q").splitlines() if line.strip()}


def load(node: Node, archive: Path) -> str:
    """Import an image tar (OCI layout or `docker save`) into the node; prints what ctr printed."""
    return node.ctr("images", "import", "-", input_path=archive, timeout=1800)


def load_docker_image(node: Node, tag: str) -> bool:
    """Import Docker's image `tag` (`docker save | ctr images import -`) unless the node already has this
    very build of it (the Docker image ID is kept beside containerd's root); True when it imported."""
    image_id = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True, timeout=60
    )
    if image_id.returncode != 0:
        raise SystemExit(f"docker has no image {tag}: {image_id.stderr.strip()}")
    stamp = node.home / "images" / (tag.replace("/", "_").replace(":", "_") + ".docker-id")
    if tag in image_names(node) and stamp.is_file() and stamp.read_text() == image_id.stdout:
        return False
    stamp.parent.mkdir(parents=True, exist_ok=True)
    # Another build: drop it first, the disk is shared. The CRI also names an image by its config ID
    # (sha256:...); every name of the old manifest goes, so its blobs are collected (--sync).
    refs = [line.split() for line in node.ctr("images", "ls").splitlines()[1:] if line.strip()]
    old = {digest for name, _type, digest, *_ in refs if name == tag}
    stale = [name for name, _type, digest, *_ in refs if digest in old]
    if stale:
        node.ctr("images", "rm", "--sync", *stale)
    ctr = [str(node.bin("ctr")), "--address", str(node.socket), "--namespace", K8S_NAMESPACE]
    with subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE) as save:
        imported = subprocess.run(
            [*ctr, "images", "import", "-"], stdin=save.stdout, capture_output=True, text=True, timeout=3600
        )
        assert save.stdout is not None
        save.stdout.close()
    if save.returncode != 0 or imported.returncode != 0:
        raise SystemExit(f"docker save {tag} | ctr images import - failed: {imported.stderr.strip()[-2000:]}")
    stamp.write_text(image_id.stdout)
    return True


def ensure_pause_image(node: Node) -> None:
    if PAUSE_IMAGE not in image_names(node):
        load(node, pause_archive(node.home / "images"))


def _node_ready(settings: cp.Settings) -> tuple[bool, str]:
    try:
        raw = cp._kubectl(settings, "get", "node", NODE_NAME, "-o", "json")
    except SystemExit as exc:
        return False, str(exc)
    conditions = {c["type"]: c for c in json.loads(raw).get("status", {}).get("conditions", [])}
    ready = conditions.get("Ready", {})
    return ready.get("status") == "True", ready.get("message", "no Ready condition yet")


def up(node: Node) -> None:
    if os.geteuid() != 0:
        raise SystemExit("the real node needs root (containers, cgroups, iptables)")
    missing = missing_host_tools()
    if missing:
        raise SystemExit(f"missing Debian packages for the real node: apt-get install -y {' '.join(missing)}")
    if missing_node_binaries(node.settings):
        if os.environ.get("KVPILOT_E2E_BUILD") == "0":
            raise SystemExit("node binaries not built and KVPILOT_E2E_BUILD=0")
        build(node.settings)
    deadline = time.monotonic() + node.settings.timeout_s
    with cp._file_lock(node.home / ".lock"):
        ensure_node_pki(node.settings)
        write_configs(node)
        ensure_network(node)
        saved = {key: _sysctl(key) for key in KUBELET_SYSCTLS}
        containerd, kubelet = components(node)
        cp._start(node.settings, containerd, node.bin("containerd"), deadline)
        ensure_pause_image(node)
        cp._start(node.settings, kubelet, node.bin("kubelet"), deadline)
        last = ""

        def ready() -> bool:
            nonlocal last
            ok, last = _node_ready(node.settings)
            return ok

        try:
            cp._wait(f"node {NODE_NAME} Ready", ready, deadline, lambda: None)
        except SystemExit as exc:
            raise SystemExit(
                f"{exc} (last: {last}); kubelet log: {node.settings.logs / 'kubelet.log'}"
            ) from None
        restore_sysctls(saved)
    print(f"node {NODE_NAME}: Ready (label {REAL_NODE_LABEL}=true), pods on {POD_CIDR}")


def restore_sysctls(saved: dict[str, str]) -> None:
    """kubelet sets vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1 on the host when it
    starts; it never reads them again, so a test machine shared with others gets its values back."""
    for key, value in saved.items():
        with contextlib.suppress(OSError):
            if _sysctl(key) != value:
                _sysctl(key, value)


def _node_pods(node: Node) -> list[tuple[str, str]]:
    raw = cp._kubectl(
        node.settings, "get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE_NAME}", "-o", "json"
    )
    return [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in json.loads(raw)["items"]]


def down(node: Node) -> int:
    """Pods on the node are deleted while the kubelet still runs (so the CRI tears their sandboxes and
    networks down), then the kubelet and containerd stop; images stay in containerd's root."""
    kubelet_pid = cp.running_pid(node.settings, "kubelet")
    if kubelet_pid is not None and cp.running_pid(node.settings, "kube-apiserver") is not None:
        with contextlib.suppress(SystemExit):
            for namespace, name in _node_pods(node):
                cp._kubectl(
                    node.settings, "delete", "pod", "-n", namespace, name, "--wait=false", "--grace-period=5"
                )
            until = time.monotonic() + 60
            while _node_pods(node) and time.monotonic() < until:
                time.sleep(1)
    for component in reversed(components(node)):
        pid = cp.running_pid(node.settings, component.name)
        if pid is not None:
            cp._stop_pid(pid, grace_s=20)
            print(f"{component.name}: stopped (pid {pid})")
        cp._pid_file(node.settings, component.name).unlink(missing_ok=True)
    return 0


def status(node: Node) -> int:
    healthy = True
    for component in components(node):
        pid = cp.running_pid(node.settings, component.name)
        ok = pid is not None and cp._health(component) is not None
        healthy = healthy and ok
        print(f"{component.name:<12} {'healthy' if ok else 'down':<8} pid {pid}")
    if healthy:
        ok, detail = _node_ready(node.settings)
        print(f"{NODE_NAME:<12} {'Ready' if ok else 'NotReady':<8} {detail}")
        healthy = ok
    return 0 if healthy else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.kubelet_node", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build kubelet and containerd into the binary cache")
    deps_cmd = sub.add_parser("deps", help="print the Debian packages the node needs that are missing")
    deps_cmd.add_argument("--install", action="store_true", help="apt-get install them (root)")
    sub.add_parser("up", help="start containerd and the kubelet; wait for the node to be Ready")
    sub.add_parser("down", help="delete the node's pods, stop the kubelet and containerd")
    sub.add_parser("status", help="exit 0 when containerd, the kubelet and the node are healthy")
    load_cmd = sub.add_parser("load", help="import image tars (docker save or OCI layout) into the node")
    load_cmd.add_argument("archives", nargs="+", type=Path)
    docker_cmd = sub.add_parser("load-docker", help="import Docker images by tag (skipped when current)")
    docker_cmd.add_argument("tags", nargs="+")
    args = parser.parse_args(argv)
    node = Node.from_env()
    if args.command == "build":
        print(json.dumps(build(node.settings)))
    elif args.command == "deps":
        if args.install:
            install_host_tools()
        print(" ".join(missing_host_tools()))
    elif args.command == "up":
        up(node)
    elif args.command == "down":
        return down(node)
    elif args.command == "status":
        return status(node)
    elif args.command == "load":
        for archive in args.archives:
            sys.stdout.write(load(node, archive))
    elif args.command == "load-docker":
        for tag in args.tags:
            print(f"{tag}: {'imported' if load_docker_image(node, tag) else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
