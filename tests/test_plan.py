"""Capacity planning (pipeline/planning/plan.py) and the extract stage's refusal to start without the space.

The refusal is tested through the real CLI entry (`python -m pipeline run extract`, launcher
included) in a child process, on a real filesystem too small for the projection (a tmpfs sized
below it, mounted at the project's artifacts/: needs root, as CI runs); the projection is checked
against the bytes a real extraction of the same data wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.extraction import capacity
from pipeline.params import Params
from pipeline.planning import plan
from tests.conftest import EXTRACT_PARAMS, copy_project

ROOT = Path(__file__).resolve().parents[1]
# runs the CLI as `python -m pipeline` does, then says whether vLLM was ever imported: no engine
# can start without it, so False proves the refusal came before any engine
DRIVER = (
    "import runpy, sys\n"
    "sys.argv = ['pipeline', 'run', 'extract']\n"
    "try:\n"
    "    runpy.run_module('pipeline', run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    print(f'EXIT={e.code} VLLM_IMPORTED={\"vllm\" in sys.modules}')\n"
)


def project_copy(project_root: Path, dst: Path) -> Path:
    root = copy_project(project_root, dst, layout.TARGET_JSON, layout.PREPARED_DIR)
    (root / "params.yaml").write_text(yaml.safe_dump({"extract": EXTRACT_PARAMS}))
    return root


def projected(root: Path, **kw) -> plan.Plan:
    with contextlib.chdir(root):
        return plan.build_plan(Params.model_validate({"extract": EXTRACT_PARAMS}), **kw)


def test_extract_refuses_before_any_engine_when_the_disk_is_too_small(tmp_path, tiny_target, prepared, project_root):
    need = projected(project_copy(project_root, tmp_path / "sized"), tok_per_s=1.0).need
    assert need.shard_bytes > 0 and need.required > need.needed > need.shard_bytes
    # artifacts/ on a tmpfs that holds the project's inputs and a few pages less than the projection
    root = tmp_path / "p"
    disk = root / "artifacts"
    disk.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs (CI runs as root): {mounted.stderr}")
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr}")
    try:
        project_copy(project_root, root)
        (root / "params.yaml").write_text(yaml.safe_dump({"extract": EXTRACT_PARAMS}))
        used = shutil.disk_usage(disk).used
        size = (used + need.required) // 4096 * 4096 - 2 * 4096
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
        free = capacity.free_bytes(root / layout.HIDDEN_STATES_DIR)
        assert free < need.required, (free, need.required)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert "EXIT=1 VLLM_IMPORTED=False" in proc.stdout, proc.stdout + proc.stderr
        msg = " ".join(proc.stderr.split())
        assert "not enough free space for the extraction" in msg
        assert plan.human_bytes(need.shard_bytes) in msg, msg
        for hint in ("data.max_samples", "data.seq_len", "extract.layer_ids", "extract.dtype", "free_space_margin"):
            assert hint in msg, hint
        # nothing written: no output, no work directory, no scratch, no metrics
        assert not os.path.lexists(root / layout.HIDDEN_STATES_DIR)
        assert not (root / "artifacts" / ".partial").exists()
        assert not (root / "artifacts" / "hidden_states.scratch").exists()
        assert not (root / layout.METRICS / "extract.json").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_projection_matches_a_real_extraction(tmp_path, tiny_target, prepared, project_root, extracted, extract_metrics):
    """Projected before any shard exists (overhead measured on a shard the writer makes for it),
    then compared with what the real extraction of the same data and params wrote."""
    p = projected(project_copy(project_root, tmp_path / "p"), tok_per_s=1.0)
    files = sorted(extracted.glob("shard-*"))
    written = sum(f.stat().st_size for f in files)
    assert p.projection.tokens == extract_metrics["tokens"] and p.projection.samples == extract_metrics["samples"]
    assert p.projection.bytes_per_token == 4 * 64 * 4 + 9  # 4 layers x hidden 64 x float32 + ids and mask
    assert p.projection.bytes_per_token < extract_metrics["bytes_per_token"]  # the stage's figure counts the headers
    assert abs(p.projection.bytes - written) / written < 0.005, (p.projection.bytes, written)
    assert p.need.fits and p.need.reclaimed_bytes == 0

    # in the extracted project: its own shards are kept (nothing new to write), its tok/s is reused
    here = projected(project_root)
    assert here.need.kept_bytes == written and here.need.shard_bytes == 0
    assert here.throughput.tok_per_s == extract_metrics["tok_per_s"] and "last extraction" in here.throughput.source
    assert here.seconds == 0  # all done here
    # --tok-per-s 1 there: compute-bound (tokens s against ~1e-4 s of writes at 1 GB/s), plus the drain of the
    # largest shard, which is the largest one the real extraction wrote
    assert p.largest_shard_bytes == pytest.approx(max(f.stat().st_size for f in files if f.suffix == ".safetensors"), rel=0.005)
    assert p.time.bound == "compute" and p.time.drain_s == p.largest_shard_bytes / 1e9
    assert p.seconds == pytest.approx(p.projection.tokens / 1.0 + p.time.drain_s)
    # the last extraction's own tok/s already counts its writes: tokens / tok/s, nothing added
    assert here.throughput.includes_writes and not p.throughput.includes_writes


def test_real_scale_projection_from_the_cli(tmp_path):
    """The documented Kimi-K2.5-shaped example (docs/PLANNING.md): no model or data needed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    args = ["--config", str(ROOT / "examples" / "kimi-k2.5-config.json"), "--tokens", "1e9", "--dtype", "bfloat16",
            "--layer-ids", "2,30,58,61", "--weights-gib", "594", "--gpu-gib", "141", "--tok-per-s", "20000", "--json"]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--params", str(ROOT / "params.yaml"), "plan", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / plan.PLAN_JSON).read_text())
    per_token = 4 * 7168 * 2 + 9
    assert out["projection"]["bytes_per_token"] == per_token
    assert per_token * 10**9 < out["projection"]["bytes"] < per_token * 10**9 * 1.001
    assert "57.35 TB" in proc.stdout and "NO" in proc.stdout  # does not fit this machine's disk
    # 20k tok/s x 57,353 B = 1.15 GB/s, over plan.write_gb_per_s (1.0): the writes bound it, plus one shard's drain
    # (data.seq_len 512 x extract.samples_per_shard 64 tokens)
    time = out["time"]
    assert time["bound"] == "writes" and time["compute_s"] == 10**9 / 20000
    assert time["write_s"] == pytest.approx(out["projection"]["bytes"] / 1e9)
    assert time["drain_s"] == pytest.approx(512 * 64 * per_token / 1e9, rel=0.01)
    assert out["seconds"] == pytest.approx(time["write_s"] + time["drain_s"])
    assert "plan.write_gb_per_s" in proc.stdout
    # a faster host (plan.write_gb_per_s 4): the compute bounds it
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["plan"]["write_gb_per_s"] = 4.0
    (tmp_path / "fast.yaml").write_text(yaml.safe_dump(params))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--params", str(tmp_path / "fast.yaml"), "plan", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fast = json.loads((tmp_path / plan.PLAN_JSON).read_text())
    assert fast["time"]["bound"] == "compute"
    assert fast["seconds"] == pytest.approx(10**9 / 20000 + time["drain_s"] / 4)


