#!/usr/bin/env bash
# Makes a Docker daemon answer for scripts/build_images.sh and tests/images (docs/images.md):
#   - dockerd missing: installs Debian's docker.io (dockerd 20.10, containerd 1.6, runc), plus debootstrap
#     (the base image) and iptables, with apt-get (root, or sudo);
#   - no daemon answering: starts it (systemctl where systemd runs, else dockerd in the background,
#     logging to ~/.cache/kvpilot/dockerd.log) and waits for `docker info`.
# Idempotent and quick when the daemon answers (no network then). Storage driver: dockerd's own choice
# (overlay2 where the kernel has it); KVPILOT_DOCKERD_ARGS adds flags, e.g. "--storage-driver=vfs".
set -euo pipefail

LOG_DIR="${KVPILOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot}"
log() { echo "docker.sh: $*" >&2; }

if docker info >/dev/null 2>&1; then
  log "daemon answers: $(docker version -f '{{.Server.Version}}' 2>/dev/null)"
  exit 0
fi

sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    log "no Docker daemon answers and not root: start dockerd (or install docker.io) as root"
    exit 1
  }
  sudo="sudo"
fi

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  log "installing docker.io, debootstrap and iptables (Debian packages) ..."
  # policy-rc.d 101: the package's maintainer scripts must not start services (started below instead)
  policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod 0755 "$policy" && created=1
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    docker.io debootstrap iptables >/dev/null
  if [ "$created" = 1 ]; then $sudo rm -f "$policy"; fi
fi

if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
  log "starting docker.service ..."
  $sudo systemctl start docker
else
  mkdir -p "$LOG_DIR"
  log "starting dockerd in the background (log: $LOG_DIR/dockerd.log) ..."
  # shellcheck disable=SC2086  # KVPILOT_DOCKERD_ARGS is a list of flags
  $sudo nohup dockerd ${KVPILOT_DOCKERD_ARGS:-} >>"$LOG_DIR/dockerd.log" 2>&1 &
fi

for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    log "daemon answers: $(docker version -f '{{.Server.Version}}' 2>/dev/null), storage $(docker info -f '{{.Driver}}'), cgroup v$(docker info -f '{{.CgroupVersion}}')"
    exit 0
  fi
  sleep 1
done
log "dockerd did not answer within 60 s; its log: $LOG_DIR/dockerd.log"
exit 1
