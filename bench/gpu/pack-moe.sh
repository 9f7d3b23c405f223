#!/usr/bin/env bash
# vLLM's MoE extension for the offline H200 host, which the vLLM pack (pack-vllm.sh) leaves out (a dense
# model never loads it; a MoE target, the seed shape's INT4 experts included, needs it: the Marlin
# WNA16 MoE GEMM and the MoE align/sum ops live in _moe_C_stable_libtorch).
#
# From the repo root:  bash bench/gpu/pack-moe.sh [VLLM_WHEEL]
# Result: .gpumoe/moe.tar.xz (+ .sha256), ~20 MiB, added to .git/info/exclude. With the 45 MiB vLLM part it
# exceeds one 64 MiB carry: it rides in a later command on the same warm machine (docs/BENCHMARKS.md
# "GPU hosts"). Unpack there, after the vLLM pack's unpack line:
#   (cd .gpumoe && sha256sum -c moe.tar.xz.sha256) && python3 -c "import tarfile;tarfile.open('.gpumoe/moe.tar.xz','r:xz').extractall('/tmp/site',filter='tar')"
#
# Steps: the .so from the vLLM 0.26.0 wheel (downloaded unless given), its CUDA fat binary cut to
# sm_90 with pack-vllm.sh's own fatprune.py (taken from that script, so both cut alike), its symbol
# table stripped (strip --strip-unneeded: the dynamic symbols torch loads by stay), xz -9e.
# Needs: pack-vllm.sh, the vLLM pack's script, which this repository does not hold: PACK_VLLM=its path
# (default ../shared/gpu/pack-vllm.sh, beside the checkout).
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.26.0}
ARCH=${ARCH:-90}
OUTDIR=.gpumoe
PACK_VLLM=${PACK_VLLM:-../shared/gpu/pack-vllm.sh}
[ -f "$PACK_VLLM" ] || PACK_VLLM=/work/shared/gpu/pack-vllm.sh

top=$(git rev-parse --show-toplevel 2>/dev/null || true)
if [ "$top" != "$(pwd -P)" ]; then
  echo "run this from the root of the repo whose tree goes to the GPU host" >&2
  exit 1
fi
exclude=$(git rev-parse --git-common-dir)/info/exclude
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$OUTDIR/" "$exclude" 2>/dev/null || echo "/$OUTDIR/" >>"$exclude"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
WHEEL=${1:-}
if [ -z "$WHEEL" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --platform manylinux_2_28_x86_64 -d "$WORK/dl" "vllm==$VLLM_VERSION"
  WHEEL=$(ls "$WORK"/dl/vllm-"$VLLM_VERSION"-*.whl)
fi
echo "wheel: $WHEEL"
unzip -q "$WHEEL" 'vllm/_moe_C_stable_libtorch.abi3.so' -d "$WORK/site"
SO=$WORK/site/vllm/_moe_C_stable_libtorch.abi3.so
echo "extension as shipped: $(stat -c %s "$SO") bytes"
# fatprune.py is the heredoc between "<<'PY'" and "PY" after "fatprune.py" in pack-vllm.sh
awk '/fatprune.py" <<.PY./{on=1; next} on && /^PY$/{exit} on' "$PACK_VLLM" >"$WORK/fatprune.py"
python3 "$WORK/fatprune.py" "$ARCH" "$SO"
strip --strip-unneeded "$SO"
echo "cut to sm_$ARCH and stripped: $(stat -c %s "$SO") bytes"
mkdir -p "$OUTDIR"
(cd "$WORK/site" && tar -cf - vllm/_moe_C_stable_libtorch.abi3.so) | xz -9e -T1 >"$OUTDIR/moe.tar.xz"
(cd "$OUTDIR" && sha256sum moe.tar.xz >moe.tar.xz.sha256)
echo "$OUTDIR/moe.tar.xz: $(stat -c %s "$OUTDIR/moe.tar.xz") bytes"
