"""The sweep's grid and its table, built from metrics files real stage runs wrote.

The full `make sweep` (DVC experiments over the whole pipeline) takes many minutes even on tiny
params; its real run is in docs/EXPERIMENTS.md ("A run on CPU"). Here: extract (conftest's real vLLM
extraction) + verify on the shared tiny target, train + eval on tests/tiny_project.py's target.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.workflow import sweep
from tests.conftest import copy_project, run_stage
from tests.tiny_project import make_project


def test_default_grid_keeps_the_final_layer_and_is_valid():
    assert sweep.default_grid(8) == [[2, 4, 5, 8], [3, 5, 6, 8], [1, 2, 3, 8]]
    assert sweep.default_grid(61) == [[2, 30, 58, 61], [3, 31, 59, 61], [1, 2, 3, 61]]
    assert sweep.parse_grid("2,4,5,8; 1,2,3,8;") == [[2, 4, 5, 8], [1, 2, 3, 8]]
    assert sweep.exp_name([2, 4, 5, 8], 5) == "sweep-l2-4-5-8-e5"


@pytest.mark.slow
def test_table_from_real_stage_metrics(tmp_path: Path, extracted: Path, project_root: Path, cycle_target: Path):
    ev = copy_project(project_root, tmp_path / "ev", layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR,
                      layout.METRICS / "extract.json")
    run_stage(ev, "verify", reference_samples=2)
    tiny = make_project(tmp_path / "tiny", n_heldout=4, target=cycle_target)
    run_stage(tiny, "train", epochs=1, ttt_steps=2, max_len=64, val_fraction=0.25, lr=5e-3)
    run_stage(tiny, "eval", num_speculative_tokens=2, num_prompts=4, max_tokens=8)

    point = tmp_path / "point"
    for src, key in ((ev, "extract"), (ev, "verify"), (tiny, "train"), (tiny, "eval")):
        (point / sweep.FILES[key]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / sweep.FILES[key], point / sweep.FILES[key])
    files = {k: json.loads((point / p).read_text()) for k, p in sweep.FILES.items()}

    got = sweep.collect(point)
    assert got["verify"] == ("passed" if files["verify"]["passed"] else "FAILED")
    assert got["verify_layer_ids"] == files["verify"]["layer_ids"] == [2, 4, 5, 8]
    assert got["train_full_acc"] == [files["train"]["val"]["full_acc_0"], files["train"]["val"]["full_acc_1"]]
    assert got["tau"] == files["eval"]["tau"] and got["speedup"] == files["eval"]["speedup"]
    assert got["extract_tok_per_s"] == files["extract"]["tok_per_s"]

    row = {"name": "sweep-l2-4-5-8", "layer_ids": [2, 4, 5, 8], "returncode": 0, "stages_run": ["extract", "verify"],
           "wall_s": 12.3, **got}
    md = sweep.markdown([row]).splitlines()
    assert md[0].startswith("| experiment | layer ids | verify | train acc per step | tau |")
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert cells[:3] == ["sweep-l2-4-5-8", "[2, 4, 5, 8]", got["verify"]]
    assert cells[3] == " / ".join(f"{a:.3f}" for a in got["train_full_acc"])
    assert cells[4] == f"{files['eval']['tau']:.3f}" and cells[8] == "extract, verify"

    # a point whose eval did not run: blanks, not the previous point's numbers
    (point / sweep.FILES["eval"]).unlink()
    partial = {**row, **sweep.collect(point), "returncode": 1, "failed_stage": "eval"}
    cells = [c.strip() for c in sweep.markdown([partial]).splitlines()[2].strip("|").split("|")]
    assert cells[4] == "-" and cells[5] == "-" and "(eval failed, exit 1)" in cells[2]
