#!/usr/bin/env bash
# Build the dtnode image on a host whose containers reach no package registry and that may pull no image.
#
#   bash docker/build.sh                       # image dtnode:cpu (torch==2.13.0, CPU build)
#   bash docker/build.sh --cuda                # image dtnode:cuda (torch's CUDA build; see below)
#   bash docker/build.sh --base-image IMAGE    # on IMAGE (any image with python3.11 and its venv module)
#   bash docker/build.sh --tag NAME:TAG        # another image name
#   bash docker/build.sh --prometheus          # also dtnode-prometheus:bookworm (compose's Prometheus)
#
# Nothing inside `docker build` touches a network; everything comes from the host:
#
# 1. Wheelhouse. The host's pip (Python 3.11, like the image's) builds or downloads a wheel of
#    dtnode and of every dependency into $BUILD_DTNODE_CACHE/<variant>/wheelhouse (default
#    ~/.cache/dtnode-docker). Wheels already there are reused; dtnode's own wheel is rebuilt every
#    time. Extra pip options for torch go in $DTNODE_TORCH_PIP_ARGS, as for scripts/setup.sh, e.g.
#    "--index-url https://download.pytorch.org/whl/cpu" where PyPI's default torch is the CUDA one.
# 2. Base image. The --base-image if given (pulled if absent); else dtnode-base:bookworm if it
#    exists; else python:3.11-slim-bookworm if it can be pulled; else one made here:
#    `debootstrap --variant=minbase bookworm` with python3 and python3-venv from a Debian mirror
#    ($DEBIAN_MIRROR), packed with `docker import` as dtnode-base:bookworm (a few minutes, kept).
# 3. Image. docker/Dockerfile installs the wheelhouse with `pip install --no-index --find-links`
#    into a venv in one stage (kept as NAME:TAG-deps, 1.8 GB, the cache of the next build) and
#    copies only the venv into the final one, then installs dtnode's own wheel on top (a layer of
#    its own: after a change to dtnode only that layer is rebuilt).
# 4. With --prometheus: dtnode-prometheus:bookworm, Debian's prometheus package in a debootstrap
#    image (made once, kept; a few minutes), for the compose swarm.
#
# --cuda: the wheelhouse gets torch==2.13.0 as PyPI serves it for Linux (the CUDA build, with the
# nvidia-* runtime wheels; pass DTNODE_TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cuXYZ"
# for another CUDA release). The CUDA runtime then ships inside the wheels and only the driver
# comes from the host at run time (NVIDIA Container Toolkit: `docker run --gpus all`), so the same
# Debian base serves; `--base-image` takes an nvidia/cuda image instead if it has Python 3.11.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

variant=cpu
tag=""
base_image=""
prometheus=0
prometheus_image="dtnode-prometheus:bookworm"
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) variant=cuda ;;
    --tag) tag="${2:?--tag needs NAME:TAG}"; shift ;;
    --base-image) base_image="${2:?--base-image needs an image}"; shift ;;
    --prometheus) prometheus=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
tag="${tag:-dtnode:$variant}"
python="${PYTHON:-python3}"
torch_spec="torch==2.13.0"
cache="${BUILD_DTNODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtnode-docker}"
context="$cache/$variant"
wheelhouse="$context/wheelhouse"
local_base="dtnode-base:bookworm"
pullable_base="python:3.11-slim-bookworm"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

say() { echo "build.sh: $*" >&2; }
die() { say "$*"; exit 1; }

command -v docker >/dev/null || die "no docker client on PATH"
docker info >/dev/null 2>&1 || die "no Docker engine answers (is dockerd running?)"
host_python="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
[ "$host_python" = 3.11 ] || die "$python is Python $host_python; the wheelhouse must be built by Python 3.11 (set PYTHON)"

# --- 1. wheelhouse ---------------------------------------------------------------------------
started=$SECONDS
mkdir -p "$wheelhouse"
rm -f "$wheelhouse"/dtnode-*.whl
pip=("$python" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$wheelhouse" --find-links "$wheelhouse")
say "wheelhouse $wheelhouse: $torch_spec"
# shellcheck disable=SC2086  # DTNODE_TORCH_PIP_ARGS is a list of pip options
nice -n 19 "${pip[@]}" ${DTNODE_TORCH_PIP_ARGS:-} "$torch_spec"
torch_wheel="$(cd "$wheelhouse" && ls -t torch-2.13.0*.whl | head -n 1)"
torch_version="$(echo "$torch_wheel" | cut -d- -f2)"  # e.g. 2.13.0+cpu
case "$variant:$torch_version" in
  cpu:*+cpu | cuda:*+cu* | cuda:2.13.0) ;;
  cpu:*) say "warning: $torch_wheel is not torch's CPU build; set DTNODE_TORCH_PIP_ARGS=\"--index-url https://download.pytorch.org/whl/cpu\" for a small image" ;;
  cuda:*) die "$torch_wheel is not a CUDA build; set DTNODE_TORCH_PIP_ARGS=\"--index-url https://download.pytorch.org/whl/cuXYZ\"" ;;
