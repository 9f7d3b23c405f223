"""Verify's value check on a sample's statistics (pipeline/verification/values.py) at a
real width: a sample of 600 tokens at H 4096 spans three of `shard_stats.sample_stats`' chunks of a layer, which the
embedded default's samples (one chunk each) never do. Shards are written by the project's writer, so the manifest's
record is what an extractor leaves for the data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.format import Sample, manifest_path, read_header, write_shard
from pipeline.verification.shard_view import ShardView
from pipeline.verification.values import bad_values, suspect_layers

LAYER_IDS = [2, 16, 29]
T, H = 600, 4096  # 256 rows a chunk at H 4096: rows 0-255, 256-511, 512-599


def judge(tmp_path: Path, states: torch.Tensor, stats: np.ndarray | None = None) -> list[tuple[str, str, int]]:
    """`states` written as sample 7 of a shard (its record computed by the writer, or `stats` as an extractor passed
    them), then judged as verify's scan judges a sample from its record."""
    ids = torch.arange(T) % 1000
    write_shard(tmp_path, 0, [Sample(7, ids, torch.ones(T, dtype=torch.long), states, stats)], {})
    path = tmp_path / "shard-00000.safetensors"
    record = np.asarray(json.loads(manifest_path(path).read_text())["layer_stats"]["samples"]["7"], dtype=np.float64)
    if not suspect_layers(record, T * H):
        return []
    header, start = read_header(path)
    shard = ShardView(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")), header, start)
    return bad_values(shard.tensor("7/hidden_states"), LAYER_IDS, record)


def clean() -> torch.Tensor:
    return torch.randn(T, len(LAYER_IDS), H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def test_clean_wide_sample_raises_nothing(tmp_path: Path):
    assert judge(tmp_path, clean()) == []


@pytest.mark.parametrize("row", [3, 300, 599], ids=["first chunk", "middle chunk", "last chunk"])
@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_in_any_chunk_is_named(tmp_path: Path, row: int, value: float, word: str):
    states = clean()
    states[row, 1, 5] = value
    findings = judge(tmp_path, states)
    assert [(check, layer) for check, _, layer in findings] == [("values", 16)], findings
    assert word in findings[0][1] and f"1 non-finite values ({word}) at position {row}" in findings[0][1]


def test_positions_of_non_finite_values_are_listed(tmp_path: Path):
    states = clean()
    states[[5, 40, 41, 300, 301, 302, 303, 500, 598, 599], 0, 7] = float("nan")
    states[41, 0, 9] = float("nan")
    message = judge(tmp_path, states)[0][1]
    assert message == "11 non-finite values (NaN) at 10 positions: 5, 40, 41, 300, 301, 302, 303, 500, ...", message


def test_nan_outside_the_last_chunk_shows_in_the_sums():
    """What the value check relies on: whatever chunk a NaN is in, the record's sums are NaN."""
    states = clean()
    states[3, 1, 5] = float("nan")
    stats = shard_stats.sample_stats(states)
    assert np.isnan(stats[1, :2]).all() and np.isfinite(stats[[0, 2]]).all()
    assert suspect_layers(stats, T * H) == [1]


def test_a_record_showing_what_the_bytes_do_not_have_is_named(tmp_path: Path):
    """An extractor that recorded a NaN sum for clean data: not a silent skip of the sample, a wrong record."""
    states = clean()
    stats = shard_stats.sample_stats(states)
    stats[2, 1] = float("nan")
    findings = judge(tmp_path, states, stats)
    assert [(check, layer) for check, _, layer in findings] == [("structure", 29)], findings
    assert "record is wrong" in findings[0][1]


def test_zero_and_constant_layers_are_named(tmp_path: Path):
    states = clean()
    states[:, 0] = 0
    states[:, 2] = 1.5
    findings = judge(tmp_path, states)
    assert [(layer, message) for _, message, layer in findings] == [(2, "layer is all zeros"), (29, "layer is constant (1.5)")]
