#!/usr/bin/env bash
# The container phase of `make test` (and all of `make test-container`): the container tests
# (tests/test_container.py) need a Docker engine, the registry on loopback and the CPU image:
# here the engine and registry are brought up where none answers (docker/engine.sh; what it
# started is stopped at the end), the base and the CPU image built where they are not (a built
# one is reused: its tag names the recipe's content). Each phase's wall is printed.
# Under CI=true the container tests fail, never skip, when no engine could be started.
# EAGLE3_CPU_BASE=name:tag@sha256:... uses that base (e.g. debian:bookworm-slim by digest,
# where a public registry is reachable) instead of building one with docker/base.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[ci-container] $1: $(( $(date +%s) - $2 )) s" >&2; }
t0=$(date +%s)
make -s setup
PY=.venv/bin/python

t=$(date +%s)
EAGLE3_ENGINE_STATE=$(mktemp -d /tmp/eagle3-engine.XXXXXX)  # this run's pids: `down` stops only those
export EAGLE3_ENGINE_STATE
trap 'docker/engine.sh down' EXIT
if docker/engine.sh up ${EAGLE3_CPU_BASE:+--no-registry}; then
    phase "engine and registry" "$t"
    t=$(date +%s)
    # the CPU image's wheels (docker/wheelhouse.sh) are fetched while the base is bootstrapped:
    # both wait mostly on their downloads, so side by side they take little more than the longer
    docker/wheelhouse.sh >/dev/null &
    wheels=$!
    base=${EAGLE3_CPU_BASE:-$(docker/base.sh | tail -1)}
    phase "base image $base" "$t"
    wait "$wheels" || { echo "[ci-container] error: docker/wheelhouse.sh failed (above)" >&2; exit 1; }
    phase "base image and wheelhouse" "$t"
    t=$(date +%s)
    params=$(mktemp /tmp/eagle3-ci-params.XXXXXX.yaml)
    "$PY" - "$base" "$params" <<'PY'
import sys, yaml
raw = yaml.safe_load(open("params.yaml"))
raw["runtime"].update(recipe="cpu", image=sys.argv[1], gpus="none")
yaml.safe_dump(raw, open(sys.argv[2], "w"), sort_keys=False)
PY
    tag=$("$PY" -m pipeline.workflow.launcher --params "$params" tag)
    if docker image inspect "$tag" >/dev/null 2>&1; then
        echo "[ci-container] $tag is built: reusing it" >&2
    else
        make -s docker-build PARAMS="$params"
    fi
    rm -f "$params"
    phase "CPU image $tag" "$t"
    export EAGLE3_CPU_BASE=$base
else
    echo "[ci-container] no Docker engine could be started: the container tests will fail (CI=true) or skip" >&2
fi

t=$(date +%s)
rc=0
"$PY" -m pytest -q -m container tests/test_container.py || rc=$?
phase "container tests (exit $rc)" "$t"
phase "container phase in all" "$t0"
exit $rc
