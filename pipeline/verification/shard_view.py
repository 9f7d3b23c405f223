"""A memory-mapped safetensors shard as numpy views, and the rows verify reads out of it."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.hidden_states.format import SAFETENSORS_DTYPES
from pipeline.verification.host_staging import StagingBuffer

# numpy views of safetensors dtypes (bf16 as its int16 bit pattern; pipeline/hidden_states/stats.py)
_NUMPY_VIEW = {"BF16": np.int16, "F16": np.float16, "F32": np.float32, "I64": np.int64, "U8": np.uint8}


class ShardView:
    """Tensors of a memory-mapped safetensors file as numpy views (nothing read until indexed)."""

    def __init__(self, data: np.ndarray, header: dict, data_start: int) -> None:
        self.data, self.header, self.data_start = data, header, data_start

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.header[name]["dtype"]]

    def numpy(self, name: str) -> np.ndarray:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        raw = self.data[self.data_start + begin : self.data_start + end]
        return raw.view(_NUMPY_VIEW[entry["dtype"]]).reshape(entry["shape"])

    def tensor(self, name: str, rows=None) -> torch.Tensor:
        """A copy as a torch tensor (`rows`: only those indices of the first dimension)."""
        view = self.numpy(name)
        out = torch.from_numpy(np.array(view if rows is None else view[rows]))
        return out.view(torch.bfloat16) if self.header[name]["dtype"] == "BF16" else out


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
