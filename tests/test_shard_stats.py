"""The per-layer statistics the extractor records (pipeline/hidden_states/stats.py) against torch in float64,
and the comparison verify's audit makes between a record and the bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.hidden_states import stats as shard_stats


def reference(x: torch.Tensor) -> np.ndarray:
    y = x.double()
    return torch.stack([y.sum((0, 2)), y.square().sum((0, 2)), y.amin((0, 2)), y.amax((0, 2))], 1).numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_float64_and_a_memory_view(dtype):
    x = (torch.randn(300, 4, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    stats = shard_stats.sample_stats(x)
    assert np.array_equal(stats[:, 2:], reference(x)[:, 2:])  # min, max: values of the data, exact
    assert shard_stats.records_agree(reference(x), stats, 300 * 96) == []
    # the same bytes as verify reads them (a numpy view of the file; bf16 as its int16 pattern)
    view = x.view(torch.int16).numpy() if dtype == torch.bfloat16 else x.numpy()
    assert np.array_equal(shard_stats.sample_stats(view), stats)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_shows_in_min_max(value):
    x = torch.randn(50, 3, 16).to(torch.bfloat16)
    x[7, 1, 3] = value
    stats = shard_stats.sample_stats(x)
    assert not shard_stats.finite(stats)
    assert np.isfinite(stats[[0, 2], 2:]).all() and not np.isfinite(stats[1, 2:]).all()


def test_zero_and_constant_layers():
    x = torch.randn(20, 3, 8)
    x[:, 0] = 0
    x[:, 2] = 1.5
    stats = shard_stats.sample_stats(x)
    assert stats[0].tolist() == [0, 0, 0, 0] and stats[2, 2] == stats[2, 3] == 1.5


def test_records_agree_tolerates_summation_order_not_a_changed_value():
    x = torch.randn(64, 2, 32)
    stats = shard_stats.sample_stats(x)
    wobble = stats.copy()
    wobble[:, :2] *= 1 + 1e-7  # another summation order
    assert shard_stats.records_agree(wobble, stats, 64 * 32) == []
    changed = stats.copy()
    changed[1, 3] = np.nextafter(changed[1, 3], np.inf)  # a max that is not the data's
    assert shard_stats.records_agree(changed, stats, 64 * 32) == [1]
    scaled = stats.copy()
    scaled[0, 1] *= 1.01  # sum of squares 1% off: other data
    assert shard_stats.records_agree(scaled, stats, 64 * 32) == [0]
    assert shard_stats.records_agree(stats[:1], stats, 64 * 32) == [0, 1]  # a layer missing


def test_block_stats_on_the_device_agree_with_the_host_record():
    # the connector's statistics of fp8 states, built a block of tokens at a time, against sample_stats of the
    # same values: min and max equal, sums within records_agree's tolerance; NaN in a layer reaches its min and max
    x = torch.randn(700, 3, 96) * torch.tensor([1.0, 40.0, 0.01])[None, :, None]
    x[123, 2, 5] = float("nan")
    blocks = shard_stats.BlockStats(3, x.device)
    for lo in range(0, 700, 256):
        blocks.add(x[lo : lo + 256].transpose(0, 1).reshape(3, -1))
    got, want = blocks.result().numpy(), shard_stats.sample_stats(x)
    assert got.shape == want.shape and got.dtype == np.float64
    assert shard_stats.records_agree(got, want, count=700 * 96) == []
    assert np.isnan(got[2, 2:]).all() and np.isfinite(got[:2]).all()
    empty = shard_stats.BlockStats(3, x.device).result().numpy()
    assert np.array_equal(empty, shard_stats.sample_stats(torch.zeros(0, 3, 96)))
