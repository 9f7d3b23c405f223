#!/bin/bash
# usage: add_fallback.sh <pruned-dir> <dir-with-msgpack-and-click-wheels>
# Puts msgpack + click into ray/_fallback_deps and appends that dir to the END of sys.path
# in ray/__init__.py, so host-installed copies always win; ours are used only if missing.
set -e
D="$1/ray/_fallback_deps"; rm -rf "$D"; mkdir -p "$D"
for w in "$2"/msgpack-*.whl "$2"/click-*.whl; do unzip -q -o "$w" -d "$D"; done
rm -rf "$D"/*.dist-info/{RECORD,licenses,LICENSE*} 
find "$D" \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pyi' -o -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name 'py.typed' \) -delete
find "$D" -name '*.so' -exec strip --strip-unneeded {} \;
python3 - "$1/ray/__init__.py" <<'PY'
import sys
p=sys.argv[1]; s=open(p).read()
anchor="    sys.path.insert(0, thirdparty_files)\n"
add=("    # [gpucarry] fallback copies of msgpack/click, appended (host copies win)\n"
     "    sys.path.append(os.path.join(os.path.dirname(thirdparty_files), \"_fallback_deps\"))\n")
assert s.count(anchor)==1
if add not in s: s=s.replace(anchor, anchor+add)
open(p,"w").write(s)
PY
