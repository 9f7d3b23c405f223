"""kill -9 of the extract stage at observed points; each rerun resumes, the last completes and verifies.

The stage runs as `python -m pipeline --params P run extract` in its own process group, and the
test sends the group SIGKILL when it sees a point from outside (tests/kill_from_outside.py: a log
line, or a file event in the output directory through inotify), as a user's crash would. The runs
share one project copy, so every rerun also resumes from the state the previous kill left:

    1. the log line of the shard plan       the engine is loading: no shard yet (seconds before one)
    2. a shard's .tmp- data file created    mid-write: a torn shard
    3. a shard data file renamed into place its manifest not yet written
    4. a manifest renamed into place        between shards
    5. the last manifest renamed into place all shards complete, extract_meta.json not marked complete
    6. no kill: completes; then verify passes and the tensors equal the uninterrupted run's.

Points 1 and 4 leave a state that lasts (seconds of engine loading; a complete shard), so the kill
lands in it. Points 2, 3 and 5 open a window of about a millisecond (a ~1 MB write and its fsync, a
hash, a metadata write) that a kill from outside hits often but not always, least on a loaded
machine. Whatever the kill hits, the state it leaves is checked (only complete shards, temp files
and data files without manifest; no complete shard lost). Where it missed the window, the state of
that point is then made with the project's own writers, as the killed writer would have left it
(half of a real shard at its temp name; a real shard's data file without its manifest;
extract_meta.json rewritten as not complete), so the rerun's handling of every state is tested on
every run. The test prints which points the kill hit.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import layout
from pipeline.atomic import SAFETENSORS_TEMP, TMP_MARK, is_temp
from pipeline.hidden_states import format as shards
from pipeline.target import sha256_file
from tests.conftest import EXTRACT_PARAMS, NUM_PREPARED, copy_project, run_stage
from tests.kill_from_outside import Run, kill_at_file, kill_at_line, run_to_end

pytestmark = pytest.mark.slow
SAMPLES_PER_SHARD = 3  # 7 shards of the 20 samples: enough for every kill point to leave work
NUM_SHARDS = -(-NUM_PREPARED // SAMPLES_PER_SHARD)
PLAN_LINE = "already complete; layers"  # "[extract] N samples; rank r of w owns K shards, D already complete; ..."


def complete_indices(hs: Path) -> set[int]:
    return {int(p.stem.split("-")[1]) for p in shards.complete_shards(hs)}


def torn_writes(hs: Path) -> list[Path]:
    # ours, and safetensors' own: 0.8's save_file writes `.tmpXXXXXX` and renames it onto our .tmp- path
    return [p for p in hs.iterdir() if ".safetensors" + TMP_MARK in p.name or SAFETENSORS_TEMP.fullmatch(p.name)]


def orphans(hs: Path) -> list[Path]:
    return [p for p in hs.glob("shard-*.safetensors") if not shards.manifest_path(p).exists()]


def check_after_kill(hs: Path) -> None:
    """What a kill may leave: complete shards (data + matching manifest), .tmp- files, and data
    files without a manifest (an interrupted shard, deleted by the rerun); nothing else."""
    for p in hs.iterdir():
        name = p.name
        if is_temp(name) or name == shards.META_FILE:
            continue
        assert name.startswith("shard-") and p.suffix in (".safetensors", ".json"), name
        if p.suffix == ".json":
            data = p.with_suffix(".safetensors")
            assert data.is_file(), f"manifest {name} without its data file"
            m = json.loads(p.read_text())
            assert (m["bytes"], m["sha256"]) == (data.stat().st_size, sha256_file(data)), name
    assert not shards.read_meta(hs)["complete"]


def shard_file(name: str, suffix: str) -> bool:
    return name.startswith("shard-") and name.endswith(suffix) and TMP_MARK not in name


def real_shard(reference: Path, hs: Path, k: int, tmp: Path) -> Path:
    """Shard k of this run written by the project's writer (shards.write_shard) into `tmp`: the
    samples of the uninterrupted run, the manifest fields of this run's complete shards."""
    ref = {s.sample_id: s for p in shards.complete_shards(reference) for s in shards.iter_samples(p)}
    lo, hi = k * SAMPLES_PER_SHARD, min((k + 1) * SAMPLES_PER_SHARD, NUM_PREPARED)
    meta = shards.read_meta(hs)
    extra = {key: meta[key] for key in ("layer_ids", "layer_id_convention", "dtype", "hidden_size",
                                         "model_fingerprint", "run_key", "vllm_version", "rank")}
    tmp.mkdir(parents=True, exist_ok=True)
    shards.write_shard(tmp, k, [ref[i] for i in range(lo, hi)], extra)
    return tmp / shards.shard_name(k)


