"""The train stage with real speculators on CPU, on the hidden states of a real extract run."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.hidden_states import format as shards
from pipeline.stages import train
from pipeline.training import cpu_determinism, speculators_cpu
from pipeline.training.draft import final_draft
from tests.conftest import copy_project, run_stage
from tests.tiny_project import write_verdict

pytestmark = pytest.mark.slow
TTT = 2
TRAIN = {"epochs": 2, "ttt_steps": TTT, "lr": 1e-3, "max_len": 512, "val_fraction": 0.2}


def new_project(root: Path, src: Path) -> Path:
    """A project with the shared tiny target and its extracted hidden states, verified, plus token counts."""
    copy_project(src, root, layout.TARGET_JSON, layout.HIDDEN_STATES_DIR)
    write_verdict(root)
    freq = [0] * 512
    for path in shards.complete_shards(root / layout.HIDDEN_STATES_DIR):
        for s in shards.iter_samples(path):
            for t in s.input_ids[s.loss_mask.bool()].tolist():
                freq[t] += 1
    (root / layout.TOKEN_FREQ).parent.mkdir(parents=True, exist_ok=True)
    (root / layout.TOKEN_FREQ).write_text(json.dumps(freq))
    return root


def epoch_dirs(root: Path) -> list[int]:
    with_cwd = root / layout.DRAFT_DIR
    return sorted(int(d.name) for d in with_cwd.iterdir() if d.name.isdigit()
                  and (d / train.EPOCH_METRICS).is_file() and (d / "training_state.json").is_file())


@pytest.fixture(scope="module")
def trained(extracted: Path, project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 epochs with a pruned draft vocabulary (exercises the token-frequency vocab mapping)."""
    root = new_project(tmp_path_factory.mktemp("trained"), project_root)
    run_stage(root, "train", **TRAIN, draft_vocab_size=256)
    return root


def test_train_writes_per_step_metrics_and_a_loadable_checkpoint(trained: Path) -> None:
    summary = json.loads((trained / train.TRAIN_METRICS).read_text())
    assert summary["epoch"] == 1 and summary["epochs_trained"] == 2
    for split in ("val", "train"):
        for k in range(TTT):
            for name in ("loss", "full_acc", "cond_acc"):
                assert f"{name}_{k}" in summary[split], (split, name, k)
        assert 0 <= summary[split][f"full_acc_{TTT - 1}"] <= summary[split]["full_acc_0"] <= 1
    with open(trained / train.TRAIN_CURVE) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1] and "val_full_acc_1" in rows[0]

    with contextlib.chdir(trained):
        final = final_draft()
    assert final == layout.DRAFT_DIR / "1"
    from speculators.models.eagle3 import Eagle3DraftModel

    draft = Eagle3DraftModel.from_pretrained(trained / final)
    assert draft.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # extract's [2, N//2, N-3, N] minus N
    assert draft.config.draft_vocab_size == 256 and int(draft.d2t.shape[0]) == 256
    assert not any(p.is_symlink() for p in (trained / layout.DRAFT_DIR).iterdir())


@pytest.mark.parametrize("layer_ids,match", [
    ([2, 4, 5, 7], "do not end with id 8"),  # speculators 0.3's ids taken as vLLM's: final state is id 8
    ([2, 4, 8], r"hidden states \[.*, 4, 64\], expected \[T, 3, 64\]"),  # meta and shards disagree
])
def test_inconsistent_layer_ids_are_rejected(extracted: Path, project_root: Path, tmp_path: Path,
                                             layer_ids: list[int], match: str) -> None:
    root = new_project(tmp_path, project_root)
    meta = shards.read_meta(root / layout.HIDDEN_STATES_DIR)
    shards.write_meta(root / layout.HIDDEN_STATES_DIR, {**meta, "layer_ids": layer_ids})
    with pytest.raises(PipelineError, match=match):
        run_stage(root, "train", **TRAIN)
    assert not (root / layout.DRAFT_DIR).exists()


