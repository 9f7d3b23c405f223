#!/usr/bin/env bash
# `make docker-build`: build the image runtime.image and runtime.recipe name, tagged as the
# launcher runs it.  docker/build.sh <recipe file> <base image> <tag>
# The Debian-based recipes (cpu, gpu-debian) install the files of docker/wheelhouse.sh (fetched on
# this host from the recipe's pins) with --no-index, served to the build over loopback for the
# build's length: they never enter the build context nor a layer, and a cold build reads them from
# this disk. The legacy builder (no buildx needed) with the host's network, which loopback is
# reached through.
set -euo pipefail
recipe=$1 base=$2 tag=$3
cd "$(dirname "$0")/.."
say() { echo "[docker-build] $*" >&2; }
docker info >/dev/null 2>&1 || { say "error: no Docker engine answers (docker/engine.sh up starts one)"; exit 1; }
args=()
case "$recipe" in
    docker/Dockerfile.cpu) wheelhouse=cpu ;;
    docker/Dockerfile.gpu-debian) wheelhouse=gpu-debian ;;
    *) wheelhouse= ;;
esac
if [ -n "$wheelhouse" ]; then
    args+=(--build-arg "BASE_IMAGE=$base")
    t=$(date +%s)
    wheels=$(docker/wheelhouse.sh "$wheelhouse" | tail -1)
    say "wheelhouse: $(( $(date +%s) - t )) s"
    # A fixed port, so that the URL (a build arg the install step sees) and with it the layer cache
    # stay the same from build to build; the next ones where it is taken (the cache then misses once).
    server=
    trap '[ -n "$server" ] && kill "$server" 2>/dev/null; true' EXIT
    for port in 5080 5081 5082 5083; do
        python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
        server=$!
        for _ in $(seq 50); do
            python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && break 2
            kill -0 "$server" 2>/dev/null || break
            sleep 0.1
        done
        kill "$server" 2>/dev/null || true
        server=
    done
    [ -n "$server" ] || { say "error: could not serve $wheels on any of 127.0.0.1:5080-5083"; exit 1; }
    args+=(--build-arg "WHEELS_URL=http://127.0.0.1:$port/")
else
    args+=(--build-arg "VLLM_IMAGE=$base")
fi
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build --network host -f "$recipe" "${args[@]}" -t "$tag" .
say "$tag built in $(( $(date +%s) - start )) s"
