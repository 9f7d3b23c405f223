"""The host buffers verify's scan threads stage rows in before they go up to a GPU, made once before the scan.

A scan thread holds one buffer for a whole shard: a coherence batch's judged rows and indices, then the final-state
pass's final-layer rows, one after the other (each step ends with a host copy that waits for its uploads, so the
buffer is free again when the next step fills it). On a GPU the buffers are page-locked, so uploads run at the bus's
speed without synchronising the stream. Page-locking is slow and, while it runs, it holds up the other threads' page
faults and CUDA calls: grown as the threads went, a cold process's first scan of the 8B shape took 7.10 s against
2.39 s warm on an H200 (staging 28.9 against 4.0 thread-seconds; 2026-12-04, code 5693c8d, 16 scan threads:
`git show 61b87c6:docs/BENCHMARKS.md`). Made here, it is paid once, before the threads start, at a size known up
front. On a CPU the buffers are ordinary memory (nothing goes up).
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StagingBuffer:
    """One thread's buffers: `rows` for hidden-state rows, `indices` for the int64 indices that go up with them."""

    rows: torch.Tensor  # uint8
    indices: torch.Tensor  # int64

    def view(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The first bytes of `rows` as a [shape] tensor of `dtype`."""
        size = int(np.prod(shape)) * dtype.itemsize
        if size > self.rows.numel():
            raise ValueError(f"{list(shape)} {dtype} needs {size} bytes; the staging buffer holds {self.rows.numel()}")
        return self.rows[:size].view(dtype).view(shape)

    def index_view(self, count: int) -> torch.Tensor:
        if count > self.indices.numel():
            raise ValueError(f"{count} indices; the staging buffer holds {self.indices.numel()}")
        return self.indices[:count]


class HostStaging:
    """`count` staging buffers of `row_bytes` + `index_count` int64 each, page-locked when `pinned`."""

    def __init__(self, count: int, row_bytes: int, index_count: int, pinned: bool) -> None:
        self.count, self.row_bytes, self.index_count, self.pinned = count, row_bytes, index_count, pinned
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(new_buffer(row_bytes, index_count, pinned))

    @property
    def nbytes(self) -> int:
        return self.count * (self.row_bytes + 8 * self.index_count)

    @contextlib.contextmanager
    def buffer(self) -> Iterator[StagingBuffer]:
        """A free buffer, for as long as the caller holds it (one per thread: `count` is the scan's threads)."""
        taken = self._free.get()
        try:
            yield taken
        finally:
            self._free.put(taken)


def new_buffer(row_bytes: int, index_count: int, pinned: bool) -> StagingBuffer:
    """One buffer: the pool's, or one for a single call outside the scan (`Coherence.score`, the benches)."""
    return StagingBuffer(torch.empty(row_bytes, dtype=torch.uint8, pin_memory=pinned),
                         torch.empty(index_count, dtype=torch.int64, pin_memory=pinned))
