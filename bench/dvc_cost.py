"""DVC's own cost around the extract stage: `dvc repro extract` against the stage alone, and push / pull.

Run in a project whose pipeline has run up to extract (e.g. on the H200 after `make extract`):

    .venv/bin/python bench/dvc_cost.py --remote /scratch/dvc-bench-remote [--cache-type hardlink,symlink]

1. the stage alone: artifacts/hidden_states moved aside, `bin/python -m pipeline run extract`;
2. DVC's work after it, alone: `dvc commit -f extract` (md5 of every output file + into .dvc/cache);
3. `dvc repro -f -s extract` end to end (DVC removes the output, runs the stage, hashes, caches);
4. `dvc push` of the extract outputs to a local directory remote (`--remote`, added with --local
   config and removed after), then `dvc pull` of them into a fresh copy of the project beside it
   (its own empty cache), as a teammate's clone would.

Nothing of the project's own config is left changed: a `--cache-type` is set with `dvc config
--local` for the run and the previous value put back; the moved-aside output is deleted once the
stage has written a new one. The goal (issue 20): `make extract` <= 1.10 x the stage alone.
Prints one JSON object; add its numbers to docs/BENCHMARKS.md with this command line.
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

OUT = Path("artifacts/hidden_states")


def sh(*argv: str, cwd: Path | None = None) -> float:
    """Run argv (output passed through); its wall seconds; fail loudly on a non-zero exit."""
    t0 = time.monotonic()
    subprocess.run(argv, cwd=cwd, check=True)
    return round(time.monotonic() - t0, 2)


def dvc(*args: str, cwd: Path | None = None) -> float:
    return sh(str(Path(sys.executable).parent / "dvc"), *args, cwd=cwd)


def local_config(key: str) -> str | None:
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), "config", "--local", key],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remote", required=True, type=Path, help="a directory for the local remote (created; emptied after)")
    ap.add_argument("--cache-type", help="dvc cache.type for this run, e.g. hardlink,symlink (default: the project's)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="dvc push/pull --jobs")
    args = ap.parse_args()
    if not (Path("dvc.yaml").is_file() and OUT.is_dir()):
        sys.exit("run in a project root whose extract stage has run (artifacts/hidden_states exists)")

    saved_type = local_config("cache.type")
    result: dict = {"cache_type": args.cache_type or saved_type or "default (copy on ext4)", "jobs": args.jobs}
    if args.cache_type:
        dvc("config", "--local", "cache.type", args.cache_type)
    try:
        aside = OUT.with_name(OUT.name + ".bench-aside")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(OUT, aside)
        result["stage_alone_s"] = sh("bin/python", "-m", "pipeline", "run", "extract")
        shutil.rmtree(aside)
        result["files"], result["bytes"] = tree_bytes(OUT)
        result["dvc_commit_s"] = dvc("commit", "-f", "extract")
        result["dvc_repro_s"] = dvc("repro", "-f", "-s", "extract")
        result["repro_over_stage"] = round(result["dvc_repro_s"] / result["stage_alone_s"], 3)

        args.remote.mkdir(parents=True, exist_ok=True)
        dvc("remote", "add", "--local", "-f", "dvc-cost-bench", str(args.remote.resolve()))
        try:
            result["dvc_push_s"] = dvc("push", "-r", "dvc-cost-bench", "-j", str(args.jobs), "extract")
            with tempfile.TemporaryDirectory(prefix="dvc-cost-clone-", dir=Path.cwd().parent) as clone:
                clone = Path(clone)
                for part in ("dvc.yaml", "dvc.lock", "params.yaml", ".dvc/config", ".dvc/config.local", "data"):
                    src = Path(part)
                    if src.is_dir():
                        shutil.copytree(src, clone / part)
                    elif src.is_file():
                        (clone / part).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, clone / part)
                result["dvc_pull_s"] = dvc("pull", "-r", "dvc-cost-bench", "-j", str(args.jobs), "extract", cwd=clone)
        finally:
            dvc("remote", "remove", "--local", "dvc-cost-bench")
            shutil.rmtree(args.remote, ignore_errors=True)
    finally:
        if args.cache_type:
            if saved_type:
                dvc("config", "--local", "cache.type", saved_type)
            else:
                dvc("config", "--local", "--unset", "cache.type")
    gb = result["bytes"] / 1e9
    for key in ("stage_alone_s", "dvc_commit_s", "dvc_repro_s", "dvc_push_s", "dvc_pull_s"):
        result[key.replace("_s", "_gb_per_s")] = round(gb / result[key], 3) if result.get(key) else None
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
