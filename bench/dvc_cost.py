"""DVC's own cost around the extract stage: `dvc repro extract` against the stage alone, and push / pull.

Run in a DVC project whose extract stage's inputs exist (artifacts/check.json, artifacts/model,
artifacts/prepared; extract itself may or may not have run), e.g. on the H200 after `make extract`:

    .venv/bin/python bench/dvc_cost.py --remote /scratch/dvc-bench-remote [--cache-type hardlink,symlink]

1. the stage alone: artifacts/hidden_states moved aside (put back if the stage fails), dvc.yaml's
   extract cmd run as `$SHELL -c CMD`, as DVC runs it;
2. DVC's work after it, alone: `dvc commit -f extract` (md5 of every output file + into the cache);
3. `dvc repro -f -s extract` end to end (DVC removes the output, runs the stage, hashes, caches);
   both 2 and 3 into an empty cache of the run's own (.dvc/cost-bench-cache, `cache.dir` set with
   --local), as a new extraction meets it: a cache that already holds the objects (the same bytes
   again) would skip the copy and hide that cost;
4. `dvc push` of the extract outputs to a local directory remote (`--remote`, added with --local
   config and removed after), then `dvc pull` of them into a fresh copy of the project beside it
   (its own empty cache, the project's cache type), as a teammate's clone would.

DVC's overhead is taken apart from the stage's own time, so the engine's start-up and shutdown
(which vary by tens of seconds between runs; start-up is shorter once torch.compile's cache is
warm) do not hide it: DVC runs a cmd as `$SHELL -c CMD`, so the runs here get a SHELL that notes
when the cmd starts and ends (the stage alone runs through the same shell). DVC's overhead =
repro's time before the cmd + after it (loading, output removal, then md5 of every file, the copy
or links into the cache, dvc.lock) minus the stage alone's (~0).

DVC runs as `python -m dvc` with this interpreter (no `dvc` executable on PATH is needed). Nothing of the project's own
config is left changed: a `--cache-type` is set with `dvc config --local` for the run and the
previous value put back, likewise cache.dir; the new output is committed into the project's own
cache at the end (untimed; not with --scratch-project). The goal: `make extract` <= 1.10 x the stage alone. Prints one
JSON object (and writes it to --json-out after every step, so a run cut short keeps what it
measured); docs/BENCHMARKS.md "DVC's own cost on the H200" has its figures with this command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

OUT = Path("artifacts/hidden_states")
STAGE_METRICS = Path("metrics/extract.json")
BENCH_CACHE = Path(".dvc/cost-bench-cache")
CLONE_PARTS = ("dvc.yaml", "dvc.lock", "params.yaml", ".dvc/config", ".dvc/config.local", "data")
REMOTE = "dvc-cost-bench"


def dvc(*args: str, cwd: Path | None = None) -> float:
    """Run `python -m dvc ARGS` (output passed through); its wall seconds; fail loudly on a non-zero exit."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True)
    return round(time.monotonic() - t0, 2)


def dvc_out(*args: str) -> str | None:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


TIMING_SHELL = """#!/bin/sh
# bench/dvc_cost.py: DVC runs a stage's cmd as "$SHELL -c CMD"; this notes when CMD starts and ends
date +%s.%N >>"$DVC_COST_TIMES"
/bin/sh "$@"
rc=$?
date +%s.%N >>"$DVC_COST_TIMES"
exit $rc
"""


def timed_stage_run(argv: list[str], shell: Path) -> dict:
    """Run argv (the stage alone through `shell`, or `dvc repro` with SHELL=`shell`): its wall,
    the cmd's own, and the time before and after the cmd."""
    STAGE_METRICS.unlink(missing_ok=True)
    times = shell.with_name(f"times-{time.monotonic_ns()}")
    env = {**os.environ, "SHELL": str(shell), "DVC_COST_TIMES": str(times)}
    t0 = time.time()
    subprocess.run(argv, check=True, env=env)
    t1 = time.time()
    marks = [float(x) for x in times.read_text().split()]
    start, end = marks[0], marks[-1]  # a cmd of several lines: DVC runs each through the shell
    metrics = json.loads(STAGE_METRICS.read_text())
    return {
        "wall_s": round(t1 - t0, 2),
        "cmd_s": round(end - start, 2),
        "before_cmd_s": round(start - t0, 2),
        "after_cmd_s": round(t1 - end, 2),
        "stage_wall_s": metrics["wall_s"],
        "engine_load_s": metrics.get("engine_load_s"),
        "tok_per_s": metrics.get("tok_per_s"),
    }


