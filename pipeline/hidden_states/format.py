"""The hidden-states shard format (docs/FORMAT.md): write atomically, read lazily, never unpickle.

A shard is one safetensors file holding `samples_per_shard` samples, each as three tensors

    "{sample_id}/hidden_states"  [T, L, H]  extract dtype   (L = len(layer_ids), H = hidden size)
    "{sample_id}/input_ids"      [T]        int64
    "{sample_id}/loss_mask"      [T]        uint8 (0/1)

plus a JSON manifest beside it (`shard-NNNNN.json`) that is written *after* the data file, so a
manifest on disk means its shard is complete. The manifest records each sample's per-layer
statistics (pipeline/hidden_states/stats.py), computed from the tensors as they are written. The
run-level `extract_meta.json` records what the shards are of (model, data, layer ids and their
convention) so stale shards are never mixed into a resumed run.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.atomic import atomic_path, atomic_write_text
from pipeline.hidden_states import stats as shard_stats
from pipeline.target import sha256_file

FORMAT_NAME = "eagle3-pipeline/hidden-states"
FORMAT_VERSION = 1
LAYER_ID_CONVENTION = (
    "vllm: id k = hidden state entering decoder layer k (0 = embeddings output); "
    "id N = last decoder layer's output BEFORE the final norm"
)
META_FILE = "extract_meta.json"


@dataclass
class Sample:
    sample_id: int
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] 0/1
    hidden_states: torch.Tensor  # [T, L, H]
    stats: np.ndarray | None = None  # [L, 4] shard_stats.FIELDS; computed on write when None


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def manifest_path(shard_path: Path) -> Path:
    return shard_path.with_suffix(".json")


def write_shard(directory: Path, index: int, samples: list[Sample], manifest_extra: dict) -> dict:
    """Write one shard and then its manifest, each atomically; return the manifest."""
    path = Path(directory) / shard_name(index)
    tensors: dict[str, torch.Tensor] = {}
    for s in samples:
        tensors[f"{s.sample_id}/hidden_states"] = s.hidden_states.contiguous()
        tensors[f"{s.sample_id}/input_ids"] = s.input_ids.to(torch.int64).contiguous()
        tensors[f"{s.sample_id}/loss_mask"] = s.loss_mask.to(torch.uint8).contiguous()
    header = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "shard_index": str(index)}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=header)
        canonical_header(tmp)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "shard_index": index,
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "sample_ids": [s.sample_id for s in samples],
        "num_tokens": [int(s.input_ids.numel()) for s in samples],
        # recorded from the tensors just written: verify judges these and re-derives them from
        # the bytes on an audit sample (docs/FORMAT.md, "Recorded statistics")
        "layer_stats": {
            "fields": list(shard_stats.FIELDS),
            "samples": {
                str(s.sample_id): shard_stats.to_record(s.stats if s.stats is not None else shard_stats.sample_stats(s.hidden_states))
                for s in samples
            },
        },
        **manifest_extra,
    }
    atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def canonical_header(path: Path) -> None:
    """Sort the safetensors header's `__metadata__` keys, in place.

    safetensors writes `__metadata__` from a Rust HashMap, whose key order is random per process:
    the same shard written by two processes (a re-run, another Ray replica) had different bytes and
    hashes. Rewritten sorted, same length (compact JSON, as safetensors writes it; padded with
    spaces, which the format allows), the same samples give the same file.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        if "__metadata__" not in header:
            return
        meta = dict(sorted(header.pop("__metadata__").items()))
        new = json.dumps({"__metadata__": meta, **header}, separators=(",", ":"), ensure_ascii=False).encode()
        if len(new) > n:
            raise RuntimeError(f"{path}: canonical safetensors header is {len(new)} bytes, more than the {n} written")
        f.seek(8)
        f.write(new.ljust(n, b" "))


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "U8": torch.uint8}


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data
    starts; raises ValueError when the header itself is unreadable or points past the file."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{size} bytes: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"header length {n} is past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"header is not JSON: {e}") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if data_start + end > size:
            raise ValueError(f"tensor {name!r} ends at byte {data_start + end}, past the end of the {size}-byte file")
    return header, data_start


def read_manifest(shard_path: Path) -> dict:
    return json.loads(manifest_path(shard_path).read_text())


def complete_shards(directory: Path) -> list[Path]:
    """Shards whose manifest exists (the manifest is written last), in index order."""
    directory = Path(directory)
    return sorted(p for p in directory.glob("shard-*.safetensors") if manifest_path(p).is_file())


def load_sample(shard_path: Path, sample_id: int, device: str = "cpu") -> Sample:
    with safe_open(str(shard_path), framework="pt", device=device) as f:
        return Sample(
            sample_id=sample_id,
            input_ids=f.get_tensor(f"{sample_id}/input_ids"),
            loss_mask=f.get_tensor(f"{sample_id}/loss_mask"),
            hidden_states=f.get_tensor(f"{sample_id}/hidden_states"),
        )


def iter_samples(shard_path: Path) -> Iterator[Sample]:
    for sid in read_manifest(shard_path)["sample_ids"]:
        yield load_sample(shard_path, sid)


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the extract stage first")
    return json.loads(path.read_text())


def write_meta(directory: Path, meta: dict) -> None:
    atomic_write_text(Path(directory) / META_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
