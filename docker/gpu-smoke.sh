#!/usr/bin/env bash
# `make docker-gpu-smoke`: builds the gpu-debian image (docker/Dockerfile.gpu-debian: vLLM's CUDA
# build and its whole lock on the Debian base) and checks in it what runs without a GPU: the stack
# imports, the pipeline's CLI, the params check on params.gpu.yaml with this recipe. Not part of
# `make test`: the wheels alone are several GB. Running the stages on a GPU needs a GPU host with
# Docker and the NVIDIA container toolkit (docs/CONTAINER.md).
# The engine and the loopback registry are brought up where none answers and what was started is
# stopped at the end (docker/engine.sh, as docker/ci-container.sh does); the base is the CPU
# recipe's ($EAGLE3_CPU_BASE, else docker/base.sh builds or reuses it). Each phase's wall is printed,
# then the image's id and size.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[gpu-smoke] $1: $(( $(date +%s) - $2 )) s" >&2; }
t0=$(date +%s)
make -s setup
PY=.venv/bin/python

EAGLE3_ENGINE_STATE=$(mktemp -d /tmp/eagle3-engine.XXXXXX)  # this run's pids: `down` stops only those
export EAGLE3_ENGINE_STATE
trap 'docker/engine.sh down; rm -f "${params:-}"' EXIT
docker/engine.sh up ${EAGLE3_CPU_BASE:+--no-registry}
base=${EAGLE3_CPU_BASE:-$(docker/base.sh | tail -1)}

# params.gpu.yaml, with this recipe on that base: what a GPU site without the vLLM image would run
params=$(mktemp /tmp/eagle3-gpu-smoke.XXXXXX.yaml)
"$PY" - "$base" "$params" <<'PY'
import sys, yaml
raw = yaml.safe_load(open("params.gpu.yaml"))
raw["runtime"].update(recipe="gpu-debian", image=sys.argv[1])
yaml.safe_dump(raw, open(sys.argv[2], "w"), sort_keys=False)
PY
tag=$("$PY" -m pipeline.workflow.launcher --params "$params" tag)
t=$(date +%s)
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "[gpu-smoke] $tag is built: reusing it" >&2
else
    make -s docker-build PARAMS="$params"
fi
phase "image $tag" "$t"

# As the launcher runs a stage, less --gpus (no GPU here): another uid, no network, the working
# tree read-only at its own path, the params file beside it. -i: the first check is a script on stdin
# (without it python3 would read nothing and pass).
t=$(date +%s)
run() { docker run -i --rm --network none -u "$(id -u):$(id -g)" -v "$PWD:$PWD:ro" -v "$params:$params:ro" -w "$PWD" "$tag" "$@"; }
run python3 - <<'PY'
import os, sysconfig
from importlib.metadata import version
import vllm, torch, speculators, dvc, pipeline  # noqa: F401
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"speculators {version('speculators')}, dvc {version('dvc')}")
print(f"no GPU here: torch.cuda.is_available() = {torch.cuda.is_available()}, "
      f"vLLM's platform {type(current_platform).__name__}")
# Triton compiles its CUDA launcher against Python.h when a kernel first runs (why python3-dev)
assert os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")), "no Python.h"
# vLLM's compiled CUDA ops load only where the driver's libcuda.so.1 is (`docker run --gpus` mounts it
# from the host): each may fail here for that reason alone, so every other library they link is in the image
import importlib, pathlib
need_driver = []
for so in sorted(pathlib.Path(vllm.__file__).parent.glob("*.abi3.so")):
    name = "vllm." + so.name.split(".")[0]
    try:
        importlib.import_module(name)
    except ImportError as e:
        if "libcuda.so.1" not in str(e):
            raise
        need_driver.append(name)
print(f"vLLM's compiled modules that need the driver's libcuda.so.1 (absent here): {', '.join(need_driver)}")
print("imports: ok")
PY
run python3 -m pipeline --params "$params" check-params
run python3 -m pipeline --help >/dev/null
phase "smoke checks" "$t"
docker image inspect --format '[gpu-smoke] {{.Id}} {{.Size}} bytes' "$tag" >&2
phase "in all" "$t0"
