"""The bytes an extraction writes and whether they fit: shard overhead measured, free space, the disk need.

Used before any GPU time is spent, by the extract stage (it refuses to start when the shards still
to write and vLLM's scratch files do not fit, pipeline/extraction/output.py) and by
`python -m pipeline plan` (pipeline/planning/plan.py), which also projects wall time and memory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.hidden_states.storage import DTYPE_BYTES, state_bytes_per_token  # noqa: F401 (the planner reads them here)

IDS_MASK_BYTES = 9  # int64 input id + uint8 loss mask per token (docs/FORMAT.md)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    raise AssertionError


def human_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"



# --- bytes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overhead:
    """Bytes a shard costs beyond its tensors' data, per sample (header entries + manifest rows,
    the per-shard fixed part spread over the shard's samples), and where it was measured."""

    per_sample: float
    source: str


def measure_overhead(shard_dir: Path | None, num_layers: int, hidden: int, dtype: str, samples_per_shard: int) -> Overhead:
    """Measure on the first complete shard in `shard_dir`; else write one with the real writer."""
    from pipeline.hidden_states import format as shards

    for path in shards.complete_shards(shard_dir) if shard_dir and shard_dir.is_dir() else []:
        m = shards.read_manifest(path)
        per_token = state_bytes_per_token(len(m["layer_ids"]), m["hidden_size"], m["dtype"]) + IDS_MASK_BYTES
        total = path.stat().st_size + shards.manifest_path(path).stat().st_size
        over = total - per_token * sum(m["num_tokens"])
        return Overhead(over / len(m["sample_ids"]), f"measured on {path}")
    import torch

    n = min(samples_per_shard, 8)
    with tempfile.TemporaryDirectory(prefix="plan-overhead-") as tmp:
        samples = [
            shards.stored(shards.Sample(10**6 + i, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.uint8),
                                        torch.zeros(1, num_layers, hidden, dtype=getattr(torch, shards.engine_dtype(dtype)))), dtype)
            for i in range(n)
        ]
        extra = {"layer_ids": list(range(num_layers)), "layer_id_convention": shards.LAYER_ID_CONVENTION,
                 "dtype": dtype, "hidden_size": hidden, "model_fingerprint": "0" * 64, "run_key": "0" * 64,
                 "vllm_version": "0.0.0", "rank": 0}
        m = shards.write_shard(Path(tmp), 0, samples, extra)
        total = m["bytes"] + shards.manifest_path(Path(tmp) / m["file"]).stat().st_size
    per_token = state_bytes_per_token(num_layers, hidden, dtype) + IDS_MASK_BYTES
    return Overhead((total - per_token * n) / n, f"measured on a {n}-sample shard written by pipeline/hidden_states/format.py (no real shard yet)")


@dataclass(frozen=True)
class Projection:
    samples: int
    tokens: int
    num_layers: int  # captured layers
    hidden_size: int
    dtype: str
    overhead: Overhead

    @property
    def bytes_per_token(self) -> int:
        return state_bytes_per_token(self.num_layers, self.hidden_size, self.dtype) + IDS_MASK_BYTES

    @property
    def bytes(self) -> int:
        return int(self.tokens * self.bytes_per_token + self.samples * self.overhead.per_sample)


# --- free space ----------------------------------------------------------------------------------