def test_unverified_hidden_states_are_rejected(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    root = new_project(tmp_path, project_root)
    (root / layout.VERIFY_VERDICT).write_text(json.dumps({"passed": True, "run_key": "other"}))
    with pytest.raises(PipelineError, match="does not vouch"):
        run_stage(root, "train", **TRAIN)


# The stage with one override left out, in a fresh process: an in-process vLLM CPU engine (the
# extract fixture runs one) replaces torch.accelerator.synchronize and Tensor.pin_memory for good.
WITHOUT_ONE = (
    "import functools, sys; from pipeline.training import speculators_cpu as c; from pipeline.cli import main; "
    "c.cpu_training = functools.partial(c.cpu_training, skip={sys.argv[1]}); main(['train'])"
)


@pytest.mark.skipif(not speculators_cpu.needed(), reason="the overrides apply only without an accelerator")
@pytest.mark.parametrize("override,where", [
    ("device", "in setup_model"),  # model.to(0)
    ("synchronize", "in mark"),  # _StepTimer.mark at the first logged step
    ("checkpoint", "in load_safetensors_state_dict"),  # resume loads to "cuda:0" with pinned memory
])
def test_each_cpu_override_is_needed(trained: Path, tmp_path: Path, override: str, where: str) -> None:
    root = tmp_path / "p"
    shutil.copytree(trained, root, symlinks=True)
    shutil.rmtree(root / layout.DRAFT_DIR / "1")  # as if killed during epoch 1: a resume is due
    epoch0 = (root / layout.DRAFT_DIR / "0" / "model.safetensors").stat().st_mtime_ns
    (root / "params.yaml").write_text(yaml.safe_dump({"train": {**TRAIN, "draft_vocab_size": 256}}))

    # the script imports speculators_cpu (and torch) before the entry could pin the CPU arithmetic: pinned beforehand,
    # as the entry pins it for `python -m pipeline train`
    env = {**os.environ, **cpu_determinism.PINNED_ENV}
    out = subprocess.run([sys.executable, "-c", WITHOUT_ONE, override], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode != 0
    # the console names the error and the stage's log (pipeline/console.py), which holds the traceback
    assert "[train] failed: RuntimeError" in out.stderr and "accelerator" in out.stderr, out.stderr[-3000:]
    trace = (root / "logs" / "train.log").read_text()
    assert where in trace and "RuntimeError" in trace and "accelerator" in trace, trace[-3000:]

    # with all three the same run resumes: test_sigkill_then_rerun_resumes
    assert (root / layout.DRAFT_DIR / "0" / "model.safetensors").stat().st_mtime_ns == epoch0


def test_sigkill_then_rerun_resumes(extracted: Path, project_root: Path, tmp_path: Path,
                                    caplog: pytest.LogCaptureFixture) -> None:
    root = new_project(tmp_path, project_root)
    epochs = 5
    (root / "params.yaml").write_text(yaml.safe_dump({"train": {**TRAIN, "epochs": epochs}}))
    env = {**os.environ, "COLUMNS": "250"}  # rich wraps log lines at 80 columns otherwise
    cmd = [sys.executable, "-m", "pipeline", "train"]

    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = root / layout.DRAFT_DIR / "0" / train.EPOCH_METRICS
    deadline = time.monotonic() + 300
    while not first.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = epoch_dirs(root)
    assert done and done[-1] < epochs - 1, f"the kill came too late to test a resume: {done}"
    assert not (root / train.FINAL_POINTER).exists()
    mtimes = {e: (root / layout.DRAFT_DIR / str(e) / "model.safetensors").stat().st_mtime_ns for e in done}

    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    # the stage's own line on the console, speculators' own log in the stage's log file (pipeline/console.py)
    trainer_log = (root / "logs" / "train.log").read_text()
    assert f"resuming after epoch {done[-1]}" in out.stdout and f"Resuming training on epoch {done[-1] + 1}." in trainer_log
    assert "Starting fresh training run" not in trainer_log and "Resuming training" not in out.stdout + out.stderr
    assert {e: (root / layout.DRAFT_DIR / str(e) / "model.safetensors").stat().st_mtime_ns for e in done} == mtimes
    assert epoch_dirs(root) == list(range(epochs))
    assert json.loads((root / train.FINAL_POINTER).read_text())["epoch"] == epochs - 1
    with open(root / train.TRAIN_CURVE) as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(epochs))

    # a params change must not resume the stale run
    caplog.set_level(logging.INFO)
    run_stage(root, "train", **{**TRAIN, "lr": 2e-3})
    assert "inputs changed since the last run" in caplog.text and "Starting fresh training run" in caplog.text
    assert epoch_dirs(root) == [0, 1]
    assert (root / layout.DRAFT_DIR / "0" / "model.safetensors").stat().st_mtime_ns != mtimes[0]


@pytest.mark.skipif(not speculators_cpu.needed(), reason="the refusal applies only without an accelerator")
def test_fused_loss_without_a_gpu_is_refused_and_the_trained_draft_kept(trained: Path, tmp_path: Path) -> None:
    root = tmp_path / "p"
    shutil.copytree(trained, root, symlinks=True)
    final = (root / train.FINAL_POINTER).read_bytes()
    weights = {p: p.stat().st_mtime_ns for p in (root / layout.DRAFT_DIR).rglob("*.safetensors")}
    (root / "params.yaml").write_text(yaml.safe_dump({"train": {**TRAIN, "draft_vocab_size": 256, "loss_implementation": "fused"}}))
    out = subprocess.run([sys.executable, "-m", "pipeline", "train"], cwd=root, capture_output=True, text=True)
    assert out.returncode != 0
    assert "train.loss_implementation is fused" in out.stderr and "set it to eager" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert (root / train.FINAL_POINTER).read_bytes() == final
    assert {p: p.stat().st_mtime_ns for p in (root / layout.DRAFT_DIR).rglob("*.safetensors")} == weights
