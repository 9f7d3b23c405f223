"""The host's memory bandwidth as verify's scan uses it, from 1 to N threads at once: row gathers from a memory map
(`torch.index_select` of 32 KB rows, every 4th position: the scan's staging), plain copies (numpy, the GIL let go) and
sha256 of a file (the audit). Session 21 found every host-side part of the 8B scan slower together in the slower of
identical cold processes (correlation 0.86-0.93 across 17 runs; docs/BENCHMARKS.md "Verify's scan, session 21"): a
resource they share, host memory bandwidth the suspect. This measures what the host gives, with nothing else running.

    python bench/host_memory_bandwidth.py --work /dev/shm/hostbw --gib 4 --threads 1,4,8,16

Prints one JSON line per (operation, threads): GB/s of bytes read. The file is removed after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def timed_parallel(threads: int, work) -> float:
    """Seconds for `threads` threads each running work(i) once, started together."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        t = time.perf_counter()
        list(pool.map(work, range(threads)))
        return time.perf_counter() - t


def measure(mapped: torch.Tensor, threads: int, stride: int) -> None:
    """One JSON line per operation at `threads` threads, each on its own slice of the file (as the scan's threads have
    their own shards); torch's intra-op threads shared among them, as the scan sets them."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // threads))
    rows, row_bytes = mapped.shape
    share = rows // threads
    gathered = [torch.empty(((share + stride - 1) // stride, row_bytes), dtype=torch.uint8) for _ in range(threads)]
    copied = [np.empty((share, row_bytes), np.uint8) for _ in range(threads)]

    def gather(i: int) -> None:
        index = torch.arange(i * share, (i + 1) * share, stride)
        torch.index_select(mapped, 0, index, out=gathered[i][: len(index)])

    def copy(i: int) -> None:
        np.copyto(copied[i], mapped.numpy()[i * share : (i + 1) * share])

    def digest(i: int) -> None:
        hashlib.sha256(memoryview(mapped.numpy()[i * share : (i + 1) * share]).cast("B")).hexdigest()

    for name, work, read in (("gather", gather, threads * len(range(0, share, stride)) * row_bytes),
                             ("copy", copy, threads * share * row_bytes),
                             ("sha256", digest, threads * share * row_bytes)):
        timed_parallel(threads, work)  # pages mapped, buffers touched
        seconds = min(timed_parallel(threads, work) for _ in range(3))
        print(json.dumps({"op": name, "threads": threads, "gb_read": round(read / 1e9, 3),
                          "seconds": round(seconds, 4), "gb_s": round(read / 1e9 / seconds, 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="a directory for the test file (e.g. on /dev/shm)")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the test file")
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--row-bytes", type=int, default=32768, help="one position's rows of every captured layer (4 x 4096 x bf16)")
    ap.add_argument("--stride", type=int, default=4, help="every stride-th row gathered (verify.sample_stride)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    path = a.work / "bandwidth.bin"
    rows = int(a.gib * 2**30) // a.row_bytes
    try:
        with open(path, "wb") as f:  # random bytes, written in 256 MiB pieces
            rng = np.random.default_rng(0)
            per = max(1, (256 << 20) // a.row_bytes)
            for r0 in range(0, rows, per):
                f.write(rng.integers(0, 255, size=(min(per, rows - r0), a.row_bytes), dtype=np.uint8).tobytes())
        with warnings.catch_warnings():  # read-only map; nothing writes through the tensor
            warnings.simplefilter("ignore", UserWarning)
            mapped = torch.from_numpy(np.asarray(np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, a.row_bytes))))
        for threads in map(int, a.threads.split(",")):
            measure(mapped, threads, a.stride)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
