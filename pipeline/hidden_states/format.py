"""The hidden-states shard format (docs/FORMAT.md): write atomically, read lazily, never unpickle.

A shard is one safetensors file holding `samples_per_shard` samples, each as three tensors

    "{sample_id}/hidden_states"  [T, L, H]  extract dtype   (L = len(layer_ids), H = hidden size)
    "{sample_id}/input_ids"      [T]        int64
    "{sample_id}/loss_mask"      [T]        uint8 (0/1)

(format version 1: float32, bfloat16, float16), or, with extract.dtype float8_e4m3 (format version 2), the
states as two tensors in place of the first (pipeline/hidden_states/fp8.py):

    "{sample_id}/hidden_states_fp8"    [T, L, H]  float8_e4m3fn
    "{sample_id}/hidden_states_scale"  [T, L]     float32 (per token and layer)

under other names than version 1's, so that a reader of version 1 asking for "{sample_id}/hidden_states" fails
on the missing tensor rather than reading unscaled fp8 values. `logical_header`, `load_sample` and
`iter_samples` present both versions as "{sample_id}/hidden_states" (dequantized to float32 for version 2).

plus a JSON manifest beside it (`shard-NNNNN.json`) that is written *after* the data file, so a
manifest on disk means its shard is complete. The manifest records each sample's per-layer
statistics (pipeline/hidden_states/stats.py), computed from the tensors as they are written. The
run-level `extract_meta.json` records what the shards are of (model, data, layer ids and their
convention) so stale shards are never mixed into a resumed run.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from pipeline.atomic import atomic_path, atomic_write_text
from pipeline.errors import PipelineError
from pipeline.hidden_states import disk_write, fp8
from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.storage import engine_dtype, format_version  # noqa: F401 (the format's API)

FORMAT_NAME = "eagle3-pipeline/hidden-states"
FORMAT_VERSION = 2  # the newest this code writes and reads; version 1 (no fp8) is read too and still written
FP8_FORMAT_VERSION = format_version(fp8.STORAGE_DTYPE)
FP8_SUFFIX, SCALE_SUFFIX = "/" + fp8.STATES_KEY, "/" + fp8.SCALE_KEY
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
    hidden_states: torch.Tensor  # [T, L, H]; float8_e4m3fn with `scale` (format version 2)
    stats: np.ndarray | None = None  # [L, 4] shard_stats.FIELDS (of the dequantized values); computed on write when None
    scale: torch.Tensor | None = None  # [T, L] float32, with fp8 hidden states only


def stored(sample: Sample, dtype: str) -> Sample:
    """The sample as it is written for extract.dtype `dtype`: fp8 quantized (statistics of the dequantized values,
    computed here when the sample has none), anything else as it is."""
    if dtype != fp8.STORAGE_DTYPE or sample.hidden_states.dtype == fp8.TORCH_DTYPE:
        return sample
    q, scale = fp8.quantize(sample.hidden_states)
    stats = sample.stats if sample.stats is not None else shard_stats.sample_stats(fp8.dequantize(q, scale).cpu())
    return Sample(sample.sample_id, sample.input_ids, sample.loss_mask, q, stats, scale)


def check_version(version, where) -> None:
    """Refuse a shard (or run) of a format version this code does not know."""
    if version is None or int(version) > FORMAT_VERSION or int(version) < 1:
        raise PipelineError(
            f"{where}: hidden-states format version {version!r}; this eagle3-pipeline reads versions 1 to "
            f"{FORMAT_VERSION}: use the eagle3-pipeline that wrote it (a newer one), or re-run extract with this one"
        )


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def manifest_path(shard_path: Path) -> Path:
    return shard_path.with_suffix(".json")


def write_shard(directory: Path, index: int, samples: list[Sample], manifest_extra: dict) -> dict:
    """Write one shard and then its manifest, each atomically; return the manifest.

    The shard's size and SHA-256 come from the bytes as they are written (`write_safetensors`):
    nothing is read back.
    """
    path = Path(directory) / shard_name(index)
    tensors: dict[str, torch.Tensor] = {}
    version = 1
    for s in samples:
        if s.hidden_states.dtype == fp8.TORCH_DTYPE:
            if s.scale is None or tuple(s.scale.shape) != tuple(s.hidden_states.shape[:2]) or s.scale.dtype != torch.float32:
                raise ValueError(f"sample {s.sample_id}: fp8 hidden states need a [T, L] float32 scale")
            tensors[f"{s.sample_id}{FP8_SUFFIX}"] = s.hidden_states.contiguous()
            tensors[f"{s.sample_id}{SCALE_SUFFIX}"] = s.scale.contiguous()
            version = FP8_FORMAT_VERSION
        else:
            tensors[f"{s.sample_id}/hidden_states"] = s.hidden_states.contiguous()
        tensors[f"{s.sample_id}/input_ids"] = s.input_ids.to(torch.int64).contiguous()
        tensors[f"{s.sample_id}/loss_mask"] = s.loss_mask.to(torch.uint8).contiguous()
    header = {"format": FORMAT_NAME, "format_version": str(version), "shard_index": str(index)}
    with atomic_path(path) as tmp:
        size, sha256 = write_safetensors(tmp, tensors, header)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": version,
        "shard_index": index,
        "file": path.name,
        "bytes": size,
        "sha256": sha256,
        "sample_ids": [s.sample_id for s in samples],
        "num_tokens": [int(s.input_ids.numel()) for s in samples],
        # recorded from the tensors just written: verify judges these and re-derives them from
        # the bytes on an audit sample (docs/FORMAT.md, "Recorded statistics")
        "layer_stats": {
            "fields": list(shard_stats.FIELDS),
            "samples": {
                str(s.sample_id): shard_stats.to_record(s.stats if s.stats is not None else _stats(s))
                for s in samples
            },
        },
        **manifest_extra,
    }
    atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _stats(s: Sample) -> np.ndarray:
    if s.hidden_states.dtype == fp8.TORCH_DTYPE:
        return shard_stats.sample_stats(fp8.dequantize(s.hidden_states, s.scale).cpu())
    return shard_stats.sample_stats(s.hidden_states)


# safetensors' dtype names, in the order its writer lays tensors out (then by name): the order of
# its Rust `Dtype` enum, descending
SAFETENSORS_LAYOUT_ORDER = {
    torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
    torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
HASH_BLOCK = 64 << 20


def safetensors_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[torch.Tensor]]:
    """The 8-byte length and JSON header of the safetensors file holding `tensors`, and the
    tensors in the order their bytes follow it.

    The layout is safetensors' own (tensors by dtype, then name; header padded with spaces to 8
    bytes) with `__metadata__`'s keys sorted: safetensors writes those from a Rust HashMap, in a
    per-process random order, so the same samples would give other bytes in another process
    (tests/test_shard_writer.py holds the two layouts equal).
    """
    rank = {dtype: i for i, dtype in enumerate(SAFETENSORS_LAYOUT_ORDER)}
    order = sorted(tensors, key=lambda name: (rank[tensors[name].dtype], name))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_LAYOUT_ORDER[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")
    return struct.pack("<Q", len(text)) + text, [tensors[name] for name in order]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write `tensors` to `path` as safetensors (pipeline/hidden_states/disk_write.py: direct I/O where the
    filesystem allows it); return the file's size and the SHA-256 of the bytes written, hashed from the tensors'
    memory by a second thread while this one writes. The caller fsyncs (`atomic_path`)."""
    head, ordered = safetensors_layout(tensors, metadata)
    chunks = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
    chunks += [t.contiguous().reshape(-1).view(torch.uint8) for t in ordered if t.numel()]
    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        digest = hasher.submit(_sha256, chunks)
        size = disk_write.write_file(path, chunks)
        return size, digest.result()


