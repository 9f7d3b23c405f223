"""An audited shard read in full, apart from the scan: its sha256 and every sample's statistics from the bytes.

The audit reads every byte of its shards (~0.4 s for a 268 MB shard on an H200 host) where the scan reads a quarter
of the rows; done inside a scan thread it held that thread while the others alone kept the GPU busy. So
`scan.scan_shards` starts the audits in threads of their own (hashlib and numpy let go of the GIL) and scans
the audited shards last, when their audits are done; the scan judges what the audit found exactly as before
(H200, 2026-12-05: `git show 61b87c6:docs/BENCHMARKS.md`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.format import logical_header, read_header
from pipeline.target import sha256_file
from pipeline.verification.shard_view import _NUMPY_VIEW, ShardView


@dataclass
class FullRead:
    """What reading a shard in full found: nothing is judged here (the scan does that, with the manifest)."""

    digest: str
    # sample id -> [L, 4] statistics derived from the bytes (audited shards; empty when the file is unreadable:
    # the scan reports why)
    stats: dict[int, np.ndarray] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def read_in_full(path: Path, with_stats: bool) -> FullRead:
    """The shard's sha256 and (`with_stats`) its samples' statistics from the bytes, in one read where its layout
    allows: each sample's states are hashed a block of rows at a time and their statistics taken from the block just
    hashed (still in cache), not read from memory a second time (the scan's time follows the host's, memory
    bandwidth the suspect: H100 and H200, 2026-12-05, `git show 61b87c6:docs/BENCHMARKS.md`)."""
    if not with_stats:
        t = time.perf_counter()
        return FullRead(digest=sha256_file(path), seconds={"sha256": time.perf_counter() - t})
    try:
        header, data_start = read_header(path)
        header = logical_header(header)  # an fp8 sample's states and scale as one entry (format version 2)
    except (ValueError, KeyError, TypeError):
        header, data_start = None, 0
    data = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    states = _states_in_file_order(header, data_start, data.size) if header is not None else None
    if states is None:  # unreadable or not laid out in order: hashed whole, statistics from a second read
        return _read_twice(path, data, header, data_start)
    try:
        return _read_once(data, header, data_start, states)
    except (ValueError, KeyError, TypeError):  # a shape that does not fit its bytes: as before, no statistics
        return _read_twice(path, data, None, data_start)


def _read_once(data: np.ndarray, header: dict, data_start: int, states: list) -> FullRead:
    found = FullRead(digest="", seconds={"sha256": 0.0, "audit_stats": 0.0})
    digest, shard, at = hashlib.sha256(), ShardView(data, header, data_start), 0
    for sid, name, begin, end in states:
        _hash(digest, data[at:begin], found)
        view = shard.raw(name)  # the bytes as stored (fp8: their scale lies elsewhere, hashed in its own place)
        stats = _empty_stats(view.shape[1])
        # sample_stats' own chunk of rows: a block is one of its chunks, so adding blocks adds its sums in its order
        rows = max(1, shard_stats._CHUNK_VALUES // max(view.shape[2], 1))
        for t0 in range(0, view.shape[0], rows):
            block = view[t0 : t0 + rows]
            _hash(digest, block, found)
            t = time.perf_counter()
            # the statistics are of the values (fp8: dequantized, as the extractor recorded them)
            _add_block(stats, shard_stats.sample_stats(shard.rows(name, t0, t0 + rows)))
            found.seconds["audit_stats"] += time.perf_counter() - t
        found.stats[sid], at = stats, end
    _hash(digest, data[at:], found)
    found.digest = digest.hexdigest()
    return found


def _states_in_file_order(header: dict, data_start: int, size: int) -> list[tuple[int, str, int, int]] | None:
    """(sample id, tensor name, first byte, end) of each sample's states in file order; None where two overlap or one
    lies outside the file (a corrupt shard: `_read_twice` reads it as it is)."""
    states = sorted(((sid, name, data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
                     for sid, name, entry in _sample_states(header)), key=lambda s: s[2])
    ends = [data_start] + [end for *_, end in states]
    if any(begin < previous or end > size for (_, _, begin, end), previous in zip(states, ends, strict=False)):
        return None
    return states


def _sample_states(header: dict):
    """(sample id, tensor name, header entry) of each sample's [T, L, H] states of a dtype with a numpy view."""
    for name, entry in header.items():
        sid, _, kind = name.partition("/")
        if kind == "hidden_states" and sid.isdigit() and entry["dtype"] in _NUMPY_VIEW and len(entry["shape"]) == 3:
            yield int(sid), name, entry


def _hash(digest, data: np.ndarray, found: FullRead) -> None:
    t = time.perf_counter()
    digest.update(data)  # contiguous bytes of the map; hashlib lets go of the GIL for large buffers
    found.seconds["sha256"] += time.perf_counter() - t


def _empty_stats(layers: int) -> np.ndarray:
    out = np.zeros((layers, 4))
    out[:, 2], out[:, 3] = np.inf, -np.inf
    return out


def _add_block(total: np.ndarray, block: np.ndarray) -> None:
    """A block's statistics into the sample's, as `shard_stats.sample_stats` adds its chunks (one chunk a block: the
    same sums in the same order, so the same bits; NaN kept in min and max)."""
    total[:, :2] += block[:, :2]
    for layer in range(total.shape[0]):
        for col, pick in ((2, min), (3, max)):
            mine, theirs = total[layer, col], block[layer, col]
            total[layer, col] = theirs if np.isnan(theirs) or np.isnan(mine) else pick(mine, theirs)


def _read_twice(path: Path, data: np.ndarray, header: dict | None, data_start: int) -> FullRead:
    t = time.perf_counter()
    found = FullRead(digest=sha256_file(path))
    found.seconds["sha256"] = time.perf_counter() - t
    t = time.perf_counter()
    if header is not None:
        shard = ShardView(data, header, data_start)
        try:
            for sid, name, _ in _sample_states(header):
                found.stats[sid] = shard_stats.sample_stats(shard.numpy(name))
        except (ValueError, KeyError, TypeError):
            found.stats.clear()
    found.seconds["audit_stats"] = time.perf_counter() - t
    return found
