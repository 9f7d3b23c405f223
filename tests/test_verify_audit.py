"""An audited shard read in full (pipeline/verification/audit.py): its sha256 and every sample's statistics from one read
must be what the two separate reads give: the file's sha256 and `shard_stats.sample_stats` of each sample, bit for
bit; a shard whose header does not fit its bytes still gets its digest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.format import Sample, read_header, write_shard
from pipeline.target import sha256_file
from pipeline.verification.audit import read_in_full
from pipeline.verification.shard_view import ShardView


def shard_of(tmp_path: Path, dtype: torch.dtype, lengths: list[int], hidden: int, nan_at: tuple | None = None) -> Path:
    g = torch.Generator().manual_seed(len(lengths) * hidden)
    samples = []
    for i, T in enumerate(lengths):
        states = (torch.randn(T, 3, hidden, generator=g) * (i + 1)).to(dtype)
        if nan_at is not None and i == nan_at[0]:
            states[nan_at[1], nan_at[2], 0] = float("nan")
        ids = torch.randint(0, 1000, (T,), generator=g)
        samples.append(Sample(sample_id=10 + i, input_ids=ids, loss_mask=torch.ones(T, dtype=torch.long), hidden_states=states))
    write_shard(tmp_path, 0, samples, {})
    return next(tmp_path.glob("*.safetensors"))


def two_reads(path: Path) -> tuple[str, dict[int, np.ndarray]]:
    header, start = read_header(path)
    shard = ShardView(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")), header, start)
    names = [n for n in header if n.endswith("/hidden_states")]
    return sha256_file(path), {int(n.split("/")[0]): shard_stats.sample_stats(shard.numpy(n)) for n in names}


# hidden 96: ~10,900 rows a block, so the 12,000-row sample is two blocks (the last one short); hidden 4096: 256 rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lengths,hidden", [([12000, 7, 300], 96), ([700, 1, 256], 4096)])
def test_one_read_gives_what_two_give(tmp_path: Path, dtype, lengths, hidden):
    path = shard_of(tmp_path, dtype, lengths, hidden)
    digest, stats = two_reads(path)
    found = read_in_full(path, with_stats=True)
    assert found.digest == digest
    assert sorted(found.stats) == sorted(stats)
    for sid, expected in stats.items():
        assert np.array_equal(found.stats[sid], expected), sid
    assert set(found.seconds) == {"sha256", "audit_stats"}


def test_nan_kept_across_blocks(tmp_path: Path):
    path = shard_of(tmp_path, torch.bfloat16, [12000, 5], 96, nan_at=(0, 11500, 1))  # in the second block of layer 1
    found = read_in_full(path, with_stats=True)
    assert np.isnan(found.stats[10][1, 2:]).all() and np.isfinite(found.stats[10][[0, 2], 2:]).all()
    assert np.array_equal(found.stats[10], two_reads(path)[1][10], equal_nan=True)


def test_without_statistics_only_the_digest(tmp_path: Path):
    path = shard_of(tmp_path, torch.bfloat16, [40, 9], 32)
    found = read_in_full(path, with_stats=False)
    assert found.digest == sha256_file(path) and found.stats == {}


def rewrite_header(path: Path, change) -> None:
    """The file's JSON header replaced (same length, padded with spaces) after `change(header)`."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n :])


@pytest.mark.parametrize("fault", ["shape that does not fit its bytes", "two samples' states overlapping"])
def test_bad_layout_still_hashed(tmp_path: Path, fault: str):
    """A header the bytes do not fit: the digest is still the file's (the scan reports the mismatch); statistics only
    where they can be read."""
    path = shard_of(tmp_path, torch.bfloat16, [40, 9], 32)

    def change(header):
        if fault.startswith("shape"):
            header["10/hidden_states"]["shape"] = [41, 3, 32]
        else:
            header["11/hidden_states"]["data_offsets"] = header["10/hidden_states"]["data_offsets"]
            header["11/hidden_states"]["shape"] = [40, 3, 32]

    rewrite_header(path, change)
    found = read_in_full(path, with_stats=True)
    assert found.digest == sha256_file(path)
    if fault.startswith("two"):  # read as laid out, each sample's statistics from its own bytes
        assert np.array_equal(found.stats[10], found.stats[11])
    else:  # none: the scan reports the shard unreadable
        assert found.stats == {}
