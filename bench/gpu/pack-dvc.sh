#!/usr/bin/env bash
# Pack DVC (the version in requirements/cpu.txt) for the offline H200 host, whose image has
# python3.12 + torch + transformers but no DVC and no network, for the
# bench's `dvccost` job (bench/gpu_jobs/job_dvc.py, bench/dvc_cost.py).
#
# Run on a machine with PyPI, from the root of the repo whose tree goes to the GPU host:
#     bash bench/gpu/pack-dvc.sh
# Result: .gpudvc/dvc-site.tar.xz + .gpudvc/dvc-site.tar.xz.sha256 (one part, ~10 MiB; the
# script refuses above MAX_MIB), and `/.gpudvc/` in .git/info/exclude: never commit it.
#
# What is packed: dvc and every package of its dependency closure that the image lacks, as
# CPython 3.12 manylinux x86_64 wheels installed into one PYTHONPATH directory (no bin/: run DVC
# as `python3 -m dvc`). Left out: what the image already has (IMAGE below, the list
# the vLLM pack resolves against) and what the vLLM pack carries (pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions 4.16): unpack both, the
# vLLM pack first. antlr4-python3-runtime (hydra-core's) has no wheel on PyPI: it is built here
# from its sdist (pure Python, py3-none-any).
#
# Unpack on the host (from the repo root there; the image may lack `xz`: Python's tarfile):
#   (cd .gpudvc && sha256sum -c dvc-site.tar.xz.sha256) \
#    && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2],filter='tar')" .gpudvc/dvc-site.tar.xz /tmp/dvcsite \
#    && export PYTHONPATH=/tmp/site:/tmp/dvcsite
#   python3 -m dvc version        # DVC 3.67.1 ... Supports: http, https
# Git: DVC needs no git binary for this; the bench project is made with `dvc init --no-scm`.
#
# Env knobs: PYVER (3.12; 3.11 gives the cp311 equivalent, to prove the pack on this machine),
#            OUTDIR (.gpudvc), WORK (scratch dir, default: a new mktemp -d), MAX_MIB (45).
# Needs: python3 with pip and packaging, xz, sha256sum; network to PyPI.
set -euo pipefail

PYVER=${PYVER:-3.12}
OUTDIR=${OUTDIR:-.gpudvc}
MAX_MIB=${MAX_MIB:-45}
ABI=cp${PYVER/./}

top=$(git rev-parse --show-toplevel 2>/dev/null || true)
if [ "$top" != "$(pwd -P)" ]; then
  echo "run this from the root of the repo whose tree goes to the GPU host" >&2
  exit 1
fi
DVC_VERSION=$(sed -n 's/^dvc==\([0-9.]*\)$/\1/p' requirements/cpu.txt)
[ -n "$DVC_VERSION" ] || { echo "no dvc==X pin in requirements/cpu.txt" >&2; exit 1; }
if [ "${OUTDIR#/}" = "$OUTDIR" ]; then  # inside the tree: keep it out of git
  exclude=$(git rev-parse --git-path info/exclude)  # in a worktree: the main repo's, shared
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "/$OUTDIR/" "$exclude" 2>/dev/null || echo "/$OUTDIR/" >>"$exclude"
fi

WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
echo "scratch: $WORK; dvc $DVC_VERSION for CPython $PYVER"
SITE=$WORK/site
rm -rf "$SITE" "$WORK/dl" "$WORK/local" && mkdir -p "$SITE" "$WORK/dl" "$WORK/local"

PLAT=()
for n in $(seq 39 -1 5); do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
PYFLAGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none "${PLAT[@]}")

# Distributions on the GPU host's image (its package list, 2026-11; the same list the vLLM pack uses)
cat >"$WORK/image.txt" <<'TXT'
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
annotated-types pydantic pydantic-core typing-inspection
TXT
# (the last line: carried by the vLLM pack, as typing-extensions 4.16 and typing-inspection are)

