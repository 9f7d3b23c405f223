"""`make push`: `dvc push --run-cache`, plus the data of every run the run-cache records.

DVC 3.67's `push --run-cache` sends the run records (which code, inputs and params gave which
outputs) but the data of only the outputs in the workspace now. The outputs of a run made before
params changed again, and the `cache: false` metrics and plots of every run, stay behind;
a teammate's `dvc repro --pull` then finds the record, misses the data ("Some of the cache files
do not exist neither locally nor on remote") and runs the stage instead of restoring it. This
pushes that data too (what DVC 2 did), from the local cache to the same remote.

    python -m pipeline.workflow.share push [-r REMOTE] [-j JOBS]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run_cache_entries(repo) -> list[tuple[str, str]]:
    """(key, value) of every run record in the local run-cache (.dvc/cache/runs/<k[:2]>/<k>/<v>)."""
    runs = Path(repo.stage_cache.cache_dir)
    return sorted((p.parent.name, p.name) for p in runs.glob("*/*/*") if p.is_file())


def push(remote: str | None = None, jobs: int | None = None, root: str | None = None) -> tuple[int, int]:
    """Push the workspace's outputs, the run-cache and every run's outputs; (pushed, missing) counts."""
    from dvc.repo import Repo

    with Repo(root) as repo:
        pushed = repo.push(remote=remote, jobs=jobs, run_cache=True)
        missing = 0
        used = repo.stage_cache.get_used_objs(run_cache_entries(repo), remote=remote, jobs=jobs)
        for odb, objs in used.items():
            result = repo.cloud.push(objs, jobs=jobs, remote=remote, odb=odb)
            pushed += len(result.transferred)
            missing += len(result.failed)
    return pushed, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.workflow.share", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["push"])
    ap.add_argument("-r", "--remote", default=None, help="remote name (default: the default remote)")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    pushed, missing = push(args.remote, args.jobs)
    print(f"{pushed} files pushed (outputs, run-cache records and the outputs of recorded runs)")
    if missing:
        print(f"warning: {missing} files of recorded runs are not in the local cache (removed by `dvc gc`?): "
              "those runs cannot be restored from the remote", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
