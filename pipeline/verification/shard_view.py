"""A memory-mapped safetensors shard as numpy views, and the rows verify reads out of it."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from pipeline.hidden_states import fp8
from pipeline.hidden_states.format import SAFETENSORS_DTYPES, logical_header
from pipeline.verification.host_staging import StagingBuffer

# numpy views of safetensors dtypes (bf16 as its int16 bit pattern; pipeline/hidden_states/stats.py; fp8 as its bytes)
_NUMPY_VIEW = {"BF16": np.int16, "F16": np.float16, "F32": np.float32, "I64": np.int64, "U8": np.uint8, "F8_E4M3": np.uint8}


def map_shard(path, header: dict, data_start: int, read_whole: bool) -> ShardView:
    """`path` memory-mapped (pages are read only where a view is used; a plain ndarray of the map: slices of an
    np.memmap are np.memmap objects, each made through Python-level hooks). A shard not `read_whole` is mapped without
    read-ahead: the per-sample tests read every stride-th row, asked for ahead (`ShardView.prefetch`)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if not read_whole:
        mapped.madvise(mmap.MADV_RANDOM)
    return ShardView(np.frombuffer(mapped, dtype=np.uint8), header, data_start, mapped)


class ShardView:
    """Tensors of a memory-mapped safetensors file as numpy views (nothing read until indexed).

    `header` is taken as `format.logical_header` presents it: an fp8 sample's states (format version 2) are one
    entry "{sid}/hidden_states" whose values (`numpy`, `rows`, `tensor`) are dequantized to float32 as they are
    read (on the host, a sample or a block of rows at a time); `raw` is the stored bytes.
    """

    def __init__(self, data: np.ndarray, header: dict, data_start: int, mapped: mmap.mmap | None = None) -> None:
        self.data, self.header, self.data_start = data, logical_header(header), data_start
        self.mapped = mapped  # the memory map `data` views, where `prefetch` may advise it

    def prefetch(self, name: str, rows: np.ndarray) -> None:
        """Start reading rows `rows` (sorted) of `name` from the disk now, and only them (MADV_WILLNEED per run of
        pages): on a map opened without read-ahead (MADV_RANDOM) the per-sample tests' scattered rows are then read
        in parallel ahead of their gather, instead of each page fault reading its neighbours' rows too. A shard the
        extractor wrote with direct I/O is not in the page cache: read whole, the 8B shape's 34.4 GB took the scan
        17.3 s, 0.66 of the extraction's data time (H100, docs/BENCHMARKS.md "Verify's cost")."""
        entry = self.header[name]
        if self.mapped is None or "scale" in entry or not len(rows):
            return
        shape = entry["shape"]
        row_bytes = int(np.prod(shape[1:])) * np.dtype(_NUMPY_VIEW[entry["dtype"]]).itemsize
        starts = self.data_start + entry["data_offsets"][0] + rows.astype(np.int64) * row_bytes
        first, last = starts // mmap.PAGESIZE, (starts + row_bytes - 1) // mmap.PAGESIZE  # pages of each row
        new_run = np.flatnonzero(first[1:] > last[:-1] + 1) + 1  # rows whose pages do not touch the previous row's
        for a, b in zip(np.concatenate([[0], new_run]), np.concatenate([new_run, [len(rows)]]), strict=True):
            self.mapped.madvise(mmap.MADV_WILLNEED, int(first[a]) * mmap.PAGESIZE,
                                int(last[b - 1] - first[a] + 1) * mmap.PAGESIZE)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def stored_dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.header[name]["dtype"]]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of the values `numpy` gives: float32 for fp8 states, else as stored."""
        return torch.float32 if "scale" in self.header[name] else self.stored_dtype(name)

    def kind(self, name: str) -> str:
        """The safetensors dtype name of the values `numpy` gives ("F32" for fp8 states)."""
        return "F32" if "scale" in self.header[name] else self.header[name]["dtype"]

    def _entry_view(self, entry: dict) -> np.ndarray:
        begin, end = entry["data_offsets"]
        raw = self.data[self.data_start + begin : self.data_start + end]
        return raw.view(_NUMPY_VIEW[entry["dtype"]]).reshape(entry["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes' numpy view (fp8 as uint8)."""
        return self._entry_view(self.header[name])

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of the values: a view as stored, or for fp8 states their dequantized float32 copy."""
        entry = self.header[name]
        if "scale" not in entry:
            return self._entry_view(entry)[lo:hi]
        q = torch.from_numpy(np.ascontiguousarray(self._entry_view(entry)[lo:hi])).view(fp8.TORCH_DTYPE)
        scale = torch.from_numpy(np.ascontiguousarray(self._entry_view(entry["scale"])[lo:hi]))
        return fp8.dequantize(q, scale).numpy()

    def numpy(self, name: str) -> np.ndarray:
        """The values: a view of the memory map, or for fp8 states the whole sample dequantized (a float32 copy)."""
        return self.raw(name) if "scale" not in self.header[name] else self.rows(name, 0, self.header[name]["shape"][0])

    def scale(self, name: str) -> torch.Tensor | None:
        """fp8 states' [T, L] scales (a copy), else None."""
        entry = self.header[name]
        return torch.from_numpy(np.array(self._entry_view(entry["scale"]))) if "scale" in entry else None

    def tensor(self, name: str, rows=None) -> torch.Tensor:
        """A copy as a torch tensor (`rows`: only those indices of the first dimension)."""
        view = self.numpy(name)
        out = torch.from_numpy(np.array(view if rows is None else view[rows]))
        return out.view(torch.bfloat16) if self.kind(name) == "BF16" else out


def read_final_rows(shard: ShardView, chosen: list, layer: int, hidden: int, staging: StagingBuffer | None = None) -> torch.Tensor:
    """The final layer's rows at the chosen positions of each sample, [P, H], read straight from the
    memory map into `staging` (the scan's, page-locked when lm_head runs on a GPU: its copy up is then
    direct) or, without one, a new tensor."""
    total = sum(len(positions) for _, positions, _ in chosen)
    dtype = shard.dtype(chosen[0][0])
    out = staging.view((total, hidden), dtype) if staging is not None else torch.empty((total, hidden), dtype=dtype)
    out_np = (out.view(torch.int16) if dtype == torch.bfloat16 else out).numpy()
    start = 0
    for name, positions, _ in chosen:
        rows, idx = shard.numpy(name)[:, layer], np.asarray(positions)
        # masked positions come in spans (assistant turns): a span is one strided slice copy, much
        # faster than a gather; sampled positions (mostly isolated) are gathered
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        if len(breaks) < len(idx) // 8:
            for span in np.split(idx, breaks):
                out_np[start : start + len(span)] = rows[span[0] : span[-1] + 1]
                start += len(span)
        else:
            out_np[start : start + len(idx)] = rows[idx]
            start += len(idx)
    return out
