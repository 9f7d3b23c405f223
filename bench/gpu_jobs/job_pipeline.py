"""bench job pipeline: the whole pipeline through `dvc repro`, stage by stage, in a project that outlives the call.

The project lives outside the checkout (`--pipeline-dir`, /tmp/pipeline21 by default): the device tool copies the
checkout over on every call, and dvc.lock is tracked there, so a project inside it would lose its state. It is the
repo's dvc.yaml, pipeline/, data/ and bin/ (copied again on every call: a changed stage's code re-runs that stage,
as in any checkout), `params.gpu.yaml` as its params.yaml (`--smoke`: the CPU default, params.yaml), `dvc init
--no-scm` (the host has no git), cache.type hardlink,symlink (docs/SHARING.md, "Disk: the cache type") and a .venv/bin/python that runs
the bench's interpreter (bin/python would else take any `python` on the host's PATH).

Each stage is its own child step (`pipeline:<stage>`): `python3 -m dvc repro <stage>`, so DVC runs whatever
upstream of it is stale and skips what is done: a later call on the same warm machine resumes after the last
finished stage. DVC runs a cmd as `$SHELL -c CMD`; a SHELL that notes when each cmd starts and ends
(bench/dvc_cost.py's) gives the stage's own wall beside DVC's (`dvc repro`'s wall minus its cmds'). A stage whose
expected time is more than what the deadline leaves is not started. Every call packs metrics/, reports/, dvc.lock,
params.yaml and the timings of every call so far (pipeline_timings.json in the project) into $OUT/pipeline.tar.gz.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from dvc_cost import TIMING_SHELL

from gpu_jobs.common import REPO, log

STAGES = ("model", "regenerate", "prepare", "extract", "verify", "train", "eval")
# about what each takes on one H200 with params.gpu.yaml (docs/BENCHMARKS.md "The whole pipeline on one H200"): a
# stage is started only with this much of the deadline left; smoke (CPU default, 2 cores): seconds to minutes, never
# refused (model..verify as measured on the H200, 2026-12-03; train and eval estimates)
EXPECTED_S = {"model": 150, "regenerate": 90, "prepare": 15, "extract": 80, "verify": 30, "train": 180, "eval": 330}
TIMINGS = "pipeline_timings.json"
COPIED = ("dvc.yaml", "pipeline", "data", "bin")


def dvc(proj: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=proj, **kw)


def dvc_env(work: Path) -> dict:
    # no network on the host; DVC's site cache under the bench's work dir, not /var/tmp/dvc
    return {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_SITE_CACHE_DIR": str(work / "dvc-site-cache")}


def setup_project(proj: Path, params_file: Path, work: Path) -> None:
    proj.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src, dst = REPO / name, proj / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
        else:
            shutil.copy2(src, dst)
    # bin/python runs .venv/bin/python where there is one: this interpreter, not whatever `python` the host has
    venv_python = proj / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True, exist_ok=True)
    venv_python.unlink(missing_ok=True)
    # a script, not a link: a linked venv python finds no pyvenv.cfg beside the link and loses its site-packages
    venv_python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    venv_python.chmod(0o755)
    params = proj / "params.yaml"
    if not params.is_file() or params.read_bytes() != params_file.read_bytes():
        shutil.copy2(params_file, params)
    env = dvc_env(work)
    if not (proj / ".dvc").is_dir():
        dvc(proj, "init", "--no-scm", "-q", env=env, check=True)
    dvc(proj, "config", "cache.type", "hardlink,symlink", env=env, check=True)
    (proj / "timing-shell").write_text(TIMING_SHELL)
    (proj / "timing-shell").chmod(0o755)


def is_up_to_date(proj: Path, stage: str, work: Path) -> bool:
    """`dvc status <stage>` (it and its upstream) reports nothing: `dvc repro` would run nothing."""
    proc = dvc(proj, "status", "--json", stage, env=dvc_env(work), capture_output=True, text=True)
    return proc.returncode == 0 and json.loads(proc.stdout or "{}") == {}


def collect(proj: Path, out: Path) -> None:
    """One archive, $OUT/pipeline.tar.gz: the GPU host returns only a few files per command, so metrics/ and
    reports/ copied one by one could be left behind."""
    with tarfile.open(out / "pipeline.tar.gz", "w:gz") as tar:
        for name in ("dvc.lock", "params.yaml", TIMINGS, "metrics", "reports"):
            if (proj / name).exists():
                tar.add(proj / name, arcname=f"pipeline/{name}")


def run_pipeline(bench) -> None:
    """Parent side of `--jobs pipeline`: set the project up, then one child per stage, in order, while time is left."""
    args, work = bench.args, bench.work
    proj = Path(args.pipeline_dir) if args.pipeline_dir else (work / "pipeline-smoke" if args.smoke else Path("/tmp/pipeline21"))
    params_file = REPO / ("params.yaml" if args.smoke else "params.gpu.yaml")
    setup_project(proj, params_file, work)
    bench.state.update(pipeline_dir=str(proj))
    bench.results["pipeline"] = {"project": str(proj), "params": params_file.name}
    for stage in STAGES:
        done = is_up_to_date(proj, stage, work)
        need = 10 if done or args.smoke else EXPECTED_S[stage]
        bench.child(f"pipeline:{stage}", 590, need)
        result = bench.results["jobs"].get(f"pipeline:{stage}")
        if not result or result.get("summary", {}).get("rc") != 0:
            log(f"pipeline: stopping after {stage} (not finished; a later call resumes here)")
            break
    collect(proj, bench.out)
    timings = proj / TIMINGS
    bench.results["pipeline"]["timings"] = json.loads(timings.read_text()) if timings.is_file() else {}
    bench.save()


def job_pipeline(state: dict, stage: str) -> dict:
    """Child side: `python3 -m dvc repro <stage>` in the project, its wall, each cmd's wall, DVC's share."""
    proj, work = Path(state["pipeline_dir"]), Path(state["work"])
    marks = proj / f"cmd-times-{stage}"
    marks.unlink(missing_ok=True)
    env = {**dvc_env(work), "SHELL": str(proj / "timing-shell"), "DVC_COST_TIMES": str(marks)}
    log(f"pipeline:{stage}: dvc repro {stage} in {proj}")
    t0 = time.time()
    proc = dvc(proj, "repro", stage, env=env)
    wall = time.time() - t0
    stamps = [float(x) for x in marks.read_text().split()] if marks.is_file() else []
    cmds = [round(b - a, 2) for a, b in zip(stamps[::2], stamps[1::2], strict=False)]  # the stages DVC ran, upstream first
    metrics_file = proj / "metrics" / f"{stage}.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() and proc.returncode == 0 else {}
    summary = {
        "rc": proc.returncode,
        "dvc_repro_wall_s": round(wall, 2),
        "cmds_run": len(cmds),  # 0: DVC found the stage (and its upstream) done and ran nothing
        "cmd_wall_s": cmds,
        "dvc_own_s": round(wall - sum(cmds), 2),
        # what the stage records of its own wall, where it does (model, extract); none when DVC skipped it
        "stage_wall_s": metrics.get("wall_s", metrics.get("wall_seconds")) if cmds else None,
        "date_unix": round(t0),
    }
    timings_file = proj / TIMINGS
    timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
    timings.setdefault(stage, []).append(summary)  # every call's attempt: a resumed stage shows both
    timings_file.write_text(json.dumps(timings, indent=1) + "\n")
    log(f"pipeline:{stage}: {json.dumps(summary)}")
    return {"summary": summary, "metrics": metrics}