# The H200 runs the time model was checked on (docs/BENCHMARKS.md "The plan's time model"): tokens, the engine's
# rate (plain prefill; the engine inside the stage for the TP runs, which had no plain run), bytes written, the
# largest shard, and the measured time: tokens / the stage's own tok/s (until its last shard was written).
H200_RUNS = {
    "seed shape, depth 4": (131_072, 79_942.6, 5_638_365_336, 1_409_585_248, 131_072 / 15_966.9),
    "8B, 1M tokens, fresh machine": (1_048_576, 43_594, 34_369_175_552, 1_074_036_736, 1_048_576 / 35_735),
    "8B, DVC cost run": (368_640, 43_594, 12_083_377_961, 268_509_184, 368_640 / 35_175.5),
    "8B, TP=1 eager": (262_144, 42_188, 8_592_228_352, 537_018_368, 262_144 / 29_150),
    "8B, TP=2 eager": (262_144, 65_444, 8_592_228_352, 537_018_368, 262_144 / 32_222),
}


@pytest.mark.parametrize("run", sorted(H200_RUNS))
def test_time_model_at_the_default_write_rate_is_within_25_percent_of_the_h200_runs(run):
    from pipeline.params import PlanParams
    from pipeline.planning.extract_time import extraction_time

    tokens, tok_s, nbytes, shard, measured = H200_RUNS[run]
    t = extraction_time(tokens, tok_s, False, nbytes, shard, PlanParams().write_gb_per_s)
    assert abs(t.seconds / measured - 1) <= 0.25, (t, measured)
    # the sum of compute and writes would not be: 1.6-2.0x on the 8B runs (the seed run's is short of compute)
    if "8B" in run:
        assert (t.compute_s + t.write_s) / measured > 1.25


def test_time_model_parts():
    from pipeline.planning.extract_time import extraction_time

    compute_bound = extraction_time(1000, 10.0, False, 10**9, 10**8, 1.0)
    assert compute_bound.bound == "compute" and compute_bound.seconds == pytest.approx(100 + 0.1)
    write_bound = extraction_time(1000, 1000.0, False, 10**10, 10**9, 2.0, startup_s=30)
    assert write_bound.bound == "writes" and write_bound.seconds == pytest.approx(5 + 0.5 + 30)
    measured = extraction_time(1000, 10.0, True, 10**12, 10**11, 1.0, startup_s=5)
    assert measured.write_s is None and measured.seconds == 105
