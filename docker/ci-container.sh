#!/usr/bin/env bash
# `make test-container`: the container tests
# (tests/test_container.py) need a Docker engine, the registry on loopback and the CPU image:
# here the engine and registry are brought up where none answers (docker/engine.sh; what it
# started is stopped at the end), the base and the CPU image built (reused when already built).
# Under CI=true the container tests fail, never skip, when no engine could be started.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[ci] $1: $(( $(date +%s) - $2 )) s" >&2; }
t0=$(date +%s)
make setup
phase "set-up" "$t0"

t=$(date +%s)
EAGLE3_ENGINE_STATE=$(mktemp -d /tmp/eagle3-engine.XXXXXX)  # this run's pids: `down` stops only those
export EAGLE3_ENGINE_STATE
trap 'docker/engine.sh down' EXIT
if docker/engine.sh up; then
    base=$(docker/base.sh | tail -1)
    phase "engine, registry and base image" "$t"
    t=$(date +%s)
    params=$(mktemp /tmp/eagle3-ci-params.XXXXXX.yaml)
    .venv/bin/python - "$base" "$params" <<'PY'
import sys, yaml
raw = yaml.safe_load(open("params.yaml"))
raw["runtime"].update(recipe="cpu", image=sys.argv[1], gpus="none")
yaml.safe_dump(raw, open(sys.argv[2], "w"), sort_keys=False)
PY
    tag=$(.venv/bin/python -m pipeline.launcher --params "$params" tag)
    docker image inspect "$tag" >/dev/null 2>&1 || make docker-build PARAMS="$params"
    rm -f "$params"
    phase "CPU image $tag" "$t"
    export EAGLE3_CPU_BASE=$base
else
    echo "[ci] no Docker engine could be started: the container tests will fail" >&2
fi

t=$(date +%s)
.venv/bin/python -m pytest -q -m container tests/test_container.py
phase "container tests" "$t"
phase "total" "$t0"
