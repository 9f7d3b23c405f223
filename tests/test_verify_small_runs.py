"""A user's first run on a handful of samples: clean data passes verify, and the tests too few samples cannot calibrate
are said, not run, as `dvc repro` meets it.

Per architecture the embedded target as params.yaml builds it, trained by the model stage for a tenth of the default's
steps or less (a weakly trained target's states are the least predictable from each other), and a narrower Llama
(hidden 64), then clean runs
of several sizes (`data.max_samples`), data seeds and stored dtypes, each through `dvc repro verify` (check, prepare,
extract, verify), some judged again under another `verify.seed` (other folds, halves, judged positions and reference
samples: only verify re-runs). About 5 min on the 2-core CPU. Every run must pass, with the whole-sample tests reported not run
(each sample is one of their scores, and their threshold is fitted to the tail of 300: judged at the normal z* with
the median of 8-24 samples a fold, clean runs of these sizes failed, docs/ARCHITECTURE.md "Per-sample tests: what is
caught, what cannot be") in the stage's lines, the report, metrics/verify.json and the verdict; a clean sample the
per-sample tests flag is cleared by the reference forward of its own tokens and said so.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_dvc_invalidation import TINY, merge
from tests.test_verify_architectures import plant_every_class, verify_names_every_victim

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WHOLE_MIN_SAMPLES = 300
TRAIN_STEPS = {"llama": 30, "deepseek_v3": 20}  # the default: 300 (here the model stage takes 23 s and 34 s)
# (data.max_samples, data.seed, extract.dtype, verify.seed of each verify run of that extraction). The DeepSeek-V3
# trained 20 steps stored in fp8: its clean residuals are a tenth of fp8's rounding energy, most positions sit on the
# rounding's floor, and its tests are judged with the rounding's own uncertainty as their least sigma
# (docs/ARCHITECTURE.md "Small runs: tests not run")
RUNS = {
    "llama": [(8, 0, "float32", (0,)), (24, 1, "float8_e4m3", (0,))],
    "deepseek_v3": [(12, 0, "bfloat16", (0, 1)), (16, 1, "float32", (0,)), (40, 2, "float8_e4m3", (0,))],
    # tests/test_dvc_invalidation.py's TINY project (hidden 64, 30 steps): one clean sample the other samples' linear
    # maps explain poorly, flagged by the window test (z 7.9 > 6.4); the reference forward of its tokens agrees with its
    # states, and it is cleared
    "llama_narrow": [(16, 1, "bfloat16", (1,))],
}
# planted into the last run of the DeepSeek-V3 (fp8): the classes its coherence tests judge. Rows shifted by a token and
# every layer from another request are the token identity's, which needs a target that predicts its next token: trained
# 20 steps, it misses both in bf16 as in fp8 (docs/ARCHITECTURE.md)
COHERENCE_FAULTS = ["zeros", "cut_short", "layers_exchanged", "layer_from_other_request", "noise"]


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, timeout=900)


def set_params(root: Path, **values) -> None:
    """`values` as "section.key" (with "__" for the dots) -> value, written into the project's params.yaml."""
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in values.items():
        *head, last = dotted.split("__")
        d = params
        for part in head:
            d = d[part]
        d[last] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module", params=list(RUNS))
def project(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    root = tmp_path_factory.mktemp(f"small-{name}")
    for part in ("pipeline", "data", "bin"):
        shutil.copytree(ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    architecture = "llama" if name == "llama_narrow" else name
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()),
                   {"model": {"embedded": {"architecture": architecture, "train_steps": TRAIN_STEPS[architecture]}}})
    if name == "llama_narrow":  # tests/test_dvc_invalidation.py's TINY project: hidden 64, 30 steps
        params = merge(params, copy.deepcopy(TINY))
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([str(BIN / "dvc"), "init", "--no-scm", "-q"], cwd=root, check=True)
    return name, root


def test_clean_small_runs_pass_and_say_which_tests_did_not_run(project):
    architecture, root = project
    for samples, data_seed, dtype, verify_seeds in RUNS[architecture]:
        for verify_seed in verify_seeds:
            set_params(root, data__max_samples=samples, data__seed=data_seed, extract__dtype=dtype, verify__seed=verify_seed)
            proc = dvc(root, "repro", "verify")
            out = proc.stdout + proc.stderr
            run = f"{architecture}, {samples} samples, data seed {data_seed}, {dtype}, verify seed {verify_seed}"
            assert proc.returncode == 0, f"{run}: clean data failed verify\n{out[-4000:]}"
            metrics = json.loads((root / "metrics" / "verify.json").read_text())
            verdict = json.loads((root / "artifacts" / "verify" / "verdict.json").read_text())
            assert metrics["num_samples"] == samples and metrics["dtype"] == dtype, run
            assert metrics["verdict"] == verdict["verdict"] == "passed, with these tests not run", run
            assert metrics["tests_not_run"] == verdict["tests_not_run"], run
            whole = [t for t in metrics["tests_not_run"] if t["test"].startswith("the whole-sample tests")]
            assert len(whole) == 1 and (whole[0]["have"], whole[0]["needs"], whole[0]["unit"]) == (
                samples, WHOLE_MIN_SAMPLES, "samples"), (run, metrics["tests_not_run"])
            assert metrics["sample_tests"]["max_whole_sample_z"] is None, run
            assert "[verify] passed, with these tests not run:" in out, run
            assert f"this run has {samples} samples, it runs from {WHOLE_MIN_SAMPLES}" in out, run
            report = (root / "reports" / "verify" / "report.md").read_text()
            assert report.startswith("# Hidden-state verification: PASSED, with these tests not run"), run
            assert "## Tests not run" in report and f"it runs from {WHOLE_MIN_SAMPLES}" in report, run
            if architecture == "llama_narrow":  # flagged, re-run through the reference forward, cleared
                assert metrics["num_cleared"] >= 1 and metrics["checks"]["samples"] == "pass", run
                assert "[verify] flagged, then cleared:" in out and "## Flagged, then cleared by the reference forward" in report, run
    if architecture == "deepseek_v3":  # fp8 below its rounding: the faults are still caught, each sample named
        references = yaml.safe_load((root / "params.yaml").read_text())["verify"]["reference_samples"]
        verify_names_every_victim(root, plant_every_class(root, references, COHERENCE_FAULTS), references)
