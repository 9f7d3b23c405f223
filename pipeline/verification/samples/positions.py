"""Where the per-sample tests look (pipeline/verification/samples/scores.py): each sample's judged positions, its seeded fold and
half, and how samples are cut into scoring batches. Seeded by (verify.seed, sample id) alone, so a sample's positions
and fold do not depend on which shard holds it, on the order the scan's threads reach it, or on the other samples."""

from __future__ import annotations

import functools
import random

import numpy as np

BATCH_ROWS = 4096  # judged rows scored in one batch at most (at the 8B shape ~0.35 GB of predictions on the device)


def sample_positions(length: int, stride: int, seed: int, sid: int) -> np.ndarray:
    """Every `stride`-th position from a seeded offset, position 0 left out."""
    return np.arange(1 + sample_offset(stride, seed, sid), length, stride)


def sample_offset(stride: int, seed: int, sid: int) -> int:
    """A sample's seeded offset."""
    return seeded_draw(f"{seed}/{sid}", stride)


def judged_positions(length: int, stride: int, seed: int, sid: int) -> np.ndarray:
    """The positions the per-sample tests judge: `sample_positions`, or none where there are fewer than two (a judged
    position is contrasted with another of its sample)."""
    positions = sample_positions(length, stride, seed, sid)
    return positions if len(positions) >= 2 else positions[:0]


def batch_capacity(longest: int, stride: int) -> int:
    """Judged rows a scoring batch holds at most: BATCH_ROWS, or a longer sample's (a sample is never split)."""
    return max(BATCH_ROWS, -(-(longest - 1) // stride))


def batches(items: list, limit: int):
    """Consecutive items (their judged positions at [3]) in batches of at most `limit` judged rows; an item over
    `limit` alone."""
    batch, rows = [], 0
    for item in items:
        if batch and rows + len(item[3]) > limit:
            yield batch
            batch, rows = [], 0
        batch.append(item)
        rows += len(item[3])
    if batch:
        yield batch


@functools.lru_cache(maxsize=16384)
def seeded_draw(key: str, n: int) -> int:
    """`random.Random(key).randrange(n)`: a sample's offset, fold or half (kept: a seeded Random costs a scan thread
    ~30 us, and the scan asks for each more than once a sample)."""
    return random.Random(key).randrange(n)


def row_spans(keys: list, starts, ends) -> dict:
    """Per key, the rows [first start, last end) of the items with it (contiguous: the items are sorted by key)."""
    spans: dict = {}
    for key, start, end in zip(keys, starts, ends, strict=True):
        spans[key] = (spans.get(key, (int(start),))[0], int(end))
    return spans
