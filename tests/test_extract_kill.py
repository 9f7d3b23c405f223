"""kill -9 of the extract stage at five points; each rerun resumes, the last completes and verifies.

Each kill is deterministic: the stage runs as `python -m pipeline --params P run extract` in a
subprocess with EAGLE3_TEST_KILL_AT=<event>:<n> (the fault-injection hook in
pipeline/stages/extract.py), which SIGKILLs the process at that point. The runs share one project
copy, so every rerun also resumes from the state the previous kill left:

    1. engine_started:1       before the first shard
    2. shard_tmp_written:1    mid-write: a shard's .tmp- file cut to half, then killed
    3. shard_data_renamed:1   a shard's data file in place, its manifest not yet written
    4. shard_done:1           between shards
    5. shard_done:<remaining> at the last shard (all manifests written, extract_meta not complete)
    6. no kill: completes; then verify passes and the tensors equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import layout, shards
from pipeline.atomic import TMP_MARK
from pipeline.extraction.engine import KILL_AT_ENV
from pipeline.target import sha256_file
from tests.conftest import EXTRACT_PARAMS, NUM_PREPARED, copy_project, run_stage

pytestmark = pytest.mark.slow
SAMPLES_PER_SHARD = 3  # 7 shards of the 20 samples: enough for every kill point to leave work
NUM_SHARDS = -(-NUM_PREPARED // SAMPLES_PER_SHARD)
REPO = Path(__file__).resolve().parents[1]


def run_extract(proj: Path, kill_at: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    env.pop(KILL_AT_ENV, None)
    if kill_at:
        env[KILL_AT_ENV] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "--params", "params.yaml", "run", "extract"],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def complete_indices(hs: Path) -> set[int]:
    return {int(p.stem.split("-")[1]) for p in shards.complete_shards(hs)}


def check_after_kill(hs: Path) -> None:
    """What a kill may leave: complete shards (data + matching manifest), .tmp- files, and data
    files without a manifest (an interrupted shard, deleted by the rerun); nothing else."""
    for p in hs.iterdir():
        name = p.name
        if TMP_MARK in name or name == shards.META_FILE:
            continue
        assert name.startswith("shard-") and p.suffix in (".safetensors", ".json"), name
        if p.suffix == ".json":
            data = p.with_suffix(".safetensors")
            assert data.is_file(), f"manifest {name} without its data file"
            m = json.loads(p.read_text())
            assert (m["bytes"], m["sha256"]) == (data.stat().st_size, sha256_file(data)), name
    assert not shards.read_meta(hs)["complete"]


def test_kill9_at_five_points_then_resume(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = copy_project(project_root, tmp_path / "p", layout.TARGET_JSON, layout.PREPARED_DATASET)
    section = {**EXTRACT_PARAMS, "samples_per_shard": SAMPLES_PER_SHARD}
    (proj / "params.yaml").write_text(yaml.safe_dump({"extract": section, "runtime": {"mode": "native"}}))
    hs = proj / layout.HIDDEN_STATES_DIR

    def kill(point: str) -> None:
        before = complete_indices(hs) if hs.exists() else set()
        r = run_extract(proj, point)
        assert r.returncode == -signal.SIGKILL, f"{point}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        check_after_kill(hs)
        after = complete_indices(hs)
        assert before <= after, f"{point}: complete shards lost: {before - after}"
        kills.append((point, sorted(after)))

    kills: list[tuple[str, list[int]]] = []
    kill("engine_started:1")
    assert complete_indices(hs) == set()
    assert not list(hs.glob("shard-*"))

    kill("shard_tmp_written:1")
    torn = [p for p in hs.iterdir() if TMP_MARK in p.name]
    assert torn, "the torn write should leave its .tmp- file"

    kill("shard_data_renamed:1")
    orphans = [p for p in hs.glob("shard-*.safetensors") if not shards.manifest_path(p).exists()]
    assert orphans, "a shard data file without manifest should be left"

    kill("shard_done:1")
    remaining = NUM_SHARDS - len(complete_indices(hs))
    assert remaining >= 1, kills
    kill(f"shard_done:{remaining}")
    assert complete_indices(hs) == set(range(NUM_SHARDS)), kills

    print("kill point -> complete shards after it:", kills)
    r = run_extract(proj, None)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert not hs.is_symlink() and not (proj / "artifacts" / ".partial").exists()
    assert not [p for p in hs.iterdir() if TMP_MARK in p.name]
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    assert (metrics["shards_written"], metrics["shards_resumed"]) == (0, NUM_SHARDS), kills

    meta = shards.read_meta(hs)
    assert meta["complete"] and meta["num_shards"] == NUM_SHARDS
    ids = [sid for p in shards.complete_shards(hs) for sid in shards.read_manifest(p)["sample_ids"]]
    assert sorted(ids) == list(range(NUM_PREPARED)), "a sample is missing or duplicated"
    assert len(list(hs.glob("shard-*.safetensors"))) == NUM_SHARDS

    run_stage(proj, "verify", reference_samples=2)
    assert json.loads((proj / layout.VERIFY_VERDICT).read_text())["passed"] is True

    ref = {s.sample_id: s for p in shards.complete_shards(extracted) for s in shards.iter_samples(p)}
    for p in shards.complete_shards(hs):
        for s in shards.iter_samples(p):
            r_ = ref[s.sample_id]
            assert torch.equal(s.input_ids, r_.input_ids) and torch.equal(s.loss_mask, r_.loss_mask)
            assert torch.equal(s.hidden_states, r_.hidden_states), f"sample {s.sample_id} differs"
