#!/usr/bin/env bash
# Builds kvpilot's images from deploy/docker/*.Dockerfile with no container registry (docs/images.md):
#   runtime-cpu  ->  ghcr.io/kvpilot/kvpilot-runtime:<appVersion>-cpu
#   operator     ->  ghcr.io/kvpilot/kvpilot-operator:<appVersion>   (also runs the router and autoscaler)
#
#   bash scripts/build_images.sh [runtime-cpu] [operator]     (default: both)
#   options: --refresh-base (debootstrap the base again)  --save DIR (docker save each image to DIR/NAME.tar)
#
# The base image (the Dockerfiles' PYTHON_IMAGE) is made here: Debian bookworm debootstrapped from the
# Debian archive (python3, venv, ca-certificates) and `docker import`ed; its rootfs tarball is cached
# under ~/.cache/kvpilot/images, never in the repository. Python wheels come from PyPI
# (PIP_INDEX_URL=https://pypi.org/simple: the CPU-only torch index the Dockerfiles default to is not
# one of the registries CI reaches). CA certificates the host trusts on top of Debian's
# (/usr/local/share/ca-certificates, e.g. a TLS-inspecting egress proxy's) are added to the base, so
# pip inside the build trusts what the host's pip trusts; KVPILOT_EXTRA_CA_DIR= (empty) turns it off.
#
# The build uses Docker's classic builder (DOCKER_BUILDKIT=0): BuildKit would fetch the Dockerfiles'
# `# syntax=` frontend image from a registry. The classic builder does not read per-Dockerfile
# .dockerignore files, so the context is a tar of exactly what deploy/docker/NAME.Dockerfile.dockerignore
# lets through. Idempotent: the base is reused while its inputs are unchanged, and Docker's layer cache
# makes a rebuild of unchanged sources take seconds.
#
# Prints one JSON object on stdout: the machine, the base and, per image, its tag, size and build time.
# Needs a reachable Docker daemon (scripts/docker.sh installs and starts Debian's docker.io) and, for a
# new base, root and debootstrap.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${KVPILOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot}/images"
SUITE="bookworm"
MIRROR="${KVPILOT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${KVPILOT_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
BASE_PACKAGES="python3,python3-venv,python-is-python3,ca-certificates"
EXTRA_CA_DIR="${KVPILOT_EXTRA_CA_DIR-/usr/local/share/ca-certificates}"
PIP_INDEX="${KVPILOT_PIP_INDEX_URL:-https://pypi.org/simple}"
REGISTRY="ghcr.io/kvpilot"
LABEL="dev.kvpilot.built-by-build-images" # on what this script builds, so it prunes only its own leftovers
BASE_RECIPE_VERSION=1 # bump when make_base changes what it puts in the rootfs

log() { echo "build_images: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

images=()
refresh_base=0
save_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    runtime-cpu | operator) images+=("$1") ;;
    --refresh-base) refresh_base=1 ;;
    --save)
      [ $# -ge 2 ] || die "--save needs a directory"
      save_dir="$2"
      shift
      ;;
    -h | --help)
      sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) die "unknown argument '$1' (images: runtime-cpu, operator; options: --refresh-base, --save DIR)" ;;
  esac
  shift