def test_kill9_at_observed_points_then_resume(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = copy_project(project_root, tmp_path / "p", layout.TARGET_JSON, layout.PREPARED_DATASET)
    section = {**EXTRACT_PARAMS, "samples_per_shard": SAMPLES_PER_SHARD}
    (proj / "params.yaml").write_text(yaml.safe_dump({"extract": section, "runtime": {"mode": "native"}}))
    hs = proj / layout.HIDDEN_STATES_DIR
    hit: dict[str, bool] = {}
    kills: list[tuple[str, list[int]]] = []

    def after_kill(point: str, r: Run, before: set[int]) -> None:
        assert r.killed and r.returncode == -signal.SIGKILL, f"{point}: rc {r.returncode}, saw {r.seen}\n{r.log[-3000:]}"
        check_after_kill(hs)
        after = complete_indices(hs)
        assert before <= after, f"{point}: complete shards lost: {before - after}"
        kills.append((point, sorted(after)))

    def kill_at(point: str, is_point) -> None:
        before = complete_indices(hs)
        after_kill(point, kill_at_file(proj, "extract", hs, PLAN_LINE, is_point), before)

    # 1. while the engine loads: the plan is logged (and extract_meta.json written), no shard yet
    after_kill("plan logged", kill_at_line(proj, "extract", PLAN_LINE), set())
    assert complete_indices(hs) == set()
    assert not list(hs.glob("shard-*"))

    # 2. mid-write: a shard's temp data file exists
    kill_at("shard .tmp- created", lambda event, name: event == "created" and ".safetensors" + TMP_MARK in name)
    hit["torn write"] = bool(torn_writes(hs))

    # 3. a shard's data file renamed into place, its manifest not yet written
    kill_at("shard data renamed", lambda event, name: event == "moved_to" and shard_file(name, ".safetensors"))
    hit["data without manifest"] = bool(orphans(hs))

    # 4. between shards: a manifest renamed into place (a shard complete)
    before = complete_indices(hs)
    kill_at("manifest renamed", lambda event, name: event == "moved_to" and shard_file(name, ".json"))
    assert complete_indices(hs) > before, kills

    # the states of 2 and 3 the kill may have missed, made as the killed writer leaves them
    todo = sorted(set(range(NUM_SHARDS)) - complete_indices(hs) - {int(p.stem.split("-")[1]) for p in orphans(hs)})
    assert len(todo) >= 2, kills
    if not hit["torn write"]:
        data = real_shard(extracted, hs, todo[0], tmp_path / "torn").read_bytes()
        (hs / f"{shards.shard_name(todo[0])}{TMP_MARK}made").write_bytes(data[: len(data) // 2])
    if not any(SAFETENSORS_TEMP.fullmatch(p.name) for p in hs.iterdir()):  # safetensors' temp, killed mid-write
        data = real_shard(extracted, hs, todo[0], tmp_path / "torn-st").read_bytes()
        (hs / ".tmpQx7Zk2").write_bytes(data[: len(data) // 3])
    if not hit["data without manifest"]:
        shutil.copy2(real_shard(extracted, hs, todo[1], tmp_path / "orphan"), hs / shards.shard_name(todo[1]))
    check_after_kill(hs)

    # 5. the last manifest renamed into place: all shards complete, the run not yet marked complete
    remaining = NUM_SHARDS - len(complete_indices(hs))
    seen: list[str] = []

    def last_manifest(event: str, name: str) -> bool:
        if event == "moved_to" and shard_file(name, ".json"):
            seen.append(name)
        return len(seen) == remaining

    r = kill_at_file(proj, "extract", hs, PLAN_LINE, last_manifest)
    hit["all shards, meta not complete"] = r.returncode == -signal.SIGKILL and not shards.read_meta(hs)["complete"]
    if hit["all shards, meta not complete"]:
        after_kill("last manifest renamed", r, set())
    else:  # it finished first: make the state of a kill after its last shard
        assert r.returncode in (0, -signal.SIGKILL), f"rc {r.returncode}\n{r.log[-3000:]}"
        shards.write_meta(hs, {**shards.read_meta(hs), "complete": False})
        kills.append(("last manifest renamed (missed: state made)", sorted(complete_indices(hs))))
    assert complete_indices(hs) == set(range(NUM_SHARDS)), kills
    assert not torn_writes(hs) and not orphans(hs), "the rerun must clear torn writes and data without manifest"

    print("kill point -> complete shards after it:", kills, "; windows the kill hit:", hit)
    r = run_to_end(proj, "extract")
    assert r.returncode == 0, r.log[-3000:]
    assert not hs.is_symlink() and not (proj / "artifacts" / ".partial").exists()
    assert not [p for p in hs.iterdir() if is_temp(p.name)]
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
