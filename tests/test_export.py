"""Exports to speculators' layouts, each read back with the reader of that layout.

speculators-0.9: loaded with speculators' own `ArrowDataset` (default `FileTransfer`,
on_missing="raise", so nothing is generated and no vLLM endpoint is needed).
speculators-0.3: speculators 0.9 ships no reader for 0.3.0's `.pt` files, so they are checked
against 0.3.0's documented structure with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline import layout
from pipeline.cli import main
from pipeline.errors import PipelineError
from pipeline.hidden_states import format as shards
from pipeline.hidden_states.export import EXPORT_META, export, to_speculators_03_ids
from tests.conftest import NUM_PREPARED, TINY, copy_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proj(extracted: Path, project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_project(
        project_root,
        tmp_path_factory.mktemp("export") / "p",
        layout.TARGET_JSON,
        layout.PREPARED_DATASET,
        layout.HIDDEN_STATES_DIR,
    )


def ours(proj: Path) -> dict[int, shards.Sample]:
    hs = proj / layout.HIDDEN_STATES_DIR
    return {s.sample_id: s for p in shards.complete_shards(hs) for s in shards.iter_samples(p)}


def test_speculators_09_export_reads_back_with_arrow_dataset(proj: Path) -> None:
    import datasets
    from speculators.train.data import ArrowDataset

    out = proj / "exports" / "spec09"
    with contextlib.chdir(proj):
        r = CliRunner().invoke(main, ["export", "--format", "speculators-0.9", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert not [p for p in out.parent.iterdir() if p.name != "spec09"], "temp files left beside the export"

    raw = datasets.load_from_disk(str(out))
    assert raw.features["input_ids"].feature.dtype == "int64"
    assert raw.features["loss_mask"].feature.dtype == "int64"
    assert raw.features["seq_len"].dtype == "int64"
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == NUM_PREPARED

    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32)
    ref = ours(proj)
    assert len(ds) == NUM_PREPARED and ds.approx_lengths == [len(ref[i].input_ids) for i in range(NUM_PREPARED)]
    for i in range(NUM_PREPARED):
        got, s = ds[i], ref[i]
        assert isinstance(got, dict), f"sample {i}: {got}"
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask.long())
        assert torch.equal(got["hidden_states"], s.hidden_states[:, :-1].flatten(1))  # [T, 3H]
        assert torch.equal(got["verifier_last_hidden_states"], s.hidden_states[:, -1])  # [T, H]
        assert got["hidden_states"].shape == (len(s.input_ids), 3 * TINY["hidden_size"])

    side = json.loads((out / EXPORT_META).read_text())
    meta = shards.read_meta(proj / layout.HIDDEN_STATES_DIR)
    assert side["layer_ids"] == side["vllm_layer_ids"] == meta["layer_ids"] == [2, 4, 5, 8]
    assert side["sample_ids"] == list(range(NUM_PREPARED)) and side["source_run_key"] == meta["run_key"]


def test_speculators_03_export_layout_and_layer_ids(proj: Path) -> None:
    out = proj / "exports" / "spec03"
    out.mkdir(parents=True)  # an empty directory is accepted
    with contextlib.chdir(proj):
        side = export("speculators-0.3", out)
    ref = ours(proj)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(f"data_{i}.pt" for i in range(NUM_PREPARED))
    for i in range(NUM_PREPARED):
        d = torch.load(out / f"data_{i}.pt", weights_only=True)
        s = ref[i]
        assert set(d) == {"input_ids", "hidden_states", "loss_mask"}
        assert d["input_ids"].dtype == torch.long and torch.equal(d["input_ids"], s.input_ids)
        assert d["loss_mask"].dtype == torch.long and torch.equal(d["loss_mask"], s.loss_mask.long())
        assert isinstance(d["hidden_states"], list) and len(d["hidden_states"]) == 4
        for j, h in enumerate(d["hidden_states"]):
            assert h.shape == (len(s.input_ids), TINY["hidden_size"])
            assert torch.equal(h, s.hidden_states[:, j])

    n = TINY["num_layers"]
    on_disk = json.loads((out / EXPORT_META).read_text())
    assert on_disk == side
    # vLLM [2, N//2, N-3, N] = 0.3.0 [1, N//2-1, N-4, N-1]; the last is 0.3.0's final layer (N-1)
    assert side["vllm_layer_ids"] == [2, 4, 5, 8] and side["layer_ids"] == [1, 3, 4, 7]
    assert side["layer_ids"][-1] == n - 1
    assert to_speculators_03_ids([3, 17, 30, 32]) == [2, 16, 29, 31]  # docs/FORMAT.md's table, N = 32
    with pytest.raises(PipelineError, match="embeddings"):
        to_speculators_03_ids([0, 3, 8])


def test_export_refuses_non_empty_out_and_incomplete_source(proj: Path, tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with contextlib.chdir(proj), pytest.raises(PipelineError, match="not an empty directory"):
        export("speculators-0.9", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    with contextlib.chdir(proj):
        r = CliRunner().invoke(main, ["export", "--format", "speculators-0.3", "--out", str(out)])
    assert r.exit_code == 1 and "not an empty directory" in r.output

    src = copy_project(proj, tmp_path / "q", layout.HIDDEN_STATES_DIR) / layout.HIDDEN_STATES_DIR
    meta = shards.read_meta(src)
    shards.write_meta(src, {**meta, "complete": False})
    with pytest.raises(PipelineError, match="not complete"):
        export("speculators-0.3", tmp_path / "new", hs_dir=src)
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob("new*"))
