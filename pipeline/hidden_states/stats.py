"""Per-layer statistics of one sample's hidden states, recorded by the extractor in each manifest.

The extractor holds every sample's [T, L, H] tensor in memory before it writes the shard; summing
it there costs one more pass over memory, where verify would have to read every byte back from
disk (at GPU extraction rates that alone takes about as long as the extraction wrote it). Verify
judges the records (finite, not zero or constant, no outlier shard) and re-derives them from the
bytes on a seeded audit sample of shards (docs/FORMAT.md, "Recorded statistics").

One row per layer: sum, sum of squares, min, max over the sample's T x H values. NaN propagates
into min and max, an Inf shows in them, so a finite record proves finite data.
"""

from __future__ import annotations

import numpy as np
import torch

FIELDS = ("sum", "sumsq", "min", "max")
# rows of one layer converted at a time: a few MB, so the fp32 copy stays in cache
_CHUNK_VALUES = 1 << 20
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def sample_stats(hidden_states: torch.Tensor | np.ndarray) -> np.ndarray:
    """[L, 4] float64 (FIELDS) of a [T, L, H] tensor (bf16, fp16 or fp32; a CPU tensor or a numpy
    view of one, e.g. a memory map of a shard: bf16 as its int16 bit pattern)."""
    if isinstance(hidden_states, torch.Tensor):
        t = hidden_states.detach().cpu().contiguous()
        if t.dtype not in _SUPPORTED:
            raise TypeError(f"hidden states of dtype {t.dtype}: expected bfloat16, float16 or float32")
        arr, bf16 = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy(), t.dtype == torch.bfloat16
    else:
        arr, bf16 = hidden_states, hidden_states.dtype == np.int16
    T, L, H = arr.shape
    out = np.zeros((L, 4))
    out[:, 2], out[:, 3] = np.inf, -np.inf
    rows = max(1, _CHUNK_VALUES // max(H, 1))
    buf = np.empty((rows, H), np.int32 if bf16 else np.float32)
    for t0 in range(0, T, rows):
        for layer in range(L):
            chunk = arr[t0 : t0 + rows, layer]
            b = buf[: chunk.shape[0]]
            if bf16:  # bf16 is the high half of an fp32: shift the bits up, no float conversion
                np.left_shift(chunk, 16, out=b, dtype=np.int32)
                f = b.view(np.float32).reshape(-1)
            elif chunk.dtype == np.float32:
                f = np.ascontiguousarray(chunk).reshape(-1)
            else:
                b[...] = chunk
                f = b.reshape(-1)
            lo, hi = f.min(), f.max()  # NaN propagates into both
            out[layer, 0] += float(f.sum())
            out[layer, 1] += float(np.dot(f, f))
            out[layer, 2] = lo if np.isnan(lo) or np.isnan(out[layer, 2]) else min(out[layer, 2], lo)
            out[layer, 3] = hi if np.isnan(hi) or np.isnan(out[layer, 3]) else max(out[layer, 3], hi)
    return out


class BlockStats:
    """`sample_stats` of a sample built from blocks of its values where they already are (the GPU, before the
    device-to-host copy), in torch: each block [L, n] float32, the result [L, 4] float64 on the blocks' device.
    Squares are summed in float32 per block, as the host's np.dot of float32 rows."""

    def __init__(self, layers: int, device: torch.device) -> None:
        self.sums = torch.zeros((layers, 2), dtype=torch.float64, device=device)
        self.lows: list[torch.Tensor] = []
        self.highs: list[torch.Tensor] = []

    def add(self, block: torch.Tensor) -> None:
        self.sums[:, 0] += block.sum(dim=1, dtype=torch.float64)
        self.sums[:, 1] += (block * block).sum(dim=1, dtype=torch.float64)
        self.lows.append(block.amin(dim=1))  # NaN propagates, as in sample_stats
        self.highs.append(block.amax(dim=1))

    def result(self) -> torch.Tensor:
        if self.lows:
            low = torch.stack(self.lows).amin(dim=0).double()
            high = torch.stack(self.highs).amax(dim=0).double()
        else:  # no values: sample_stats' empty record
            low = torch.full_like(self.sums[:, 0], float("inf"))
            high = -low
        return torch.cat([self.sums, low[:, None], high[:, None]], dim=1)


def finite(stats: np.ndarray) -> bool:
    return bool(np.isfinite(stats[:, 2:]).all())


def to_record(stats: np.ndarray) -> list[list[float]]:
    return [[float(v) for v in row] for row in stats]


def records_agree(recorded, derived: np.ndarray, count: int, rel: float = 1e-4) -> list[int]:
    """Layer indices whose recorded row differs from the one derived from the bytes.

    min and max must be equal (they are values of the data). The sums may differ in the last
    bits (BLAS and numpy sum in an order that can depend on threads and alignment): allowed is
    `rel` times the largest value a sum of `count` values of that RMS can reach.
    """
    rec = np.asarray(recorded, dtype=np.float64)
    if rec.shape != derived.shape:
        return list(range(derived.shape[0]))
    bad = []
    for i in range(derived.shape[0]):
        r, d = rec[i], derived[i]
        if not np.array_equal(r[2:], d[2:], equal_nan=True):
            bad.append(i)
            continue
        if not np.isfinite(d[1]):
            if not np.array_equal(r[:2], d[:2], equal_nan=True):
                bad.append(i)
            continue
        bound = rel * max(float(np.sqrt(count * d[1])), 1e-30)
        if abs(r[0] - d[0]) > bound or abs(r[1] - d[1]) > rel * max(d[1], 1e-30):
            bad.append(i)
    return bad