def wait_gpu_free(limit_s: float = 90.0, below_mib: float = 2000.0) -> float | None:
    """Wait until the last run's engine processes have given the GPU memory back (a second engine
    would not fit beside them); the fullest GPU's MiB in use when done, None without nvidia-smi."""
    t0 = time.monotonic()
    while True:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout
            used = max(float(x) for x in out.split())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        if used < below_mib or time.monotonic() - t0 > limit_s:
            return used
        time.sleep(1.0)


def out_md5() -> str | None:
    """The extract output's md5 in dvc.lock (a .dir hash): equal for two runs iff every file is."""
    lock = yaml.safe_load(Path("dvc.lock").read_text()) if Path("dvc.lock").is_file() else {}
    for out in ((lock or {}).get("stages", {}).get("extract", {}).get("outs") or []):
        if out.get("path") == str(OUT):
            return out.get("md5")
    return None


def restore(key: str, value: str | None) -> None:
    if value:
        dvc("config", "--local", key, value)
    else:
        dvc("config", "--local", "--unset", key)


def copies_needed(cache_type: str | None) -> int:
    """Copies of the output on disk at the run's peak: workspace, the run's cache (none extra with
    links), remote, the clone's cache and its workspace (none with links)."""
    links = bool(cache_type) and cache_type.split(",")[0].strip() in ("hardlink", "symlink")
    return 3 if links else 5


