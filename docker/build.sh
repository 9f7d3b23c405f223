#!/usr/bin/env bash
# `make docker-build`: build the image runtime.image and runtime.recipe name, tagged as the
# launcher runs it.  docker/build.sh <recipe file> <base image> <tag>
# The CPU recipe gets the build host's CA bundle and torch+cpu wheel staged in .docker-build/
# (see docker/Dockerfile.cpu); the legacy builder (no buildx needed) with the host's network,
# which the package registries may only be reachable through.
set -euo pipefail
recipe=$1 base=$2 tag=$3
cd "$(dirname "$0")/.."
docker info >/dev/null 2>&1 || { echo "[docker-build] error: no Docker engine answers (docker/engine.sh up starts one)" >&2; exit 1; }
args=()
if [ "$recipe" = docker/Dockerfile.cpu ]; then
    args+=(--build-arg "BASE_IMAGE=$base")
    rm -rf .docker-build && mkdir -p .docker-build/wheels
    trap 'rm -rf .docker-build' EXIT
    cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" .docker-build/ca-certificates.crt
    # the local wheel directories pip is configured with (PIP_FIND_LINKS, `pip config`): torch+cpu only
    links="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr '\n' ' ')"
    for dir in $links; do
        [ -d "$dir" ] && find "$dir" -maxdepth 1 -name 'torch-*+cpu-*.whl' -exec cp -n {} .docker-build/wheels/ \;
    done
    [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
else
    args+=(--build-arg "VLLM_IMAGE=$base")
fi
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build --network host -f "$recipe" "${args[@]}" -t "$tag" .
echo "[docker-build] $tag built in $(( $(date +%s) - start )) s" >&2
