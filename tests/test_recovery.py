"""Accidents recovered by typing the command again, and bad data refused early: real `dvc repro`
of the real stages on the embedded default at tiny params, driven as a user drives it.

A kill is SIGKILL to the process group of `dvc repro` (DVC, the stage, vLLM) at an observed point:
a finished shard kept in `artifacts/.partial/hidden_states`. No hook in the product code. After
each accident the same command, typed again, must succeed without `--force`, and `dvc status`
must show only what the user changed (docs/RELIABILITY.md, "Crashes").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.hidden_states import format as shards

HS = Path("artifacts/hidden_states")
PARTIAL = Path("artifacts/.partial/hidden_states")
SCRATCH = Path("artifacts/hidden_states.scratch")
LOCK = Path("artifacts/hidden_states.lock")
STUCK = "without a confirmation"
TRACEBACK = "Traceback (most recent call last)"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_pipeline) -> Path:
    """The default project at tiny params (tests/conftest.py `tiny_pipeline`, every stage run once, copied), then
    extracted again at 2 samples a shard (check and extract re-run; model, regenerate and prepare are up to date)."""
    root = Path(shutil.copytree(tiny_pipeline, tmp_path_factory.mktemp("recovery") / "tiny", symlinks=True))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["extract"]["samples_per_shard"] = 2  # 12 shards of the 24 samples: room to kill between them
    # engine tuning (changes no byte) that makes the tiny extraction last long enough for a kill to
    # land between shards on a fast machine: one request at a time
    params["extract"].update(max_num_seqs=1, max_num_batched_tokens=512)
    params["runtime"]["mode"] = "native"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    first = dvc(root, "repro", "extract")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Running stage 'extract'" in first.stdout and "Running stage 'model'" not in first.stdout, first.stdout
    return root


def dvc_bin() -> str:
    return str(Path(sys.executable).parent / "dvc")


def env(root: Path) -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(root), "TQDM_DISABLE": "1"}


def dvc(root: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([dvc_bin(), *args], cwd=root, env=env(root), capture_output=True, text=True,
                          timeout=timeout)


def kill_when(root: Path, appears: Path, *args: str) -> None:
    """`dvc <args>` in its own process group, SIGKILLed as a whole once `appears` exists."""
    assert not (root / appears).exists(), f"{appears} is there already: the kill would prove nothing"
    p = subprocess.Popen([dvc_bin(), *args], cwd=root, env=env(root), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while not (root / appears).exists():
            if p.poll() is not None:
                pytest.fail(f"`dvc {' '.join(args)}` ended (rc {p.returncode}) before {appears} appeared: "
                            f"{p.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline, f"{appears} never appeared"
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.stderr.close()


def set_param(root: Path, section: str, key: str, value) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def up_to_date(root: Path, *stages: str) -> None:
    st = dvc(root, "status", *stages)
    assert st.returncode == 0 and "Data and pipelines are up to date." in st.stdout, st.stdout + st.stderr


def retype(root: Path, *args: str) -> str:
    """The command typed again: it must succeed without --force. Returns its output."""
    r = dvc(root, *args)
    out = r.stdout + r.stderr
    assert STUCK not in out, out[-3000:]
    assert r.returncode == 0, out[-3000:]
    return out


def extract_metrics(root: Path) -> dict:
    return json.loads((root / "metrics/extract.json").read_text())


def test_killed_forced_rerun_of_a_finished_extraction_is_restored(project: Path) -> None:
    lock_before = (project / "dvc.lock").read_text()
    kill_when(project, PARTIAL / "shard-00002.json", "repro", "-f", "-s", "extract")
    assert (project / PARTIAL / "shard-00002.json").is_file() and not (project / HS).is_symlink()
    out = retype(project, "repro", "extract")
    assert "Stage 'extract' is cached - skipping run, checking out outputs" in out, out[-3000:]
    up_to_date(project, "extract")
    assert (project / "dvc.lock").read_text() == lock_before
    # a restore runs no command of ours: what the killed run left beside the output (its links, now
    # redundant, vLLM's scratch folder, the lock file) goes with the next stage run through the launcher
    left = (PARTIAL, SCRATCH, LOCK)
    assert all((project / p).exists() for p in left)
    retype(project, "repro", "-f", "-s", "regenerate")  # instant with regeneration off
    assert not any((project / p).exists() for p in left)
    assert not (project / "artifacts" / ".partial").exists()
    up_to_date(project, "extract", "regenerate")


def test_killed_first_run_after_a_param_change_resumes(project: Path) -> None:
    set_param(project, "extract", "samples_per_shard", 3)
    kill_when(project, PARTIAL / "shard-00001.json", "repro", "extract")
    # a shard is kept when both its files are: the mirror's listing can race the stage's renames and link a
    # manifest without the data written just before it (that shard is then recomputed, not resumed)
    kept = len(shards.complete_shards(project / PARTIAL))
    out = retype(project, "repro", "extract")
    assert "Running stage 'extract'" in out, out[-3000:]
    m = extract_metrics(project)
    assert kept >= 1 and m["shards_resumed"] == kept and m["shards_written"] == 8 - kept, (kept, m)
    up_to_date(project, "extract")
    assert not (project / PARTIAL).exists(), "a completed run keeps no links"


def test_killed_run_after_a_param_changed_and_back_restores_the_cached_result(project: Path) -> None:
    set_param(project, "extract", "samples_per_shard", 4)
    kill_when(project, PARTIAL / "shard-00001.json", "repro", "extract")
    set_param(project, "extract", "samples_per_shard", 3)
    out = retype(project, "repro", "extract")
    assert "Stage 'extract' is cached - skipping run, checking out outputs" in out, out[-3000:]
    up_to_date(project, "extract")
    retype(project, "repro", "-f", "-s", "regenerate")  # drops the redundant links
    assert not (project / PARTIAL).exists()


def test_engine_start_failure_is_a_message_and_fixing_it_restores(project: Path) -> None:
    """A setting vLLM refuses at engine start (here a batch of more requests than tokens; on a GPU
    cluster memory, a parallel layout, a busy device): a message naming the params, and after the
    fix `dvc repro` restores the cached result the failed run had replaced."""
    # engine tuning re-runs nothing (pipeline/workflow/invalidation.py), so the user forces the run
    set_param(project, "extract", "max_num_seqs", 4096)  # > extract.max_num_batched_tokens (512)
    t0 = time.monotonic()
    r = dvc(project, "repro", "-f", "-s", "extract")
    seconds = time.monotonic() - t0
    assert r.returncode != 0
    err = r.stderr
    assert "[extract] error: the vLLM engine did not start: " in err, err[-3000:]
    assert "max_num_batched_tokens (512) must be greater than or equal to max_num_seqs (4096)" in err, err[-3000:]
    assert "extract.max_num_seqs=4096" in err and "re-run" in err, err[-3000:]
    assert TRACEBACK not in err and "pydantic_core" not in err, err[-3000:]
    assert seconds < 300, f"refused after {seconds:.0f} s"
    set_param(project, "extract", "max_num_seqs", 1)
    out = retype(project, "repro", "extract")
    assert "Running stage 'extract'" not in out, out[-3000:]  # restored from the cache, not run again
    up_to_date(project, "extract")


@pytest.mark.parametrize("bad, named", [
    (b'{"messages": [{"role": "user", "content": "caf\xe9?"}, {"role": "assistant", "content": "Oui."}]}\n',
     "data/chat.jsonl:601: not UTF-8 text (byte 0xe9 at column 47)"),
    (b'{"messages": [{"role": "user", "content": "Hi"}]}\n', "data/chat.jsonl:601: has no assistant turn"),
    (b'{"messages": [\n', "data/chat.jsonl:601: not valid JSON"),
    (None, "data.path: data/chat.jsonl is empty"),
])
def test_a_bad_data_file_is_refused_in_seconds_before_the_target_is_touched(project: Path, bad, named) -> None:
    data = project / "data" / "chat.jsonl"
    good = data.read_bytes()
    model_lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["model"]
    try:
        data.write_bytes(b"" if bad is None else good + bad)
        t0 = time.monotonic()
        r = dvc(project, "repro", "prepare")
        seconds = time.monotonic() - t0
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-3000:]
        # an empty file is refused by the check stage already (before any stage), the rest by prepare
        stage = "check" if bad is None else "prepare"
        assert f"[{stage}] error: " in r.stderr and named in r.stderr, out[-3000:]
        assert TRACEBACK not in out, out[-3000:]
        assert "Running stage 'model'" not in out, "the embedded target does not train on data.path"
        assert seconds < 180, f"refused after {seconds:.0f} s"  # generous: a loaded 2-core machine
    finally:
        data.write_bytes(good)
    retype(project, "repro", "prepare")
    up_to_date(project, "model", "regenerate", "prepare")
    assert yaml.safe_load((project / "dvc.lock").read_text())["stages"]["model"] == model_lock