def check_space(out_bytes: int, cache_type: str | None, remote: Path) -> None:
    """Refuse before the first run rather than fill the disk halfway (a full disk also stops DVC's lock write)."""
    need = (copies_needed(cache_type) - 1) * out_bytes
    free = shutil.disk_usage(Path.cwd()).free
    if out_bytes and free < need:
        sys.exit(
            f"dvc_cost: needs ~{need / 1e9:.1f} GB free at {Path.cwd()} ({copies_needed(cache_type)} copies of "
            f"{OUT}'s {out_bytes / 1e9:.1f} GB at the peak, cache type {cache_type or 'default'}); has "
            f"{free / 1e9:.1f} GB. Free space, pass a link --cache-type, or measure a smaller extraction "
            f"(--remote {remote} is on the same disk unless you put it elsewhere)"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remote", required=True, type=Path, help="a directory for the local remote (created; emptied after)")
    ap.add_argument("--cache-type", help="dvc cache.type for this run, e.g. hardlink,symlink (default: the project's)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="dvc push/pull --jobs")
    ap.add_argument("--json-out", type=Path, help="also write the JSON here, after every step")
    ap.add_argument("--deadline-unix", type=float, help="skip a step that would not end before this time.time()")
    ap.add_argument("--wait-gpu-free", action="store_true", help="before the repro, wait (up to 90 s) for the GPU's memory")
    ap.add_argument("--scratch-project", action="store_true",
                    help="a project made for this run: leave the new output out of its own cache (saves a commit)")
    ap.add_argument("--expect-bytes", type=int, default=0,
                    help="the output's size when extract has not run yet (for the free-space check)")
    args = ap.parse_args()
    if not Path("dvc.yaml").is_file() or not Path(".dvc").is_dir():
        sys.exit("dvc_cost: run in a DVC project root (dvc.yaml and .dvc/ here)")
    cmd = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]["extract"]["cmd"]
    args.json_out = args.json_out.resolve() if args.json_out else None

    saved_type = dvc_out("config", "--local", "cache.type")
    result: dict = {
        "cache_type": args.cache_type or dvc_out("config", "cache.type") or "default (reflink,copy: a copy on ext4)",
        "jobs": args.jobs,
        "checksum_jobs": dvc_out("config", "core.checksum_jobs") or "default",
        "dvc_version": (dvc_out("--version") or "?"),
        "stage_cmd": cmd,
        "skipped": [],
    }

    def save() -> None:
        if args.json_out:
            tmp = args.json_out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(args.json_out)

    def time_left_for(step: str, seconds: float) -> bool:
        if args.deadline_unix and time.time() + seconds > args.deadline_unix:
            result["skipped"].append(f"{step}: needs ~{seconds:.0f} s, {args.deadline_unix - time.time():.0f} s left")
            save()
            return False
        return True

    check_space(tree_bytes(OUT)[1] if OUT.is_dir() else args.expect_bytes, args.cache_type or saved_type, args.remote)
    shell_dir = Path(tempfile.mkdtemp(prefix="dvc-cost-shell-"))
    shell = shell_dir / "sh"
    shell.write_text(TIMING_SHELL)
    shell.chmod(0o755)
    if args.cache_type:
        dvc("config", "--local", "cache.type", args.cache_type)
    # an empty cache of the run's own, beside the project's (the same filesystem, for links): what a
    # new extraction pays, md5 and copy or link, not a cache that already holds the objects
    saved_dir = dvc_out("config", "--local", "cache.dir")
    shutil.rmtree(BENCH_CACHE, ignore_errors=True)
    dvc("config", "--local", "cache.dir", str(BENCH_CACHE.resolve()))
    try:
        aside = OUT.with_name(OUT.name + ".bench-aside")
        shutil.rmtree(aside, ignore_errors=True)
        if OUT.exists():
            os.replace(OUT, aside)
        try:
            result["stage_alone"] = timed_stage_run([str(shell), "-c", cmd], shell)
        except BaseException:
            if aside.exists() and not OUT.exists():
                os.replace(aside, OUT)  # the project as it was
            raise
        shutil.rmtree(aside, ignore_errors=True)
        result["files"], result["bytes"] = tree_bytes(OUT)
        save()
        result["dvc_commit_s"] = dvc("commit", "-f", "extract")
        result["out_md5_stage_alone"] = out_md5()
        shutil.rmtree(BENCH_CACHE)  # the repro starts from an empty cache too
        save()
        if time_left_for("dvc repro", result["stage_alone"]["wall_s"] * 1.3 + 2 * result["dvc_commit_s"]):
            if args.wait_gpu_free:
                result["gpu_mib_used_before_repro"] = wait_gpu_free()
            result["repro"] = timed_stage_run([sys.executable, "-m", "dvc", "repro", "-f", "-s", "extract"], shell)
            result["out_md5_repro"] = out_md5()
            result["repro_same_bytes"] = result["out_md5_repro"] == result["out_md5_stage_alone"]
            alone, repro = result["stage_alone"], result["repro"]
            overhead = repro["before_cmd_s"] + repro["after_cmd_s"] - alone["before_cmd_s"] - alone["after_cmd_s"]
            result["dvc_repro_s"] = repro["wall_s"]
            result["dvc_before_cmd_s"] = repro["before_cmd_s"]
            result["dvc_after_cmd_s"] = repro["after_cmd_s"]  # md5 of every file, into the cache, dvc.lock
            result["dvc_overhead_s"] = round(overhead, 2)
            # the goal's ratio: the stage alone's wall, plus DVC's part as the repro measured it
            result["repro_over_stage"] = round((alone["wall_s"] + overhead) / alone["wall_s"], 4)
            result["repro_over_stage_measured"] = round(repro["wall_s"] / alone["wall_s"], 4)
            save()
        if time_left_for("dvc push + pull", 4 * result["dvc_commit_s"] + 20):
            push_pull(args, result)
            save()
    finally:
        shutil.rmtree(shell_dir, ignore_errors=True)
        shutil.rmtree(BENCH_CACHE, ignore_errors=True)
        restore("cache.dir", saved_dir)
        if args.cache_type:
            restore("cache.type", saved_type)
    if not args.scratch_project and time_left_for("dvc commit into the project's cache", 2 * result["dvc_commit_s"]):
        # the output is the workspace's; the lock names it; the project's own cache gets it too (untimed)
        dvc("commit", "-f", "extract")
    gb = result["bytes"] / 1e9
    for key in ("dvc_commit_s", "dvc_after_cmd_s", "dvc_push_s", "dvc_pull_s"):
        if result.get(key):
            result[key.replace("_s", "_gb_per_s")] = round(gb / result[key], 3)
    save()
    print(json.dumps(result, indent=1))
    return 0


def clone_config(clone: Path) -> None:
    """The clone's local config: its own cache, as a teammate's clone has (the copied one names the
    run's cache), and no git (a copy of a git project's DVC files is no git repository; the data's
    path through DVC is the same)."""
    from configobj import ConfigObj  # DVC's own config format and library

    cfg = ConfigObj(str(clone / ".dvc" / "config.local"))
    cfg.setdefault("cache", {})["dir"] = str((clone / ".dvc" / "cache").resolve())
    cfg.setdefault("core", {})["no_scm"] = "true"
    cfg.write()


def push_pull(args, result: dict) -> None:
    args.remote.mkdir(parents=True, exist_ok=True)
    dvc("remote", "add", "--local", "-f", REMOTE, str(args.remote.resolve()))
    try:
        result["dvc_push_s"] = dvc("push", "-r", REMOTE, "-j", str(args.jobs), "extract")
        with tempfile.TemporaryDirectory(prefix="dvc-cost-clone-", dir=Path.cwd().parent) as clone:
            clone = Path(clone)
            for part in CLONE_PARTS:
                src = Path(part)
                if src.is_dir():
                    shutil.copytree(src, clone / part)
                elif src.is_file():
                    (clone / part).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, clone / part)
            clone_config(clone)
            result["dvc_pull_s"] = dvc("pull", "-r", REMOTE, "-j", str(args.jobs), "extract", cwd=clone)
            result["pull_files"], result["pull_bytes"] = tree_bytes(clone / OUT)
    finally:
        dvc("remote", "remove", "--local", REMOTE)
        shutil.rmtree(args.remote, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
