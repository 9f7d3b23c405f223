"""Our hidden-state shards as a speculators training dataset, read lazily (one sample at a time, through
`format.load_sample`: fp8 shards are dequantized in memory, no second copy on disk).

speculators' EAGLE-3 trainer wants per sample
    hidden_states                [T, (L-1)*H]  the auxiliary layers, concatenated in layer order
    verifier_last_hidden_states  [T, H]        the target's final state before the final norm
    input_ids [T] int64, loss_mask [T] bool
Our shards store `{sid}/hidden_states` [T, L, H] whose last layer is that final state (vLLM id N).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from speculators.train.data import BaseDataset

from pipeline.hidden_states import format as shards


@dataclass(frozen=True)
class SampleRef:
    shard: Path
    sample_id: int
    num_tokens: int


def index_shards(directory: Path) -> list[SampleRef]:
    """Every sample of the complete shards, from the manifests alone (no tensor is read)."""
    refs = []
    for path in shards.complete_shards(directory):
        manifest = shards.read_manifest(path)
        refs += [SampleRef(path, sid, n) for sid, n in zip(manifest["sample_ids"], manifest["num_tokens"], strict=True)]
    return refs


def split_refs(refs: list[SampleRef], val_fraction: float, seed: int) -> tuple[list[SampleRef], list[SampleRef]]:
    """A seeded split by sample id: the same ids land in val whatever the shard layout."""
    ids = sorted({r.sample_id for r in refs})
    random.Random(seed).shuffle(ids)
    n_val = max(1, round(len(ids) * val_fraction)) if len(ids) > 1 else 0
    val_ids = set(ids[:n_val])
    return [r for r in refs if r.sample_id not in val_ids], [r for r in refs if r.sample_id in val_ids]


class ShardDataset(BaseDataset):
    def __init__(self, refs: list[SampleRef], max_len: int, hidden_states_dtype: torch.dtype = torch.float32):
        self.refs = refs
        super().__init__(max_len, hidden_states_dtype)  # calls _compute_approx_lengths

    def __len__(self) -> int:
        return len(self.refs)

    def _compute_approx_lengths(self) -> list[int]:
        return [r.num_tokens for r in self.refs]

    def _get_raw_data(self, index: int) -> dict[str, torch.Tensor]:
        ref = self.refs[index]
        # the format's reader: fp8 shards (format version 2) are read as they are and dequantized here, per sample
        sample = shards.load_sample(ref.shard, ref.sample_id)
        hs, input_ids, loss_mask = sample.hidden_states.to(self.hidden_states_dtype), sample.input_ids, sample.loss_mask
        return {
            "hidden_states": hs[:, :-1].flatten(1),
            "verifier_last_hidden_states": hs[:, -1],
            "input_ids": input_ids.long(),
            "loss_mask": loss_mask.bool(),
        }


def train_val_datasets(directory: Path, max_len: int, val_fraction: float, seed: int,
                       dtype: torch.dtype) -> dict[Literal["train", "val"], ShardDataset]:
    train, val = split_refs(index_shards(directory), val_fraction, seed)
    return {"train": ShardDataset(train, max_len, dtype), "val": ShardDataset(val, max_len, dtype)}
