#!/usr/bin/env bash
# The CPU image's wheels, made on the build host by the host's own pip from the same pins as
# `make setup` (requirements/cpu.txt, requirements/no-deps.txt, the pip of docker/Dockerfile.cpu):
# the build then installs them with --no-index, so it needs no TLS, no index and no torch+cpu
# wheel of its own, and a rebuild reads them from this disk instead of PyPI.
#   docker/wheelhouse.sh   prints the wheelhouse directory on its last line
# One directory per content of those files ($EAGLE3_WHEELHOUSE, default ~/.cache/eagle3-pipeline),
# made once: a directory only ever holds the wheels of one resolution, so pip in the image picks
# exactly them. The host's pip config (its find-links, its CA bundle) is what finds them; where
# torch+cpu is on no index the host knows, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[wheelhouse] $*" >&2; }

# the pip the image upgrades to before installing (docker/Dockerfile.cpu reads the same line)
PIP_PIN=$(sed -n 's/^ARG PIP_VERSION=//p' docker/Dockerfile.cpu)
[ -n "$PIP_PIN" ] || { say "error: no 'ARG PIP_VERSION=' line in docker/Dockerfile.cpu"; exit 1; }
key=$( { echo "pip==$PIP_PIN"; cat requirements/cpu.txt requirements/no-deps.txt; } | sha256sum | cut -c1-12)
top=${EAGLE3_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-pipeline}
dir=$top/wheels-$key
if [ -f "$dir/.complete" ]; then
    say "reusing $dir"
    echo "$dir"
    exit 0
fi
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
start=$(date +%s)
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
# pip wheel: wheels as they are on the index, and any sdist (antlr4-python3-runtime) built into
# a wheel here, so the image needs no build tools and no index for it
"$py" -m pip wheel -q --progress-bar off -w "$dir.tmp" -r requirements/cpu.txt "pip==$PIP_PIN"
"$py" -m pip download -q --progress-bar off --no-deps -d "$dir.tmp" -r requirements/no-deps.txt
rm -rf "$dir" && mv "$dir.tmp" "$dir" && touch "$dir/.complete"
say "made $dir in $(( $(date +%s) - start )) s: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
echo "$dir"
