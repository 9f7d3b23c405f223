#!/usr/bin/env bash
# The wheels a Debian-based recipe installs, fetched on the build host by the host's own pip: the
# build then installs them with --no-index, so it needs no TLS, no index and no torch+cpu wheel of
# its own, and a rebuild reads them from this disk instead of PyPI.
#   docker/wheelhouse.sh [cpu|gpu-debian]   prints the wheelhouse directory on its last line
# cpu (default): the pins of `make setup` (requirements/cpu.txt, requirements/no-deps.txt), built
#   into wheels (pip wheel), for docker/Dockerfile.cpu.
# gpu-debian: the files of the hash-pinned lock requirements/gpu-cp311.txt exactly as the index
#   serves them (pip download --require-hashes, an sdist stays an sdist: a wheel built here would
#   not match the lock's hash), for docker/Dockerfile.gpu-debian, whose pip checks every hash.
# Each also holds the pip its recipe upgrades to first (the recipe's `ARG PIP_VERSION=` line).
# One directory per content of those files ($EAGLE3_WHEELHOUSE, default ~/.cache/eagle3-pipeline),
# made once: a directory only ever holds the files of one resolution, so pip in the image picks
# exactly them. The host's pip config (its find-links, its CA bundle) is what finds them; where
# torch+cpu is on no index the host knows, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[wheelhouse] $*" >&2; }

recipe=${1:-cpu}
case "$recipe" in
    cpu) dockerfile=docker/Dockerfile.cpu; pins=(requirements/cpu.txt requirements/no-deps.txt); prefix=wheels ;;
    gpu-debian) dockerfile=docker/Dockerfile.gpu-debian; pins=(requirements/gpu-cp311.txt); prefix=gpu-wheels ;;
    *) say "error: no wheelhouse for recipe '$recipe' (cpu, gpu-debian)"; exit 2 ;;
esac
PIP_PIN=$(sed -n 's/^ARG PIP_VERSION=//p' "$dockerfile")
[ -n "$PIP_PIN" ] || { say "error: no 'ARG PIP_VERSION=' line in $dockerfile"; exit 1; }
key=$( { echo "pip==$PIP_PIN"; cat "${pins[@]}"; } | sha256sum | cut -c1-12)
top=${EAGLE3_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-pipeline}
dir=$top/$prefix-$key
if [ -f "$dir/.complete" ]; then
    say "reusing $dir"
    echo "$dir"
    exit 0
fi
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
start=$(date +%s)
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
if [ "$recipe" = cpu ]; then
    # pip wheel: wheels as they are on the index, and any sdist (antlr4-python3-runtime) built into
    # a wheel here, so the image needs no build tools and no index for it
    "$py" -m pip wheel -q --progress-bar off -w "$dir.tmp" -r requirements/cpu.txt "pip==$PIP_PIN"
    "$py" -m pip download -q --progress-bar off --no-deps -d "$dir.tmp" -r requirements/no-deps.txt
else
    # the files for the image's interpreter and C library, whatever this host runs: CPython 3.11 and
    # glibc 2.36 (Debian bookworm). pip takes --platform literally, so every manylinux tag up to
    # 2.36 is named, newest first: the lock holds the hash of every file of each pinned version, and
    # some have no wheel as old as its resolution's manylinux_2_28 (llguidance: 2_31, else an sdist
    # needing Rust).
    platforms=()
    for v in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
    "$py" -m pip download -q --progress-bar off --no-deps --require-hashes -d "$dir.tmp" \
        --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
        -r requirements/gpu-cp311.txt 2> >(grep -v "^WARNING: Location 'file:" >&2)
    "$py" -m pip download -q --progress-bar off --no-deps -d "$dir.tmp" "pip==$PIP_PIN"
fi
rm -rf "$dir" && mv "$dir.tmp" "$dir" && touch "$dir/.complete"
say "made $dir in $(( $(date +%s) - start )) s: $(ls "$dir" | wc -l) files, $(du -sh "$dir" | cut -f1)"
echo "$dir"
