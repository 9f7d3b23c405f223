"""What an extraction computes: the prepared samples, their split into shards, and the run key they depend on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.console import say
from pipeline.errors import PipelineError
from pipeline.hidden_states import format as shards
from pipeline.layout import PREPARED_DATASET
from pipeline.params import ExtractParams
from pipeline.target import Target

COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len")


def log(msg: str) -> None:
    say(f"[extract] {msg}")


@dataclass(frozen=True)
class ShardPlan:
    num_samples: int
    samples_per_shard: int
    shards: list[int]  # this rank's shard indices

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.samples_per_shard, min((k + 1) * self.samples_per_shard, self.num_samples)


def plan_shards(num_samples: int, samples_per_shard: int, rank: int, world_size: int) -> ShardPlan:
    """Shard k holds samples [k*S, (k+1)*S) and belongs to rank k % world_size."""
    total = -(-num_samples // samples_per_shard)
    return ShardPlan(num_samples, samples_per_shard, [k for k in range(total) if k % world_size == rank])


def open_prepared(path: Path = PREPARED_DATASET):
    """(the dataset's sample_id/input_ids/loss_mask columns, seq_len as a numpy array), checked."""
    import datasets

    if not path.is_dir():
        raise PipelineError(f"{path} not found: run the prepare stage first (`dvc repro prepare`)")
    ds = datasets.load_from_disk(str(path))
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise PipelineError(f"{path} lacks columns {missing}; re-run the prepare stage")
    ids = ds.with_format("numpy")["sample_id"][:]
    if (ids != np.arange(len(ids))).any():
        raise PipelineError(f"{path}: sample_id must be 0..n-1 in order; re-run the prepare stage")
    return ds.select_columns(["sample_id", "input_ids", "loss_mask"]), ds.with_format("numpy")["seq_len"][:]


def dataset_hash(path: Path = PREPARED_DATASET) -> str:
    """Content hash of the Arrow data files (state.json may differ between identical saves)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.arrow")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def run_key_fields(target: Target, data_hash: str, layer_ids: list[int], params: ExtractParams) -> dict:
    """What the shards' contents depend on; engine tuning (batch sizes, memory) does not count."""
    return {
        "model_fingerprint": target.fingerprint["sha256"],
        "prepared_dataset_sha256": data_hash,
        "layer_ids": layer_ids,
        "dtype": params.dtype,
        "format_version": shards.format_version(params.dtype),
        "samples_per_shard": params.samples_per_shard,
        "world_size": params.world_size,
    }