def _sha256(chunks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        data = memoryview(chunk.numpy())
        for lo in range(0, len(data), HASH_BLOCK):
            h.update(data[lo : lo + HASH_BLOCK])  # hashlib lets go of the GIL for large buffers
    return h.hexdigest()


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "U8": torch.uint8,
                      "F8_E4M3": torch.float8_e4m3fn}


def logical_header(header: dict) -> dict:
    """A shard's header with each fp8 sample's pair of tensors as one entry "{sid}/hidden_states" (dtype F8_E4M3,
    its scale's entry under "scale"): every version's samples under the same names. A scale without its states, or
    states without their scale, stays under its own name (a reader's key check reports it)."""
    out = {}
    for name, entry in header.items():
        if name.endswith(FP8_SUFFIX):
            sid = name[: -len(FP8_SUFFIX)]
            scale = header.get(sid + SCALE_SUFFIX)
            if scale is not None and f"{sid}/hidden_states" not in header:
                out[f"{sid}/hidden_states"] = {**entry, "scale": scale}
                continue
        elif name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] + FP8_SUFFIX in header \
                and name[: -len(SCALE_SUFFIX)] + "/hidden_states" not in header:
            continue
        out[name] = entry
    return out


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
    """A shard's manifest; refused (PipelineError naming it) when its format version is newer than this code's."""
    path = manifest_path(shard_path)
    manifest = json.loads(path.read_text())
    if manifest.get("format") == FORMAT_NAME:
        check_version(manifest.get("format_version"), path)
    return manifest


def complete_shards(directory: Path) -> list[Path]:
    """Shards whose manifest exists (the manifest is written last), in index order."""
    directory = Path(directory)
    return sorted(p for p in directory.glob("shard-*.safetensors") if manifest_path(p).is_file())


def load_sample(shard_path: Path, sample_id: int, device: str = "cpu") -> Sample:
    """One sample; its hidden states as stored (version 1) or dequantized to float32 (version 2, fp8: `scale` is
    then the stored per-token scale). Refuses a shard of a newer format version, naming it."""
    with safe_open(str(shard_path), framework="pt", device=device) as f:
        if (version := (f.metadata() or {}).get("format_version")) is not None:
            check_version(version, shard_path)
        scale = None
        if f"{sample_id}{FP8_SUFFIX}" in f.keys():
            scale = f.get_tensor(f"{sample_id}{SCALE_SUFFIX}")
            hs = fp8.dequantize(f.get_tensor(f"{sample_id}{FP8_SUFFIX}"), scale)
        else:
            hs = f.get_tensor(f"{sample_id}/hidden_states")
        return Sample(
            sample_id=sample_id,
            input_ids=f.get_tensor(f"{sample_id}/input_ids"),
            loss_mask=f.get_tensor(f"{sample_id}/loss_mask"),
            hidden_states=hs,
            scale=scale,
        )


def iter_samples(shard_path: Path) -> Iterator[Sample]:
    for sid in read_manifest(shard_path)["sample_ids"]:
        yield load_sample(shard_path, sid)


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the extract stage first")
    meta = json.loads(path.read_text())
    if meta.get("format") == FORMAT_NAME:
        check_version(meta.get("format_version"), path)
    return meta


def write_meta(directory: Path, meta: dict) -> None:
    atomic_write_text(Path(directory) / META_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
