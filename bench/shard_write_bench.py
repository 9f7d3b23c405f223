"""Shard writing against the disk's own rate, on the disk the shards go to.

    python bench/shard_write_bench.py --dir artifacts/write-bench            # the seed's width
    python bench/shard_write_bench.py --dir /tmp/wb --hidden 256 --samples-per-shard 8 --shards 2

First the disk: large fsync'd blocks from one writer, from several writers in parallel (one file
each) and from one O_DIRECT writer; the fastest is the limit. Then the same synthetic shards
(`--samples-per-shard` x `--seq-len` tokens of `--layers` x `--hidden` bf16 states, 1.41 GB at the
defaults: Kimi-K2.5's width, 4 layers, 48 x 512 tokens) written by the extract stage's writer
(`pipeline.hidden_states.format.write_shard`) from one thread and from as many threads as the
stage runs on this host (`pipeline.extraction.engine.shard_workers`), each shard durable (fsync'd
and renamed) before it counts. `--compare-save-file` adds the same through safetensors' save_file
followed by a SHA-256 read back from the file, the writer the stage had before it wrote from the
tensors' own memory. `write_shard` is measured as it writes (direct I/O where the filesystem
allows it) and through the page cache (as where it does not), beside one thread's SHA-256 of the
same bytes from memory, which bounds one thread's `write_shard`. Imports only torch, numpy and
safetensors beside the project's shard writer, so it runs on a host without vLLM. Prints one JSON line per measurement, then a summary line with each rate as
a fraction of the disk's best.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import mmap
import os
import shutil
import time
import unittest.mock
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pipeline.atomic import atomic_path
from pipeline.hidden_states import disk_write
from pipeline.hidden_states import format as shards
from pipeline.hidden_states import stats as shard_stats

BLOCK = 64 << 20
WRITE_FILE = disk_write.write_file


def emit(record: dict) -> dict:
    print(json.dumps(record), flush=True)
    return record


def write_blocks(path: Path, nbytes: int, buf: memoryview, direct: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(len(buf), left)])
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_rates(folder: Path, nbytes: int, parallel: list[int]) -> list[dict]:
    """GB/s of large fsync'd blocks: one writer, `parallel` writers, one O_DIRECT writer."""
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    view = memoryview(buf)
    out = []
    for writers, direct in [(1, False), *[(n, False) for n in parallel], (1, True)]:
        folder.mkdir(parents=True, exist_ok=True)
        each = nbytes // writers // BLOCK * BLOCK
        t0 = time.perf_counter()
        paths = [folder / f"disk-{i}" for i in range(writers)]
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(write_blocks, paths, [each] * writers, [view] * writers, [direct] * writers))
        seconds = time.perf_counter() - t0
        out.append(emit({"what": "disk", "writers": writers, "o_direct": direct, "bytes": each * writers,
                         "seconds": round(seconds, 3), "gb_per_s": round(each * writers / seconds / 1e9, 3)}))
        shutil.rmtree(folder)
    return out


def save_file_then_hash(directory: Path, index: int, samples: list[shards.Sample]) -> None:
    """safetensors' save_file, then the file read back for its SHA-256."""
    from safetensors.torch import save_file

    tensors = {}
    for s in samples:
        tensors[f"{s.sample_id}/hidden_states"] = s.hidden_states
        tensors[f"{s.sample_id}/input_ids"] = s.input_ids
        tensors[f"{s.sample_id}/loss_mask"] = s.loss_mask
    path = directory / shards.shard_name(index)
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"format": shards.FORMAT_NAME, "shard_index": str(index)})
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)


def through_the_page_cache(directory: Path, index: int, samples: list[shards.Sample]) -> None:
    """`write_shard` as on a filesystem that refuses O_DIRECT."""
    with unittest.mock.patch.object(disk_write, "write_file", functools.partial(WRITE_FILE, direct=False)):
        shards.write_shard(directory, index, samples, {})


def sha256_rate(samples: list[shards.Sample]) -> dict:
    """One thread hashing a shard's states from memory: what bounds one thread's `write_shard` from above."""
    chunks = [s.hidden_states.reshape(-1).view(torch.uint8) for s in samples]
    nbytes = sum(c.numel() for c in chunks)
    t0 = time.perf_counter()
    shards._sha256(chunks)
    seconds = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": round(seconds, 3), "gb_per_s": round(nbytes / seconds / 1e9, 3)}


def shard_rates(folder: Path, samples: list[shards.Sample], count: int, threads: int, writer) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = sum(s.hidden_states.numel() * 2 + s.input_ids.numel() * 9 for s in samples)

    def one(k: int) -> None:
        renamed = [shards.Sample(k * len(samples) + i, s.input_ids, s.loss_mask, s.hidden_states, s.stats)
                   for i, s in enumerate(samples)]
        writer(folder, k, renamed)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder)
    return {"bytes": per_shard * count, "seconds": round(seconds, 3), "gb_per_s": round(per_shard * count / seconds / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="a folder on the disk the shards go to (created, then removed)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--samples-per-shard", type=int, default=48)
    ap.add_argument("--shards", type=int, default=0, help="shards per measurement with the stage's threads (default: one per thread; 4 from one thread)")
    ap.add_argument("--disk-gb", type=float, default=16.0, help="bytes each disk measurement writes")
    ap.add_argument("--parallel", default="4,8", help="writer counts of the parallel disk measurements")
    ap.add_argument("--threads", type=int, default=min(32, os.cpu_count() or 1),
                    help="shard threads (default: the extract stage's, one per core up to 32)")
    ap.add_argument("--compare-save-file", action="store_true")
    ap.add_argument("--json", type=Path, help="also write every measurement here (the GPU bench's fp8 job reads it)")
    a = ap.parse_args()

    threads = a.threads
    count = a.shards or threads
    disk = disk_rates(a.dir / "disk", int(a.disk_gb * 1e9), [int(n) for n in a.parallel.split(",") if n])
    best = max(r["gb_per_s"] for r in disk)

    torch.manual_seed(0)
    states = torch.randn(a.seq_len, a.layers, a.hidden, dtype=torch.bfloat16)
    stats = shard_stats.sample_stats(states)
    ids = torch.arange(a.seq_len, dtype=torch.int64)
    mask = torch.ones(a.seq_len, dtype=torch.uint8)
    # one tensor per sample, as vLLM's files hand them over
    samples = [shards.Sample(i, ids.clone(), mask.clone(), states.clone(), stats) for i in range(a.samples_per_shard)]

    writers = {"write_shard": lambda d, k, s: shards.write_shard(d, k, s, {}),
               "write_shard through the page cache": through_the_page_cache}
    if a.compare_save_file:
        writers["save_file + read-back hash"] = save_file_then_hash
    hashing = sha256_rate(samples)
    rows = [emit({"what": "sha256 from memory", "threads": 1, **hashing,
                  "of_disk_best": round(hashing["gb_per_s"] / best, 3)})]
    for name, writer in writers.items():
        for n in sorted({1, threads}):
            r = shard_rates(a.dir / "shards", samples, count if n > 1 else 4, n, writer)
            rows.append(emit({"what": name, "threads": n, **r, "of_disk_best": round(r["gb_per_s"] / best, 3)}))
    summary = emit({"summary": True, "disk_best_gb_per_s": best, "shard_bytes": rows[-1]["bytes"] // count,
                    **{f"{r['what']} x{r['threads']}": r["of_disk_best"] for r in rows}})
    if a.json:
        a.json.write_text(json.dumps({**summary, "disk": disk, "writers": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