done
[ ${#images[@]} -gt 0 ] || images=(runtime-cpu operator)

command -v docker >/dev/null 2>&1 || die "docker not found on PATH (bash scripts/docker.sh installs Debian's docker.io)"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (bash scripts/docker.sh starts dockerd)"
export DOCKER_BUILDKIT=0

VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$ROOT/charts/kvpilot/Chart.yaml")"
[ -n "$VERSION" ] || die "no appVersion in charts/kvpilot/Chart.yaml"
mkdir -p "$CACHE"

# --- the base image -------------------------------------------------------------------------------
extra_cas() {
  if [ -n "$EXTRA_CA_DIR" ] && [ -d "$EXTRA_CA_DIR" ]; then
    find "$EXTRA_CA_DIR" -maxdepth 1 -type f -name '*.crt' | sort
  fi
}

base_key() {
  {
    echo "$BASE_RECIPE_VERSION $SUITE $MIRROR $SECURITY_MIRROR $BASE_PACKAGES"
    extra_cas | while read -r ca; do sha256sum "$ca" | cut -d' ' -f1; done
  } | sha256sum | cut -c1-12
}

make_base_rootfs() { # $1: the tarball to write
  local out="$1" dir
  [ "$(id -u)" = 0 ] || die "debootstrap needs root (or put a base tarball at $out)"
  command -v debootstrap >/dev/null 2>&1 || die "debootstrap not found (apt-get install -y debootstrap)"
  dir="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" EXIT
  log "debootstrap $SUITE (minbase + $BASE_PACKAGES) from $MIRROR ..."
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
    die "debootstrap failed (log: $CACHE/debootstrap.log)"
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  log "applying $SUITE-updates and $SUITE-security ..."
  chroot "$dir" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade' \
    >>"$CACHE/debootstrap.log" 2>&1 || die "apt-get upgrade in the rootfs failed (log: $CACHE/debootstrap.log)"
  local ca
  for ca in $(extra_cas); do
    log "trusting the host's extra CA $ca in the base"
    cp "$ca" "$dir/usr/local/share/ca-certificates/"
  done
  chroot "$dir" update-ca-certificates >>"$CACHE/debootstrap.log" 2>&1
  # what a slim base does not carry: package lists and archives, docs, man pages
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
    "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/var/log/*.log "$dir"/tmp/* "$dir"/root/.cache
  find "$dir/usr/share/doc" -type f ! -name copyright -delete
  : >"$dir/etc/machine-id"
  tar --numeric-owner --xattrs -C "$dir" -cf "$out.tmp" .
  mv "$out.tmp" "$out"
  rm -rf "$dir"
  trap - EXIT
}

ensure_base() {
  local key tag tarball start
  key="$(base_key)"
  tag="kvpilot-base:$SUITE-python3-$key"
  tarball="$CACHE/base-$SUITE-$key.tar"
  if [ "$refresh_base" = 1 ]; then
    rm -f "$tarball"
    docker image rm -f "$tag" >/dev/null 2>&1 || true
  fi
  start="$(now)"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    [ -f "$tarball" ] || make_base_rootfs "$tarball"
    log "importing $tarball as $tag"
    docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'CMD ["python3"]' \
      "$tarball" "$tag" >/dev/null
  fi
  BASE_IMAGE="$tag"
  BASE_SECONDS="$(elapsed "$start")"
}

# --- the images -----------------------------------------------------------------------------------
context_tar() { # the build context deploy/docker/$1.Dockerfile.dockerignore lets through, as a tar on stdout
  local name="$1" ignore="$ROOT/deploy/docker/$1.Dockerfile.dockerignore" line
  local includes=("deploy/docker/$name.Dockerfile") excludes=()
  [ -f "$ignore" ] || die "$ignore not found"
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in
      '' | '#'* | '*') ;;
      '!'*) includes+=("${line#!}") ;;
      '**/'*) excludes+=("--exclude=${line#\*\*/}") ;;
      *) die "$ignore: line '$line' is not one this script understands ('*', '!PATH', '**/PATTERN')" ;;
    esac
  done <"$ignore"
  tar -C "$ROOT" -c "${excludes[@]}" "${includes[@]}"
}

build_image() { # $1: runtime-cpu | operator
  local name="$1" tag start size
  case "$name" in
    runtime-cpu) tag="$REGISTRY/kvpilot-runtime:$VERSION-cpu" ;;
    operator) tag="$REGISTRY/kvpilot-operator:$VERSION" ;;
  esac
  log "building $tag from deploy/docker/$name.Dockerfile on $BASE_IMAGE ..."
  start="$(now)"
  : >"$CACHE/build-$name.log"
  # The build stage is tagged too (kvpilot-build:NAME), so it stays in Docker's cache as long as it is
  # current; what a rebuild replaces (untagged, labelled by this script) is pruned afterwards.
  local target args
  for target in build final; do
    args=(-f "deploy/docker/$name.Dockerfile" --build-arg "PYTHON_IMAGE=$BASE_IMAGE"
      --build-arg "PIP_INDEX_URL=$PIP_INDEX" --build-arg "VERSION=$VERSION" --label "$LABEL=$name")
    if [ "$target" = build ]; then args+=(--target build -t "kvpilot-build:$name"); else args+=(-t "$tag"); fi
    context_tar "$name" | docker build --force-rm "${args[@]}" - >>"$CACHE/build-$name.log" 2>&1 || {
      tail -n 40 "$CACHE/build-$name.log" >&2
      die "docker build of $name failed (log: $CACHE/build-$name.log)"
    }
  done
  docker image prune -f --filter "label=$LABEL=$name" >/dev/null
  size="$(docker image inspect -f '{{.Size}}' "$tag")"
  log "$tag: $(awk -v s="$size" 'BEGIN { printf "%.2f GB", s / 1e9 }') in $(elapsed "$start") s"
  if [ -n "$save_dir" ]; then
    mkdir -p "$save_dir"
    docker save -o "$save_dir/$name.tar" "$tag"
  fi
  RESULTS+=("{\"name\": \"$name\", \"tag\": \"$tag\", \"size_bytes\": $size, \"build_s\": $(elapsed "$start")}")
}

RESULTS=()
ensure_base
for image in "${images[@]}"; do
  build_image "$image"
done

machine="$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
base_size="$(docker image inspect -f '{{.Size}}' "$BASE_IMAGE")"
printf '{"machine": "%s, %s cores", "docker": "%s", "base": {"tag": "%s", "size_bytes": %s, "ready_s": %s}, "images": [%s]}\n' \
  "$machine" "$(nproc)" "$(docker version -f '{{.Server.Version}}' 2>/dev/null)" "$BASE_IMAGE" "$base_size" \
  "$BASE_SECONDS" "$(
    IFS=,
    echo "${RESULTS[*]}"
  )"
