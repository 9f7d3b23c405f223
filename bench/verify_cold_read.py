"""What verify's scan reads from the disk for the per-sample tests' rows of shards that are not in the page cache.

The extractor writes shards with direct I/O, so right after extraction nothing of them is cached, and the scan reads
what it gathers from the disk. The per-sample tests gather every `stride`-th row (a row: all captured layers of one
position, 32 KiB at the 8B shape) of every sample. This writes bf16 shards of that shape with the project's writer,
drops them from the page cache (posix_fadvise DONTNEED), and gathers the judged rows as the scan does
(`pipeline/verification/samples/scores.py` `Coherence._gather`: torch.index_select from the memory map), in two ways:

  whole     the map as an np.memmap with the kernel's read-ahead (each fault reads the rows around it too)
  prefetch  `shard_view.map_shard` as the scan maps a shard it does not audit: no read-ahead (MADV_RANDOM), each
            sample's judged rows asked for ahead (MADV_WILLNEED, `ShardView.prefetch`)

and prints, per way, the bytes the process read from the disk (/proc/self/io read_bytes), over the shards' bytes, and
the wall time; one thread per shard at a time, `--threads` at once, as the scan's workers.

    .venv/bin/python bench/verify_cold_read.py --dir /tmp/cold-read --gb 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pipeline.hidden_states.format import Sample, complete_shards, read_header, read_manifest, write_shard
from pipeline.verification.samples.positions import judged_positions
from pipeline.verification.shard_view import ShardView, map_shard


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def write_shards(out: Path, gb: float, layers: int, hidden: int, tokens: int, per_shard: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    samples = max(per_shard, int(gb * 1e9 / (tokens * layers * hidden * 2)))
    g = torch.Generator().manual_seed(0)
    for shard in range(-(-samples // per_shard)):
        batch = []
        for sid in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
            states = torch.randn(tokens, layers, hidden, generator=g).to(torch.bfloat16)
            batch.append(Sample(sid, torch.randint(0, 1000, (tokens,), generator=g), torch.ones(tokens, dtype=torch.int64), states))
        write_shard(out, shard, batch, {})


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gather(path: Path, way: str, stride: int) -> int:
    header, data_start = read_header(path)
    if way == "whole":
        shard = ShardView(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")), header, data_start)
    else:
        shard = map_shard(path, header, data_start, read_whole=False)
    rows = 0
    judged = {}
    for sid in read_manifest(path)["sample_ids"]:
        name = f"{sid}/hidden_states"
        judged[name] = judged_positions(shard.shape(name)[0], stride, 0, sid)
        shard.prefetch(name, judged[name])  # a no-op on the np.memmap view (no map to advise)
    with warnings.catch_warnings():  # the map is read-only; nothing writes through the tensor view (as `_gather`)
        warnings.simplefilter("ignore", UserWarning)
        for name, positions in judged.items():
            out = torch.index_select(torch.from_numpy(shard.raw(name)), 0, torch.from_numpy(positions))
            rows += out.shape[0]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--samples-per-shard", type=int, default=16)
    ap.add_argument("--stride", type=int, default=4, help="verify.sample_stride")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the shards")
    args = ap.parse_args()
    t = time.perf_counter()
    write_shards(args.dir, args.gb, args.layers, args.hidden, args.tokens, args.samples_per_shard)
    paths = complete_shards(args.dir)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(paths)} shards, {total / 1e9:.2f} GB (rows of {args.layers * args.hidden * 2} bytes) in "
          f"{time.perf_counter() - t:.1f} s")
    for way in ("whole", "prefetch", "whole", "prefetch"):
        evict(paths)
        before, t = read_bytes(), time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            rows = sum(pool.map(lambda p, w=way: gather(p, w, args.stride), paths))
        wall, read = time.perf_counter() - t, read_bytes() - before
        print(f"{way:9s} {rows} rows gathered: read {read / 1e9:.2f} GB from the disk ({read / total:.3f} of the shards), "
              f"{wall:.2f} s ({read / wall / 1e9:.2f} GB/s)")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
