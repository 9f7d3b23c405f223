"""An audited shard read in full, apart from the scan: its sha256 and every sample's statistics from the bytes.

The audit reads every byte of its shards (~0.4 s for a 268 MB shard on an H200 host) where the scan reads a quarter
of the rows; done inside a scan thread it held that thread while the others alone kept the GPU busy. So
`verify_scan.scan_shards` starts the audits in threads of their own (hashlib and numpy let go of the GIL) and scans
the audited shards last, when their audits are done; the scan judges what the audit found exactly as before
(docs/BENCHMARKS.md, "Verify's scan, session 18").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline import shard_stats
from pipeline.shard_view import _NUMPY_VIEW, ShardView
from pipeline.shards import read_header
from pipeline.target import sha256_file


@dataclass
class FullRead:
    """What reading a shard in full found: nothing is judged here (the scan does that, with the manifest)."""

    digest: str
    # sample id -> [L, 4] statistics derived from the bytes (audited shards; empty when the file is unreadable:
    # the scan reports why)
    stats: dict[int, np.ndarray] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def read_in_full(path: Path, with_stats: bool) -> FullRead:
    t = time.perf_counter()
    found = FullRead(digest=sha256_file(path))
    found.seconds["sha256"] = time.perf_counter() - t
    if not with_stats:
        return found
    t = time.perf_counter()
    try:
        header, data_start = read_header(path)
        shard = ShardView(np.memmap(path, dtype=np.uint8, mode="r"), header, data_start)
        for name, entry in header.items():
            sid, _, kind = name.partition("/")
            if kind == "hidden_states" and sid.isdigit() and entry["dtype"] in _NUMPY_VIEW and len(entry["shape"]) == 3:
                found.stats[int(sid)] = shard_stats.sample_stats(shard.numpy(name))
    except (ValueError, KeyError, TypeError):
        found.stats.clear()
    found.seconds["audit_stats"] = time.perf_counter() - t
    return found
