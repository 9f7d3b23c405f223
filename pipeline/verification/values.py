"""Verify's value check of one sample: which layers its statistics (the manifest's record, or derived from the bytes
on an audited shard) show as non-finite, all zero or constant, and what the bytes of those layers are.

A NaN anywhere in a layer makes its sum and sum of squares NaN; it reaches min and max only from the layer's last
chunk of `sample_stats` in pipeline/hidden_states/stats.py (its merge of chunks drops one from an earlier chunk: at
H 4096 a chunk is 256 rows), so the sums are judged as well as min and max. The merge stays as it is: that module
decides extract's output, and an edit to it would re-run every user's extraction for records that only data verify
fails anyway carries (docs/FORMAT.md, "Recorded statistics").
"""

from __future__ import annotations

import numpy as np
import torch


def suspect_layers(stats: np.ndarray, values: int) -> list[int]:
    """Indices of the layers whose [L, 4] statistics (sum, sum of squares, min, max over `values` values each) show a
    non-finite, all-zero or constant layer."""
    lo, hi = stats[:, 2], stats[:, 3]
    bad = ~np.isfinite(lo) | ~np.isfinite(hi) | np.isnan(stats[:, 0]) | np.isnan(stats[:, 1])
    if values > 1:
        bad |= lo == hi
    return np.flatnonzero(bad).tolist()


def bad_values(hs: torch.Tensor, layer_ids: list[int], stats: np.ndarray) -> list[tuple[str, str, int]]:
    """(check, message, layer id) of what a suspect sample's [T, L, H] states hold. A record that shows what the bytes
    do not have is named as a wrong record, never passed over in silence."""
    found = []
    for i, lid in enumerate(layer_ids):
        layer = hs[:, i]
        wrong = ~torch.isfinite(layer)
        if bad := wrong.sum().item():
            kinds = [k for k, n in (("NaN", torch.isnan(layer).sum().item()), ("Inf", torch.isinf(layer).sum().item())) if n]
            found.append(("values", f"{bad} non-finite values ({'/'.join(kinds)}) {at_positions(wrong)}", lid))
        elif not layer.any():
            found.append(("values", "layer is all zeros", lid))
        elif layer.numel() > 1 and (layer == layer.reshape(-1)[0]).all():
            found.append(("values", f"layer is constant ({layer.reshape(-1)[0].item():g})", lid))
    if found:
        return found
    return [
        ("structure",
         f"the manifest's recorded statistics {np.asarray(stats)[i].tolist()} (sum, sum of squares, min, max) show a "
         "non-finite, zero or constant layer that the bytes do not have: the extractor's record is wrong",
         layer_ids[i])
        for i in suspect_layers(stats, hs.shape[0] * hs.shape[2])
    ]


def at_positions(wrong: torch.Tensor, shown: int = 8) -> str:
    """Where a [T, H] mask of wrong values lies, as token positions: "at position 3", "at 12 positions: 0, 4, ..."."""
    positions = torch.nonzero(wrong.any(1)).flatten().tolist()
    listed = ", ".join(str(p) for p in positions[:shown]) + (", ..." if len(positions) > shown else "")
    return f"at position {listed}" if len(positions) == 1 else f"at {len(positions)} positions: {listed}"
