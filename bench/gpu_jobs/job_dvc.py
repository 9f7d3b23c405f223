"""bench step dvccost: DVC's own cost around the extract stage (bench/dvc_cost.py) on the dense 8B extraction.

The other steps call `extract.run` in a bare temp project; this one makes its project a real DVC
project (the repo's dvc.yaml, the pipeline code its extract stage depends on, a params.yaml with
the bench's extract settings, `dvc init --no-scm`: the GPU host has no git and needs none), runs the
real check stage for artifacts/check.json, then bench/dvc_cost.py there: the stage alone, `dvc
commit`, `dvc repro -f -s extract`, push and pull to a local remote. Two engine runs (~150 s each on
the H200): one cache type per call. `--jobs dvccost` measures the default cache type (a copy on
ext4), `--jobs dvccost_link` hardlink,symlink (docs/SHARING.md, "Disk: the cache
type", calls them safe here).

Disk: the H200 host has 64 GiB free on its one ext4 disk, and a run keeps up to 5 copies of the
output at its peak with the copy type (dvc_cost.copies_needed), so the job sizes its own workload to
the free space (512-token prompts, the dense shape's bytes per token) instead of reusing the dense
job's 34 GB extraction, and first deletes the other bench projects' extractions (bench scratch,
their numbers are in results.json already). DVC is the bench interpreter's (`python -m dvc`): the .venv's that
`make setup BUNDLE=dir` builds on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_jobs.common import ENGINE, REPO, SMOKE_ENGINE, WORKLOADS, layer_ids_of, log

CACHE_TYPES = {"copy": None, "link": "hardlink,symlink"}  # None: the project's default (reflink,copy)
BYTES_PER_TOKEN = 4 * 4096 * 2 + 9  # the dense 8B shape, 4 layers in bf16, + ids and loss mask
PROMPT_TOKENS = 512
MIN_BYTES = 10e9  # DVC's cost measured at GPU scale, not on a toy output
DISK_SHARE = 0.9  # of the free space: vLLM's per-request scratch files and the clone's small files need room too


# ---------------------------------------------------------------------------- parent side


def run_dvc_cost(bench, variant: str) -> None:
    """Parent side of `--jobs dvccost` / `dvccost_link`: build the model, free the disk, size and
    prepare the workload, then run the child step `dvccost:<variant>`."""
    smoke = bench.args.smoke
    if "build:dense" not in bench.results["jobs"]:
        bench.child("build:dense", 240, 60)
    if "build:dense" not in bench.results["jobs"]:
        log(f"SKIP dvccost:{variant}: the dense model was not built")
        bench.results["skipped"].append(f"dvccost:{variant}")
        return
    free_stale_outputs(bench.work)
    if not smoke:
        copies = 5  # the copy type's peak (dvc_cost.copies_needed), for both variants: the same size, comparable
        free = shutil.disk_usage(bench.work).free
        per_prompt = PROMPT_TOKENS * BYTES_PER_TOKEN
        spec = dict(WORKLOADS["dvc"])
        n = int(free * DISK_SHARE / copies / per_prompt) // spec["samples_per_shard"] * spec["samples_per_shard"]
        spec["n_a"] = max(spec["samples_per_shard"], min(spec["n_a"], n))
        WORKLOADS["dvc"] = spec  # the parent's copy only; the child reads it from the state
        bench.state["dvc_expect_bytes"] = spec["n_a"] * per_prompt
        note = f"{free / 1e9:.1f} GB free, {copies} copies at the peak: {spec['n_a']} prompts, {spec['n_a'] * per_prompt / 1e9:.1f} GB"
        if spec["n_a"] * per_prompt < MIN_BYTES:
            note += f" (below the {MIN_BYTES / 1e9:.0f} GB the issue asks for: the disk is the limit)"
        log(f"dvccost:{variant}: {note}")
        bench.state["dvc_sizing"] = note
    bench.prepare_project("dvc")
    # two engine runs and DVC's work; dvc_cost.py skips the repro / push+pull that would not end in time
    bench.child(f"dvccost:{variant}", 560, 200 if not smoke else 10)


def free_stale_outputs(work: Path) -> None:
    """Delete the extractions other bench steps (this call's or an earlier call's on a warm
    machine) left under `work`, and what a killed dvccost run left: the disk holds one at a time."""
    stale = [*work.glob("project-*/artifacts/hidden_states*"), *work.glob("project-*/artifacts/.partial"),
             *work.glob("project-*/.dvc/cache"), *work.glob("dvc-remote"), *work.glob("dvc-cost-clone-*")]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        log(f"freed the disk: {', '.join(str(p.relative_to(work)) for p in stale)}")


# ---------------------------------------------------------------------------- child side


def make_dvc_project(state: dict, name: str, proj: Path) -> None:
    """The bench project as a DVC project: dvc.yaml, the code its stages depend on, params.yaml with
    the bench's extract settings and the built model, the real check stage's output."""
    import yaml

    shutil.copy2(REPO / "dvc.yaml", proj / "dvc.yaml")
    shutil.copytree(REPO / "pipeline", proj / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    (proj / "data").mkdir(exist_ok=True)
    shutil.copy2(REPO / "data" / "chat.jsonl", proj / "data" / "chat.jsonl")  # what the check stage checks
    # dvc.yaml's cmd is bin/python: here the interpreter running this bench (the host may have no
    # `python`, or another one, on PATH)
    (proj / "bin").mkdir(exist_ok=True)
    (proj / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (proj / "bin" / "python").chmod(0o755)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    spec, engine = state[f"spec_{name}"], (SMOKE_ENGINE if state["smoke"] else ENGINE)
    params["model"]["path"] = str(Path(state["models"]) / "dense")
    params["extract"].update(
        layer_ids=layer_ids_of(state, "dense"),
        dtype="bfloat16",
        samples_per_shard=spec["samples_per_shard"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        gpu_memory_utilization=engine["gpu_memory_utilization"],
    )
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (proj / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=proj, check=True)
    subprocess.run([str(proj / "bin" / "python"), "-m", "pipeline", "run", "check"], cwd=proj, check=True)


def requirement_problems() -> list[str]:
    """Requirements of DVC's dependency closure that the installed distributions do not meet
    (the bundle leaves the host's own packages out, whose versions it cannot see)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, seen, todo = [], set(), ["dvc"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            found.append(f"{name}: not installed")
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                continue  # reported when its own turn comes
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                found.append(f"{dist.metadata['Name']} needs {req}, has {have}")
    return sorted(set(found))


def job_dvc_cost(state: dict, variant: str) -> dict:
    name = "dvc"
    proj = Path(state[f"project_{name}"])
    os.environ["DVC_NO_ANALYTICS"] = "1"  # no network on the host
    os.environ.setdefault("DVC_SITE_CACHE_DIR", str(Path(state["work"]) / "dvc-site-cache"))  # not /var/tmp/dvc
    import dvc

    summary: dict = {"dvc_from": str(Path(dvc.__file__).parent), "sizing": state.get("dvc_sizing"),
                     "requirement_problems": requirement_problems()}
    log(f"dvccost:{variant}: dvc from {summary['dvc_from']}; requirement problems: {summary['requirement_problems']}")
    t = time.monotonic()
    make_dvc_project(state, name, proj)
    summary["project_setup_s"] = round(time.monotonic() - t, 2)
    out_json = Path(state["out"]) / f"dvccost_{variant}.json"
    argv = [sys.executable, str(REPO / "bench" / "dvc_cost.py"), "--remote", str(Path(state["work"]) / "dvc-remote"),
            "--json-out", str(out_json), "--deadline-unix", str(state["child_deadline_unix"] - 15),
            "--expect-bytes", str(state.get("dvc_expect_bytes", 0)), "--scratch-project", "--wait-gpu-free"]
    if CACHE_TYPES[variant]:
        argv += ["--cache-type", CACHE_TYPES[variant]]
    summary["command"] = " ".join(argv[1:])
    proc = subprocess.run(argv, cwd=proj)
    summary["rc"] = proc.returncode
    summary["dvc_cost"] = json.loads(out_json.read_text()) if out_json.is_file() else None
    log(f"dvccost:{variant}: {json.dumps(summary)}")
    return {"summary": summary}