def existing_ancestor(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    return p.resolve()


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on `path`'s filesystem (or its nearest existing parent)."""
    return shutil.disk_usage(existing_ancestor(path)).free


@dataclass(frozen=True)
class DiskNeed:
    """What an extraction still has to write, against the space it can use."""

    out: str
    filesystem: str
    shard_bytes: int  # projected bytes of the shards still to write
    scratch_bytes: int  # upper bound of vLLM's per-request files alive at once (hidden_states.scratch)
    kept_bytes: int  # complete shards of this same run, kept (resume)
    reclaimed_bytes: int  # shards of another run, which the stage deletes first
    free: int
    margin: float

    @property
    def needed(self) -> int:
        return self.shard_bytes + self.scratch_bytes

    @property
    def required(self) -> int:
        return int(self.needed * (1 + self.margin))

    @property
    def available(self) -> int:
        return self.free + self.reclaimed_bytes

    @property
    def fits(self) -> bool:
        return self.required <= self.available

    def refusal(self, proj: Projection, seq_len: int | None) -> str:
        return (
            f"not enough free space for the extraction: it will write {human_bytes(self.shard_bytes)} of shards "
            f"({proj.samples:,} samples, {proj.tokens:,} tokens x {proj.num_layers} layers x hidden {proj.hidden_size} "
            f"x {DTYPE_BYTES[proj.dtype]} B ({proj.dtype}) + ids, mask and format overhead) plus up to "
            f"{human_bytes(self.scratch_bytes)} of vLLM's scratch files, {human_bytes(self.required)} with the "
            f"{self.margin:.0%} margin (extract.free_space_margin), but the filesystem holding {self.filesystem} has "
            f"{human_bytes(self.available)} free"
            + (f" (counting {human_bytes(self.reclaimed_bytes)} of old shards it would delete)" if self.reclaimed_bytes else "")
            + f". Nothing was written. To fit: free space there or point {self.out} elsewhere (e.g. make "
            f"artifacts/ a link to a larger disk); use fewer samples (data.max_samples); shorter samples "
            f"(data.seq_len{f'; the longest prepared sample has {seq_len} tokens' if seq_len else ''}); fewer layers (extract.layer_ids, now "
            f"{proj.num_layers})" + ({"float32": "; or extract.dtype: bfloat16 (half of float32) or float8_e4m3 (about a quarter)",
                                    "bfloat16": "; or extract.dtype: float8_e4m3 (about half of bfloat16)"}.get(proj.dtype, ""))
            + ". `python -m pipeline plan` shows the projection."
        )


def scratch_bound(tokens: int, samples: int, samples_per_shard: int, max_num_batched_tokens: int, bytes_per_token: int) -> int:
    """vLLM's per-request files live until their shard is written: at most the shards handed to the
    writer threads (2 per thread), the one being fed, and the engine's in-flight requests."""
    from pipeline.extraction.engine import shard_workers

    if not samples:
        return 0
    mean = tokens / samples
    in_flight = (2 * shard_workers() + 1) * samples_per_shard * mean + 4 * max_num_batched_tokens
    return int(min(tokens, in_flight) * bytes_per_token)


def disk_need(out: Path, proj: Projection, todo_fraction_tokens: int, todo_samples: int, kept: int, reclaimed: int,
              samples_per_shard: int, max_num_batched_tokens: int, margin: float) -> DiskNeed:
    part = Projection(todo_samples, todo_fraction_tokens, proj.num_layers, proj.hidden_size, proj.dtype, proj.overhead)
    return DiskNeed(
        out=str(out),
        filesystem=str(existing_ancestor(out)),
        shard_bytes=part.bytes,
        scratch_bytes=scratch_bound(part.tokens, part.samples, samples_per_shard, max_num_batched_tokens, part.bytes_per_token),
        kept_bytes=kept,
        reclaimed_bytes=reclaimed,
        free=free_bytes(out),
        margin=margin,
    )


def existing_work(out: Path, run_key: str | None) -> tuple[set[int], int, int]:
    """(indices of complete shards of run `run_key` the stage keeps, their bytes, bytes of the other
    shard files it deletes first), as `extraction.output.prepare_output_dir` decides."""
    from pipeline.hidden_states import format as shards

    if not out.is_dir():
        return set(), 0, 0
    try:
        old_key = shards.read_meta(out).get("run_key")
    except (FileNotFoundError, json.JSONDecodeError):
        old_key = None
    files = list(out.glob("shard-*"))
    if run_key is None or old_key != run_key:
        return set(), 0, sum(f.stat().st_size for f in files)
    kept, kept_bytes = set(), 0
    for p in shards.complete_shards(out):
        m = shards.read_manifest(p)
        if m.get("run_key") == run_key and p.stat().st_size == m.get("bytes"):
            kept.add(int(m["shard_index"]))
            kept_bytes += p.stat().st_size + shards.manifest_path(p).stat().st_size
    return kept, kept_bytes, sum(f.stat().st_size for f in files) - kept_bytes