# The versions that ran (this project's CPU environment from requirements/cpu.txt, 2026-12):
# constraints for pip's resolver, so the pack is the tested set, not whatever is newest.
cat >"$WORK/pins.txt" <<'TXT'
aiohttp-retry==2.9.1
amqp==5.4.2
antlr4-python3-runtime==4.9.3
appdirs==1.4.4
asyncssh==2.24.1
atpublic==9.0.0
billiard==4.3.2
celery==5.7.0
cffi==2.1.1
click-didyoumean==0.3.1
click-plugins==1.1.1.2
click-repl==0.4.1
configobj==5.0.9
cryptography==50.0.2
dictdiffer==0.10.0
diskcache==5.6.3
distro==1.9.0
dpath==2.2.0
dulwich==1.2.21
dvc-data==3.18.3
dvc-http==2.32.0
dvc-objects==5.2.0
dvc-render==1.0.2
dvc-studio-client==0.23.0
dvc-task==0.40.2
entrypoints==0.4.2
flatten-dict==0.5.0
flufl.lock==9.2.0
funcy==2.1
gitdb==4.0.12
GitPython==3.2.1
grandalf==0.8
gto==1.10.1
hydra-core==1.3.8
iterative-telemetry==0.0.10
kombu==5.7.0
omegaconf==2.3.1
orjson==3.13.0
platformdirs==4.14.9
prompt_toolkit==3.0.53
pycparser==3.12
pydantic-settings==2.16.3
pydot==4.0.1
pygit2==1.21.0
pygtrie==2.6.2
python-dotenv==1.2.4
ruamel.yaml==0.19.1
scmrepo==3.6.2
semver==3.1.2
shortuuid==1.0.13
shtab==1.13.0
smmap==5.0.3
sqltrie==0.11.3
tomlkit==0.15.2
tzlocal==5.4.5
vine==5.1.0
voluptuous==0.16.0
wcwidth==0.9.4
zc.lockfile==4.0
TXT

# ---------------------------------------------------------------- 1. wheels
echo "building antlr4-python3-runtime from its sdist (no wheel on PyPI)"
python3 -m pip wheel -q --no-deps -w "$WORK/local" antlr4-python3-runtime==4.9.3
echo "resolving dvc==$DVC_VERSION for $ABI manylinux x86_64"
python3 -m pip download -q "${PYFLAGS[@]}" --find-links "$WORK/local" -c "$WORK/pins.txt" \
  -d "$WORK/dl" "dvc==$DVC_VERSION"

# ---------------------------------------------------------------- 2. what the image lacks
python3 - "$WORK/dl" "$WORK/image.txt" "$WORK/keep.txt" <<'PY'
import os, sys
from packaging.utils import canonicalize_name as cn, parse_wheel_filename
dl, image_file, keep_file = sys.argv[1:]
image = {cn(n) for n in open(image_file).read().split()}
keep, left = [], []
for f in sorted(os.listdir(dl)):
    name, version, _, _ = parse_wheel_filename(f)
    (left if cn(name) in image else keep).append(f"{cn(name)}=={version}")
    if cn(name) not in image:
        open(keep_file, "a").write(os.path.join(dl, f) + "\n")
print(f"carried ({len(keep)}):", " ".join(keep))
print(f"left to the image / the vLLM pack ({len(left)}):", " ".join(left))
PY
mapfile -t WHEELS <"$WORK/keep.txt"
python3 -m pip install -q --no-deps --no-index --no-compile "${PYFLAGS[@]}" --target "$SITE" "${WHEELS[@]}"
rm -rf "$SITE/bin"  # console scripts with this machine's interpreter: use `python3 -m dvc`
rm -f "$SITE"/*.dist-info/direct_url.json
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
for w in "${WHEELS[@]}"; do basename "$w"; done >"$SITE/GPUDVC_WHEELS.txt"
du -sh "$SITE"

# ---------------------------------------------------------------- 3. tar, compress, check the size
echo "compressing (xz -9e)"
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/dvc-site.tar.xz*
tar -C "$SITE" --owner=0 --group=0 --numeric-owner -cf - . | xz -9e -T0 >"$OUTDIR/dvc-site.tar.xz"
(cd "$OUTDIR" && sha256sum dvc-site.tar.xz >dvc-site.tar.xz.sha256)
bytes=$(stat -c %s "$OUTDIR/dvc-site.tar.xz")
ls -l "$OUTDIR"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "$OUTDIR/dvc-site.tar.xz is $((bytes / 1048576)) MiB, over MAX_MIB=$MAX_MIB (the carry beside .gpufix/)" >&2
  exit 1
fi
echo "pack: $OUTDIR/dvc-site.tar.xz, $((bytes / 1024)) KiB; scratch kept in $WORK (unpacked tree in $WORK/site)"
