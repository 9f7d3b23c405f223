"""The scan reads the per-sample tests' rows of a shard that is not in the page cache, and not the rest of it: the
extractor writes shards with direct I/O, so right after extraction verify reads from the disk (read whole, the 8B
shape's scan was bound by the disk: docs/BENCHMARKS.md "Verify's cost"). Real shards through the project's writer,
dropped from the page cache, gathered as bench/verify_cold_read.py does; the bytes are the kernel's count of what the
process read from the disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_scan_reads_its_judged_rows_not_the_whole_shard(tmp_path: Path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "verify_cold_read.py"), "--dir", str(tmp_path / "shards"),
                          "--gb", "0.2", "--tokens", "512", "--samples-per-shard", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    shares = {}
    for line in out.stdout.splitlines():
        way, *rest = line.split()
        if way in ("whole", "prefetch"):
            shares.setdefault(way, []).append(float(line.split("(")[1].split()[0]))
    # a 32 KiB row of 4 layers x 4096 in bf16, every 4th gathered: about a quarter of the bytes, and the pages around
    assert min(shares["whole"]) > 0.9, out.stdout  # the kernel's read-ahead reads the rows in between too
    assert max(shares["prefetch"]) < 0.35, out.stdout
