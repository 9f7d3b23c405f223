#!/bin/bash
# usage: pack.sh <pruned-dir> <out.tar.xz>
set -e
cd "$1"
BIG="ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet"
{ find . -mindepth 1 \( -type f -o -type l \) | sed 's|^\./||' | grep -vxF -e ray/_raylet.so -e ray/core/src/ray/gcs/gcs_server -e ray/core/src/ray/raylet/raylet | LC_ALL=C sort; for b in $BIG; do echo $b; done; } > /tmp/raybuild/filelist.txt
tar --owner=0 --group=0 --numeric-owner --no-recursion -cf - -T /tmp/raybuild/filelist.txt \
  | xz --format=xz --check=crc64 --x86 --lzma2=preset=9e,dict=192MiB -T1 -c > "$2"
ls -l "$2"