esac
say "wheelhouse: dtnode and its dependencies (torch pinned to $torch_version)"
constraints="$context/constraints.txt"
echo "torch==$torch_version" >"$constraints"
# dtnode's own wheel goes to dtnode-wheel/, apart from the dependencies: the image installs them in
# a layer of their own, which a change to dtnode's code leaves cached.
dtnode_wheel="$context/dtnode-wheel"
rm -rf "$dtnode_wheel"
mkdir -p "$dtnode_wheel"
# From a clean copy of the sources: building in the repo would leave a build/ directory behind,
# whose stale modules setuptools would put into later wheels.
source_copy="$context/source"
rm -rf "$source_copy"
mkdir -p "$source_copy"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/node" "$repo/protocol" "$source_copy/"
find "$source_copy" -name __pycache__ -prune -exec rm -rf {} +
nice -n 19 "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$dtnode_wheel" "$source_copy"
rm -rf "$source_copy"
nice -n 19 "${pip[@]}" --constraint "$constraints" "$dtnode_wheel"/dtnode-*.whl
rm -f "$wheelhouse"/dtnode-*.whl  # pip wheel copies the wheel it was given there too
# What the image installs from the wheelhouse: dtnode's dependencies (its wheel's Requires-Dist,
# extras left out), torch pinned to the wheelhouse's build.
"$python" - "$dtnode_wheel"/dtnode-*.whl "$torch_version" >"$wheelhouse/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(archive.read(name).decode())
for requirement in metadata.get_all("Requires-Dist") or []:
    if "extra ==" not in requirement:
        print(requirement)
print(f"torch=={torch_version}")
PY
say "wheelhouse ready: $(ls "$wheelhouse" | wc -l) files, $(du -sh "$wheelhouse" | cut -f1), $((SECONDS - started)) s"

# --- 2. base image ---------------------------------------------------------------------------
started=$SECONDS
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# debootstrap_image TAG PACKAGES [--change INSTRUCTION]...: Debian bookworm (minbase) with PACKAGES
# (comma-separated, with their dependencies) from $mirror, imported with `docker import` as TAG.
debootstrap_image() {
  local tag="$1" packages="$2" rootfs
  shift 2
  command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root to make $tag"
  rootfs="$(mktemp -d "${TMPDIR:-/tmp}/dtnode-rootfs.XXXXXX")"
  # shellcheck disable=SC2064  # expand $rootfs now: it is local to this function
  trap "rm -rf '$rootfs'" EXIT
  say "debootstrap --variant=minbase bookworm ($packages) from $mirror into $rootfs"
  nice -n 19 ionice -c3 debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || die "debootstrap failed; see $rootfs.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
  say "docker import as $tag"
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    "$@" - "$tag" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
  trap - EXIT
}

make_base_with_debootstrap() {
  command -v debootstrap >/dev/null || die "no image could be pulled and debootstrap is not installed (apt-get install debootstrap)"
  debootstrap_image "$local_base" python3,python3-venv --change 'CMD ["/bin/bash"]'
}

if [ -n "$base_image" ]; then
  have_image "$base_image" || docker pull "$base_image" || die "base image $base_image is neither here nor pullable"
elif have_image "$local_base"; then
  base_image="$local_base"
elif timeout 120 docker pull --quiet "$pullable_base" >/dev/null 2>&1; then
  base_image="$pullable_base"
else
  say "cannot pull $pullable_base: making $local_base with debootstrap"
  make_base_with_debootstrap
  base_image="$local_base"
fi
base_python="$(docker run --rm --network none --entrypoint python3 "$base_image" -c \
  'import sys, venv; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
  || die "base image $base_image has no python3 with the venv module"
[ "$base_python" = 3.11 ] || die "base image $base_image has Python $base_python; the wheelhouse is for 3.11"
say "base image: $base_image (Python $base_python), $((SECONDS - started)) s"

# --- 3. image --------------------------------------------------------------------------------
started=$SECONDS
cp "$repo/docker/Dockerfile" "$repo/docker/swarm-entry.sh" "$context/"
say "docker build -t $tag (context $context)"
# --cpu-shares 2: the build containers yield the CPU to anything else running on the host.
# The install stage (the dependencies' venv) is tagged ${tag}-deps, so that it is never a dangling
# image a prune removes: the next build finds it in the cache and rebuilds only dtnode's layer.
nice -n 19 docker build --network none --cpu-shares 2 --build-arg "BASE_IMAGE=$base_image" \
  --target install -t "${tag}-deps" "$context"
nice -n 19 docker build --network none --cpu-shares 2 --build-arg "BASE_IMAGE=$base_image" -t "$tag" "$context"
# Unused dangling images of earlier builds: a previous image of this tag (its install stage is
# the tagged one above). `prune` spares images in use.
docker image prune --force --filter label=dtnode.stage=final >/dev/null
say "built $tag: $(docker image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1 / 1e9}'), $((SECONDS - started)) s"

# --- 4. Prometheus (--prometheus) ------------------------------------------------------------
# Debian's prometheus package in a debootstrap image of its own (made once, kept): the compose
# swarm's Prometheus, which scrapes every node (docker/prometheus.yml).
if [ "$prometheus" = 1 ]; then
  started=$SECONDS
  if have_image "$prometheus_image"; then
    say "Prometheus image: $prometheus_image (exists; \`docker rmi\` it to remake it)"
  else
    debootstrap_image "$prometheus_image" prometheus \
      --change 'USER prometheus' \
      --change 'WORKDIR /var/lib/prometheus' \
      --change 'EXPOSE 9090' \
      --change 'ENTRYPOINT ["/usr/bin/prometheus"]' \
      --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]'
    say "built $prometheus_image: $(docker run --rm --network none "$prometheus_image" --version 2>&1 | head -n 1), $((SECONDS - started)) s"
  fi
fi
