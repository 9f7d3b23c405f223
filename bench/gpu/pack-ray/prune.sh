#!/bin/bash
# usage: prune.sh <unpacked-wheel-dir>   (dir contains ray/ and ray-*.dist-info/)
set -e
cd "$1"
R=ray
# 1. big optional subpackages / assets not used by core ray.init + actors
rm -rf $R/jars $R/dashboard/client $R/tune $R/rllib $R/serve $R/data $R/train $R/air \
       $R/llm $R/workflow $R/includes $R/_raylet.pxd $R/_raylet.pyi $R/setup-dev.py
# cloud-provider autoscaler plugins (only used by `ray up`)
rm -rf $R/autoscaler/aws $R/autoscaler/gcp $R/autoscaler/azure $R/autoscaler/local \
       $R/autoscaler/_private/aws $R/autoscaler/_private/gcp $R/autoscaler/_private/_azure \
       $R/autoscaler/_private/kuberay $R/autoscaler/_private/vsphere $R/autoscaler/_private/spark \
       $R/autoscaler/_private/fake_multi_node
# 2. cython/C sources, type stubs, caches inside vendored libs
find . \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pyi' -o -name '*.c' -o -name '*.h' -o -name '*.cpp' \
          -o -name '__pycache__' -o -name 'py.typed' -o -name '*.hash' \) -prune -exec rm -rf {} +
# dist-info: keep only METADATA/WHEEL/entry_points/top_level (drop RECORD, licenses)
for d in $(find . -name '*.dist-info' -type d); do
  find "$d" -mindepth 1 -maxdepth 1 ! -name METADATA ! -name WHEEL ! -name entry_points.txt ! -name top_level.txt -exec rm -rf {} +
done
# 3. strip ELF binaries (symbol tables + debug info; .dynsym is kept)
find . -type f \( -name '*.so' -o -path '*/core/src/ray/raylet/raylet' -o -path '*/core/src/ray/gcs/gcs_server' \) \
  -exec strip --strip-unneeded {} \;
