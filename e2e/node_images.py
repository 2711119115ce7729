"""Container images for the real e2e node, made without a registry (standard library only).

- `pause_archive`: the pod sandbox image. registry.k8s.io is not reachable here, so e2e/node/pause.c
  is compiled statically with the host's gcc and packed as a one-file image.
- `rootfs_archive`: an image whose single layer is a root filesystem tarball, e.g. the Debian base
  that scripts/build_images.sh debootstraps (a shell, coreutils and python3: what a busybox image is
  used for in tests).

Both write an OCI image layout as a tar, which `ctr -n k8s.io images import` reads; the image name is
carried in the index's `io.containerd.image.name` annotation. The kvpilot images themselves come from
Docker (`docker save`), which `ctr images import` reads as well (e2e/kubelet_node.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

PAUSE_SOURCE = Path(__file__).resolve().parent / "node" / "pause.c"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"  # the name containerd 2.x and kubelet 1.36 expect
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _sha256_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def write_oci_archive(
    out: Path,
    name: str,
    layer: Path,
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = None,
    env: Sequence[str] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
    user: str = "",
) -> Path:
    """An OCI image layout tar at `out`: one uncompressed `layer`, an amd64/linux config, and the index
    naming the image `name` (e.g. "registry.k8s.io/pause:3.10.1")."""
    layer_digest, layer_size = _sha256_file(layer)
    config: dict[str, object] = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": list(env), "User": user},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    if entrypoint is not None:
        config["config"]["Entrypoint"] = list(entrypoint)  # type: ignore[index]
    if cmd is not None:
        config["config"]["Cmd"] = list(cmd)  # type: ignore[index]
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": layer_size}],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add_bytes(tar, "index.json", json.dumps(index).encode())
        _add_bytes(tar, f"blobs/sha256/{config_digest.split(':')[1]}", config_bytes)
        _add_bytes(tar, f"blobs/sha256/{manifest_digest.split(':')[1]}", manifest_bytes)
        tar.add(str(layer), arcname=f"blobs/sha256/{layer_digest.split(':')[1]}")
    tmp.replace(out)
    return out


def pause_archive(cache_dir: Path) -> Path:
    """The sandbox image as an OCI tar under cache_dir (rebuilt when pause.c changes)."""
    source = PAUSE_SOURCE.read_bytes()
    key = hashlib.sha256(source).hexdigest()[:12]
    out = cache_dir / f"pause-{key}.oci.tar"
    if out.exists():
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("gcc is needed to build the pause image (apt-get install gcc libc6-dev)")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run([gcc, "-static", "-Os", "-s", "-o", str(binary), str(PAUSE_SOURCE)], check=True)
        layer = Path(tmp) / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            info = tar.gettarinfo(str(binary), arcname="pause")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755
            with binary.open("rb") as handle:
                tar.addfile(info, handle)
        write_oci_archive(out, PAUSE_IMAGE, layer, entrypoint=["/pause"], user="65535:65535")
    return out


def rootfs_archive(cache_dir: Path, rootfs_tar: Path, name: str) -> Path:
    """An image of `rootfs_tar` (a root filesystem tarball) as an OCI tar under cache_dir."""
    key = hashlib.sha256(
        f"{rootfs_tar.resolve()} {rootfs_tar.stat().st_mtime_ns} {name}".encode()
    ).hexdigest()
    out = cache_dir / f"rootfs-{key[:12]}.oci.tar"
    if not out.exists():
        write_oci_archive(out, name, rootfs_tar, cmd=["/bin/sh"])
    return out
