"""`make plan`'s wall-time model of an extraction: the engine's compute and the host's shard writes.

The extract stage overlaps the two (the feeding thread keeps the engine busy while shard threads read
vLLM's per-request files, check them, write and hash the shards), so the longer one bounds the run;
the shards still being written when the last request finishes are not overlapped with anything, a
drain of about one shard. Hence, at an engine rate (e.g. plain vLLM prefill's, `--tok-per-s`):

    seconds = max(tokens / tok_per_s, bytes / write rate) + largest shard's bytes / write rate

`plan.write_gb_per_s` is the host's shard-pipeline rate. Checked against the H200 runs in
docs/BENCHMARKS.md ("The plan's time model"), at the default 1.0 GB/s: within 0.86-1.21x of the
five runs' measured times; the sum of the two terms instead of the max predicts 1.55-1.99x the
measured time of every 8B-shaped run, the max without the drain 0.69x the seed-shape run (10
shards, the last a 1.4 GB one, written after the engine was done).

A tok/s measured on a finished extraction (metrics/extract.json, or `--calibrate`'s short run) is
already until the last shard was written: it includes the writes, and the time is tokens / tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.extraction.capacity import human_seconds


@dataclass(frozen=True)
class ExtractionTime:
    compute_s: float  # tokens / tok/s
    write_s: float | None  # bytes / write rate (None: the rate already includes the writes)
    drain_s: float | None  # the largest shard / write rate, after the last request
    startup_s: float
    write_bytes_per_s: float | None

    @property
    def seconds(self) -> float:
        data = self.compute_s if self.write_s is None else max(self.compute_s, self.write_s) + (self.drain_s or 0.0)
        return data + self.startup_s

    @property
    def bound(self) -> str:
        if self.write_s is None:
            return "measured extraction rate"
        return "writes" if self.write_s > self.compute_s else "compute"

    def how(self, tokens_note: str) -> str:
        start = f" + {self.startup_s:.0f} s engine start" if self.startup_s else ""
        if self.write_s is None:
            return f"{tokens_note} / tok/s (a measured extraction's rate: its writes included){start}"
        rate = f"{self.write_bytes_per_s / 1e9:g} GB/s (plan.write_gb_per_s)"
        return (f"max({tokens_note} / tok/s = {human_seconds(self.compute_s)}, bytes at {rate} = {human_seconds(self.write_s)}) "
                f"+ the last shard's write {human_seconds(self.drain_s or 0.0)}{start}")


def extraction_time(tokens: int, tok_per_s: float, includes_writes: bool, write_bytes: int, largest_shard_bytes: int,
                    write_gb_per_s: float, startup_s: float | None = None) -> ExtractionTime:
    compute = tokens / tok_per_s
    if includes_writes or not tokens:
        return ExtractionTime(compute, None, None, startup_s or 0.0, None)
    rate = write_gb_per_s * 1e9
    return ExtractionTime(compute, write_bytes / rate, largest_shard_bytes / rate, startup_s or 0.0, rate)


def largest_shard(shard_tokens: list[int], shard_samples: list[int], bytes_per_token: int, overhead_per_sample: float) -> int:
    """Bytes of the largest shard still to write (the drain at the end), from each shard's tokens and samples."""
    return max((int(t * bytes_per_token + s * overhead_per_sample) for t, s in zip(shard_tokens, shard_samples, strict=True)),
               default=0)
