#!/usr/bin/env bash
# Brings up what the container path needs where it does not answer, and stops only what it started.
#   docker/engine.sh up [--no-registry]
#                          a Docker engine (Debian's docker.io: installed if absent, dockerd started
#                          in the background, no systemd needed) and a registry on 127.0.0.1:5000
#                          (Debian's docker-registry) for the base image's digest (docker/base.sh);
#                          --no-registry: the engine only (a base pinned elsewhere, EAGLE3_CPU_BASE)
#   docker/engine.sh down  stops what `up` started (CI: a trap in .ci/run), nothing else
# State (pids, logs, the registry's config) lives in $EAGLE3_ENGINE_STATE (default /run/eagle3-engine);
# the registry's storage in /var/lib/eagle3-registry, so a base pushed once survives a restart.
set -euo pipefail
STATE=${EAGLE3_ENGINE_STATE:-/run/eagle3-engine}
REGISTRY_ADDR=127.0.0.1:5000
REGISTRY_STORAGE=${EAGLE3_REGISTRY_STORAGE:-/var/lib/eagle3-registry}

say() { echo "[engine] $*" >&2; }
die() { say "error: $*"; exit 1; }

engine_answers() { docker info >/dev/null 2>&1; }
registry_answers() { python3 -c "import urllib.request,sys; urllib.request.urlopen('http://$REGISTRY_ADDR/v2/', timeout=2)" 2>/dev/null; }

apt_install() {  # Debian/Ubuntu packages, as root; anything else is the user's to install
    command -v apt-get >/dev/null || die "no $1 and no apt-get here: install $1 yourself"
    [ "$(id -u)" = 0 ] || die "no $1 here: install it (apt-get install $1) or run this as root"
    say "installing Debian's $1"
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1") >"$STATE/apt-$1.log" 2>&1 \
        || die "apt-get install $1 failed: see $STATE/apt-$1.log"
}

wait_for() {  # wait_for <what> <seconds> <command...>
    local what=$1 secs=$2; shift 2
    for _ in $(seq "$secs"); do "$@" && return 0; sleep 1; done
    return 1
}

up() {
    mkdir -p "$STATE"
    if engine_answers; then
        say "a Docker engine answers: using it"
    else
        command -v dockerd >/dev/null || apt_install docker.io
        command -v docker >/dev/null || die "dockerd is installed but no docker CLI is on PATH"
        [ "$(id -u)" = 0 ] || die "no Docker engine answers and starting dockerd needs root"
        say "starting dockerd (log: $STATE/dockerd.log)"
        setsid dockerd >"$STATE/dockerd.log" 2>&1 < /dev/null &
        echo $! >"$STATE/dockerd.pid"
        wait_for dockerd 60 engine_answers || die "dockerd did not answer within 60 s: see $STATE/dockerd.log"
    fi
    if [ "${1:-}" = --no-registry ]; then
        return 0
    elif registry_answers; then
        say "a registry answers on $REGISTRY_ADDR: using it"
    else
        command -v docker-registry >/dev/null || apt_install docker-registry
        mkdir -p "$REGISTRY_STORAGE"
        # not the package's /etc/docker/registry/config.yml: that one listens on every interface, with htpasswd
        cat >"$STATE/registry.yml" <<YML
version: 0.1
storage:
  filesystem:
    rootdirectory: $REGISTRY_STORAGE
http:
  addr: $REGISTRY_ADDR
YML
        say "starting docker-registry on $REGISTRY_ADDR (log: $STATE/registry.log)"
        setsid docker-registry serve "$STATE/registry.yml" >"$STATE/registry.log" 2>&1 < /dev/null &
        echo $! >"$STATE/registry.pid"
        wait_for registry 30 registry_answers || die "docker-registry did not answer within 30 s: see $STATE/registry.log"
    fi
}

stop() {  # stop <name>: the process `up` started, by its pid, and wait for it to go
    local pidfile="$STATE/$1.pid" pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping $1 (pid $pid), which engine.sh started"
        kill -TERM "$pid"
        wait_for "$1" 30 bash -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

down() { stop registry; stop dockerd; }

case "${1:-}" in
    up) up "${2:-}" ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
