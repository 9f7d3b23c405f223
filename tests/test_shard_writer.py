"""The shard writer: safetensors' own bytes (metadata sorted), its size and SHA-256 from memory equal
to what reached the disk, and the same samples giving the same file in another process."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save

from pipeline.hidden_states import disk_write
from pipeline.hidden_states.format import Sample, load_sample, write_safetensors, write_shard


def sorted_metadata(blob: bytes) -> bytes:
    """safetensors' bytes with the header's `__metadata__` keys sorted, the header's length kept."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    head = ({"__metadata__": dict(sorted(meta.items()))} if meta is not None else {}) | header
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    return blob[:8] + text.ljust(n, b" ") + blob[8 + n :]


def samples(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for sid in (3, 12, 100, 7, 0):
        t = 1 + sid % 7
        tensors[f"{sid}/hidden_states"] = torch.randn(t, 3, 8, generator=g).to(dtype)
        tensors[f"{sid}/input_ids"] = torch.randint(0, 1000, (t,), generator=g)
        tensors[f"{sid}/loss_mask"] = torch.randint(0, 2, (t,), generator=g).to(torch.uint8)
    return tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_bytes_are_safetensors_own_with_sorted_metadata(tmp_path, dtype):
    tensors = samples(dtype) | {"empty": torch.zeros(0, 4)}
    meta = {"shard_index": "12", "format_version": "1", "format": "x"}
    size, sha256 = write_safetensors(tmp_path / "a.safetensors", tensors, meta)
    written = (tmp_path / "a.safetensors").read_bytes()
    assert written == sorted_metadata(save(tensors, metadata=meta))
    assert (size, sha256) == (len(written), hashlib.sha256(written).hexdigest())
    back = load_file(tmp_path / "a.safetensors")
    assert all(torch.equal(back[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)


def test_manifest_records_the_bytes_on_disk_across_blocks(tmp_path, monkeypatch):
    # staging buffers and hash blocks smaller than a tensor, the buffers reused many times over: the hash and size
    # still follow the file byte for byte
    monkeypatch.setattr("pipeline.hidden_states.disk_write.STAGING_BYTES", disk_write.ALIGN)
    monkeypatch.setattr("pipeline.hidden_states.format.HASH_BLOCK", 100)
    g = torch.Generator().manual_seed(1)
    batch = [Sample(sid, torch.arange(t), torch.ones(t, dtype=torch.uint8), torch.randn(t, 3, 64, generator=g).to(torch.bfloat16))
             for sid, t in ((0, 50), (3, 7), (7, 33))]
    manifest = write_shard(tmp_path, 0, batch, {})
    data = (tmp_path / manifest["file"]).read_bytes()
    assert len(data) > 8 * disk_write.ALIGN and len(data) % disk_write.ALIGN
    assert manifest["bytes"] == len(data)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert all(torch.equal(load_sample(tmp_path / manifest["file"], s.sample_id).hidden_states, s.hidden_states) for s in batch)


@pytest.mark.parametrize("nbytes", [0, 1, disk_write.ALIGN - 1, disk_write.ALIGN, disk_write.ALIGN + 1, 5 * disk_write.ALIGN + 77])
def test_direct_and_page_cache_writes_give_the_same_file(tmp_path, monkeypatch, nbytes):
    # the direct path pads its last buffer to the alignment and cuts the file back; chunks straddle the buffers
    monkeypatch.setattr("pipeline.hidden_states.disk_write.STAGING_BYTES", 2 * disk_write.ALIGN)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    chunks = [data[: nbytes // 3], data[nbytes // 3 : nbytes // 2], data[nbytes // 2 :]]
    for direct in (True, False):
        path = tmp_path / f"{direct}.bin"
        path.write_bytes(b"x" * (3 * disk_write.ALIGN))  # what was there before is gone
        assert disk_write.write_file(path, chunks, direct=direct) == nbytes
        assert path.read_bytes() == bytes(data.numpy())


def test_same_samples_same_file_in_another_process(tmp_path):
    script = (
        "import sys, torch; from pipeline.hidden_states.format import Sample, write_shard\n"
        "g = torch.Generator().manual_seed(5)\n"
        "s = [Sample(i, torch.arange(9), torch.ones(9, dtype=torch.uint8), torch.randn(9, 2, 16, generator=g)"
        ".to(torch.bfloat16)) for i in range(4)]\n"
        "print(write_shard(sys.argv[1], 0, s, {})['sha256'])\n"
    )
    hashes = set()
    for run in ("a", "b"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / run)], capture_output=True, text=True, check=True)
        hashes.add(out.stdout.strip())
        assert hashlib.sha256((tmp_path / run / "shard-00000.safetensors").read_bytes()).hexdigest() == out.stdout.strip()
    assert len(hashes) == 1
