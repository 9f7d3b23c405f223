"""A file's bytes written at the disk's rate from one thread: direct I/O through page-aligned staging buffers.

One thread writing through the page cache can stay far below what the disk takes: on the 2-core CPU machine it
wrote 0.23 of the disk's best where the same thread with direct I/O wrote 0.71; on the lent GPU hosts both reach
one thread's SHA-256 of the shard, which then bounds it (docs/BENCHMARKS.md, "Shard writing against the disk").
One thread's rate is that of a run's last shards, each written by one thread after the engine has finished.

O_DIRECT needs the memory, the file offset and the length aligned, and a shard's tensors lie back to back at any
offset, so the bytes are copied (at memory speed, several times the disk's) into aligned buffers while a second
thread writes the filled ones. The last buffer is padded to the alignment and the file cut back to its length.
Where the filesystem refuses O_DIRECT (some network and FUSE filesystems) the same bytes go through the page
cache, each block's write-back started as soon as it is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT's alignment of memory, offset and length: any logical block size up to 4 KiB
STAGING_BYTES = 32 << 20
STAGING_BUFFERS = 3  # one being filled, one being written, one spare so the copy never waits on a short write


def write_file(path: Path, chunks: list[torch.Tensor], direct: bool = True) -> int:
    """Write the uint8 tensors `chunks`, back to back, to `path` (created or truncated); return its size.
    The caller fsyncs (pipeline/atomic.py)."""
    if direct:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                return _write_direct(fd, chunks)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        return _write_buffered(fd, chunks)
    finally:
        os.close(fd)


def _write_direct(fd: int, chunks: list[torch.Tensor]) -> int:
    total = sum(c.numel() for c in chunks)
    size = min(STAGING_BYTES, _aligned(total)) or ALIGN
    maps = [mmap.mmap(-1, size) for _ in range(STAGING_BUFFERS)]  # anonymous maps are page-aligned
    staging = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    writes: list[Future | None] = [None] * STAGING_BUFFERS
    current, fill, offset = 0, 0, 0
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="direct-write") as writer:

            def submit(nbytes: int) -> None:
                nonlocal current, fill, offset
                writes[current] = writer.submit(_pwrite_all, fd, memoryview(maps[current])[:nbytes], offset)
                offset += nbytes
                current, fill = (current + 1) % STAGING_BUFFERS, 0
                if writes[current] is not None:  # the next buffer is free once its write is done
                    writes[current].result()

            for chunk in chunks:
                pos, length = 0, chunk.numel()
                while pos < length:
                    n = min(length - pos, size - fill)
                    staging[current][fill : fill + n].copy_(chunk[pos : pos + n])  # torch copies without the GIL
                    fill, pos = fill + n, pos + n
                    if fill == size:
                        submit(size)
            if fill:
                padded = _aligned(fill)
                staging[current][fill:padded].zero_()
                submit(padded)
            for w in writes:
                if w is not None:
                    w.result()
    finally:
        del staging  # the maps' buffers are exported to these tensors until they go
        for m in maps:
            with contextlib.suppress(BufferError):  # still exported (a traceback's frame): freed with it
                m.close()
    if offset != total:
        os.ftruncate(fd, total)  # the last buffer's padding
    return total


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # a write may take less than it was given
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as e:
            # a filesystem that opens with O_DIRECT but refuses such writes: through the page cache instead
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if e.errno != errno.EINVAL or not flags & os.O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            continue
        data, offset = data[n:], offset + n


def _write_buffered(fd: int, chunks: list[torch.Tensor]) -> int:
    offset = 0
    for chunk in chunks:
        for lo in range(0, chunk.numel(), STAGING_BYTES):
            block = memoryview(chunk[lo : lo + STAGING_BYTES].numpy())
            _pwrite_all(fd, block, offset)
            # start this block's write-back now, so the caller's fsync waits for the last blocks only
            os.posix_fadvise(fd, offset, len(block), os.POSIX_FADV_DONTNEED)
            offset += len(block)
    return offset


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
