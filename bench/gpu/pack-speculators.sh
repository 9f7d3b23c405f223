#!/usr/bin/env bash
# Pack speculators (the version in requirements/no-deps.txt) for the offline H200 host, whose image has python3.12 +
# torch + transformers but not speculators and what it imports: for training the draft on the GPU (`--jobs pipeline`)
# and for speculators' own data generation beside our extract stage (`--jobs peer`). It also carries `datasets` and
# `multiprocess`, which every job of bench/gpu_extract_bench.py imports and the image lacks. It goes beside the vLLM
# pack (docs/BENCHMARKS.md "GPU hosts").
#
# Run on a machine with PyPI, from the root of the repo whose tree goes to the GPU host:
#     bash bench/gpu/pack-speculators.sh
# Result: .gpuspec/spec-site.tar.xz + .sha256 (one part, ~2 MiB), `/.gpuspec/` in .git/info/exclude: never commit it.
#
# What is packed: speculators and the part of its dependency closure that the H200 image lacks, at the versions this
# project's CPU environment runs (the closure was read from that environment's metadata, 2026-12-02, and filtered by
# the image's package list in bench/gpu/pack-dvc.sh), as CPython 3.12 manylinux x86_64 wheels, installed without
# their dependencies into one PYTHONPATH directory. Unpack on the host after the vLLM pack, and put it after it on
# PYTHONPATH (vLLM's pack carries some of the same packages; its versions are the ones vLLM ran with):
#   (cd .gpuspec && sha256sum -c spec-site.tar.xz.sha256) \
#    && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2],filter='tar')" .gpuspec/spec-site.tar.xz /tmp/specsite \
#    && export PYTHONPATH=/tmp/site:/tmp/specsite
#   python3 -c "import speculators; print(speculators.__version__)"
# Env knobs: PYVER (3.12), OUTDIR (.gpuspec), WORK (scratch dir, default: a new mktemp -d), MAX_MIB (20).
# Needs: python3 with pip, xz, sha256sum; network to PyPI.
set -euo pipefail

PYVER=${PYVER:-3.12}
OUTDIR=${OUTDIR:-.gpuspec}
MAX_MIB=${MAX_MIB:-20}
ABI=cp${PYVER/./}

top=$(git rev-parse --show-toplevel 2>/dev/null || true)
if [ "$top" != "$(pwd -P)" ]; then
  echo "run this from the root of the repo whose tree goes to the GPU host" >&2
  exit 1
fi
SPEC_VERSION=$(sed -n 's/^speculators==\([0-9.]*\)$/\1/p' requirements/no-deps.txt)
[ -n "$SPEC_VERSION" ] || { echo "no speculators==X pin in requirements/no-deps.txt" >&2; exit 1; }
if [ "${OUTDIR#/}" = "$OUTDIR" ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "/$OUTDIR/" "$exclude" 2>/dev/null || echo "/$OUTDIR/" >>"$exclude"
fi

# speculators' closure minus the image's packages, at the versions that ran here (see the header)
PACKAGES=(
  "speculators==$SPEC_VERSION" hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  loguru==0.7.3 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1
  pydantic-settings==2.16.3 python-dotenv==1.2.4 truststore==0.10.5
  # vLLM 0.26's OpenAI server (the peer job's `vllm serve`) imports these at module level, and the vLLM pack (made for
  # the offline engine) lacks them: uvicorn (2026-12-03: "No module named 'uvicorn'"), watchfiles (its SSL refresher)
  # and model-hosting-container-standards (its SageMaker routes; with jmespath and supervisor, which that imports).
  # Found by a static walk of the server's module-level imports in the 0.26.0 wheel; h11, click, anyio on the image
  uvicorn==0.55.0 watchfiles==1.1.1 model-hosting-container-standards==0.1.16 jmespath==1.0.1 supervisor==4.3.0
)

WORK=${WORK:-$(mktemp -d)}
SITE=$WORK/site
rm -rf "$SITE" "$WORK/dl" && mkdir -p "$SITE" "$WORK/dl"
PLAT=()
for n in $(seq 39 -1 5); do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
PYFLAGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none "${PLAT[@]}")

echo "scratch: $WORK; speculators $SPEC_VERSION for CPython $PYVER"
python3 -m pip download -q --no-deps "${PYFLAGS[@]}" -d "$WORK/dl" "${PACKAGES[@]}"
python3 -m pip install -q --no-deps --no-index --no-compile "${PYFLAGS[@]}" --target "$SITE" "$WORK"/dl/*.whl
rm -rf "$SITE/bin"
rm -f "$SITE"/*.dist-info/direct_url.json
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
(cd "$WORK/dl" && ls *.whl) >"$SITE/GPUSPEC_WHEELS.txt"
du -sh "$SITE"

mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/spec-site.tar.xz*
tar -C "$SITE" --owner=0 --group=0 --numeric-owner -cf - . | xz -9e -T0 >"$OUTDIR/spec-site.tar.xz"
(cd "$OUTDIR" && sha256sum spec-site.tar.xz >spec-site.tar.xz.sha256)
bytes=$(stat -c %s "$OUTDIR/spec-site.tar.xz")
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "$OUTDIR/spec-site.tar.xz is $((bytes / 1048576)) MiB, over MAX_MIB=$MAX_MIB" >&2
  exit 1
fi
echo "pack: $OUTDIR/spec-site.tar.xz, $((bytes / 1024)) KiB; scratch kept in $WORK (unpacked tree in $WORK/site)"
