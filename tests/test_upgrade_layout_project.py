"""`python -m pipeline upgrade-layout` (`make upgrade-layout`) on a project finished before the package layout.

A finished project from before the move upgrades without re-running extract. The project is this repository cloned at
2aeb9ee (the last commit before the layout moves) and made finished without running a stage: a small dummy file at
every output of its dvc.yaml and a lock recorded with `dvc commit -f`. Then the code is brought to UPGRADED_TO (the
commit that made every stage run-cacheable; later commits change stages for real), dvc.lock and the outputs kept, and
the command runs the way a user types it. It needs git's history back to 2aeb9ee (CI's `git clone` has it): the command finds the code dvc.lock
recorded by its md5 in the project's git history.

What must still re-run is the stages whose code changed for real after 2aeb9ee, not only moved: verify alone (its
per-sample tests gained the token identity: a new module, pipeline/verification/samples/next_token.py, and changes to
the judge, scan, final head, scores and report). Every other stage's code only moved (its imports and the module
names in its strings changed), so those stages, extract included, are re-recorded. Downstream of verify, train
(artifacts/verify/verdict.json) and through it eval re-run only if verify's re-run changes the verdict's bytes
(deterministic: a verify that passes again does not retrain); `dvc status` and `repro --dry` show only directly
changed stages, so here that is verify alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BEFORE_THE_MOVE = "2aeb9ee"
BEFORE_RUN_CACHE = "61b87c6"  # the last commit before every stage was run-cacheable
# The code the projects are upgraded to: the commit that made every stage run-cacheable, on top of the layout. Later
# commits change stages' code and params for real (a new default target, new output lines, fp8 shards), which re-runs
# those stages by design; what these tests hold is that the two upgrades themselves re-run nothing.
UPGRADED_TO = "0889b6f"
STAGES = {"check", "model", "regenerate", "prepare", "extract", "verify", "train", "eval"}
CHANGED_FOR_REAL = {"verify"}  # see the module docstring
# the reports, `cache: false` outs before every stage was run-cacheable, in DVC's cache since
NEWLY_CACHED = {"verify": "reports/verify", "eval": "reports/eval.md"}
ONLY_MOVED = STAGES - CHANGED_FOR_REAL


def sh(root: Path, *args: str, input: bytes | None = None) -> str:
    """Run a command in `root` with this environment's bin/ (python, dvc) first on PATH, as a user's shell has it."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(list(args), cwd=root, env=env, input=input, capture_output=True)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout.decode()}{proc.stderr.decode()}"
    return proc.stdout.decode()


def outputs(dvc_yaml: Path) -> dict[str, list[str]]:
    """Each stage's outputs (outs, metrics, plots) as dvc.yaml names them."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return {name: [o if isinstance(o, str) else next(iter(o)) for key in ("outs", "metrics", "plots")
                   for o in stage.get(key, [])] for name, stage in stages.items()}


def status(root: Path) -> dict:
    return json.loads(sh(root, "dvc", "status", "--json") or "{}")


def lock(root: Path) -> dict:
    return yaml.safe_load((root / "dvc.lock").read_text())["stages"]


def forget_what_repro_does_not_cache(root: Path) -> None:
    """Leave the caches as `dvc repro` would have: `dvc commit` also saves each stage to the run-cache, and with it
    the `cache: false` outs into DVC's cache, which `dvc repro` does for no stage with such an out (not a metric or
    plot). So: no run records, and those outs' objects out of the cache."""
    import shutil

    cache = root / ".dvc" / "cache"
    shutil.rmtree(cache / "runs", ignore_errors=True)
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        uncached = {next(iter(o)) for o in stage.get("outs", []) if isinstance(o, dict)
                    and next(iter(o.values())).get("cache") is False}
        for out in lock(root)[name].get("outs", []):
            if out["path"] not in uncached:
                continue
            obj = cache / "files" / "md5" / out["md5"][:2] / out["md5"][2:]
            if out["md5"].endswith(".dir"):
                for entry in json.loads(obj.read_text()):
                    (cache / "files" / "md5" / entry["md5"][:2] / entry["md5"][2:]).unlink()
            obj.unlink()


def finished_at(commit: str, tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, dict]:
    """This repository cloned at `commit` and made finished there without running a stage, then its code brought to
    UPGRADED_TO, dvc.lock and the outputs kept: (root, dummies)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the project is made from this repository's history")
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode != 0:
        pytest.fail(f"commit {commit} is not in this clone's history: a shallow clone? `git fetch --unshallow`")
    root = tmp_path_factory.mktemp(name) / "project"
    sh(root.parent, "git", "clone", "-q", str(ROOT), str(root))
    sh(root, "git", "checkout", "-q", commit)

    # finished without running a stage: a dummy at every output, a lock recorded for every stage
    dummies = {}
    for stage, outs in outputs(root / "dvc.yaml").items():
        for out in outs:
            path = root / out
            if not path.suffix:  # a folder output (artifacts/model, reports/verify, ...)
                path = path / "dummy.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{stage}: {out}\n")
            dummies[path] = path.read_bytes()
    sh(root, "dvc", "commit", "-f")
    forget_what_repro_does_not_cache(root)
    assert status(root) == {}, f"the project at {commit} is not finished"
    assert set(lock(root)) == STAGES

    sh(root, "git", "checkout", "-q", UPGRADED_TO)
    return root, dummies


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The project finished at 2aeb9ee, its code brought to UPGRADED_TO, then `upgrade-layout --dry-run` and the real one."""
    root, dummies = finished_at(BEFORE_THE_MOVE, tmp_path_factory, "upgrade")
    lock_text = (root / "dvc.lock").read_text()
    before = status(root)
    dry = sh(root, "python", "-m", "pipeline", "upgrade-layout", "--dry-run")
    dry_lock_text = (root / "dvc.lock").read_text()
    out = sh(root, "python", "-m", "pipeline", "upgrade-layout")
    return {"root": root, "lock_before": yaml.safe_load(lock_text)["stages"], "lock_text": lock_text,
            "dry_lock_text": dry_lock_text, "status_before": before, "dry": dry, "out": out, "dummies": dummies}


def test_before_the_upgrade_every_stage_looks_changed_by_its_code_and_its_newly_cached_reports_alone(upgraded):
    before = upgraded["status_before"]
    assert set(before) == STAGES, "the move should change every stage's code deps"
    for stage, entries in before.items():
        assert any(set(e) == {"changed deps"} for e in entries), (stage, entries)
        outs = [e["changed outs"] for e in entries if set(e) == {"changed outs"}]
        assert len(outs) + 1 == len(entries), (stage, entries)
        assert outs == ([{NEWLY_CACHED[stage]: "not in cache"}] if stage in NEWLY_CACHED else []), (stage, entries)


def test_dry_run_reports_the_same_and_commits_nothing(upgraded):
    assert upgraded["dry_lock_text"] == upgraded["lock_text"]
    # the same verdicts, stage by stage (the real run also prints `dvc commit`'s own lines)
    verdicts = [line for line in upgraded["out"].splitlines() if not line.startswith("Updating lock file")]
    assert upgraded["dry"].splitlines() == verdicts


def test_extract_and_every_stage_whose_code_only_moved_are_re_recorded_not_re_run(upgraded):
    out = upgraded["out"]
    for stage in ONLY_MOVED:
        also = " and outputs now cached" if stage in NEWLY_CACHED else ""
        assert f"{stage}: only moved code{also}: re-recorded, not re-run" in out, out
    for stage in CHANGED_FOR_REAL:
        assert f"{stage}: left to `dvc repro`" in out, out
    root = upgraded["root"]
    after = status(root)
    assert set(after) == CHANGED_FOR_REAL, after
    assert "extract" not in after
    # what `dvc repro` would run now: the stages whose code really changed, nothing else
    dry = sh(root, "dvc", "repro", "--dry")
    assert set(re.findall(r"Running stage '([\w-]+)'", dry)) == CHANGED_FOR_REAL, dry


def test_the_lock_keeps_every_output_and_records_the_moved_code(upgraded):
    root = upgraded["root"]
    before, after = upgraded["lock_before"], lock(root)
    assert set(after) == STAGES
    for stage in STAGES:
        assert after[stage].get("outs") == before[stage].get("outs"), f"{stage}'s outputs in dvc.lock changed"
        assert after[stage].get("params") == before[stage].get("params"), stage
    for stage in CHANGED_FOR_REAL:
        assert after[stage] == before[stage], f"{stage} was re-recorded though its code changed for real"
    # extract's lock now names its code where it lives (the shard format moved to pipeline/hidden_states/)
    extract_deps = {d["path"] for d in after["extract"]["deps"]}
    assert {"pipeline/hidden_states/format.py", "pipeline/hidden_states/stats.py"} <= extract_deps
    assert "pipeline/shards.py" not in extract_deps
    # the outputs themselves are untouched
    for path, data in upgraded["dummies"].items():
        assert path.read_bytes() == data, path


# --- a project finished before every stage was run-cacheable ---------------------------------------------------------


def test_a_project_finished_before_the_run_cache_upgrades_and_restores_every_stage_from_it(tmp_path_factory):
    """Finished at BEFORE_RUN_CACHE (train's draft `persist: true`, the reports `cache: false`): the upgrade re-runs
    nothing and re-records every stage, so that with dvc.lock and every output gone (as a param changed and changed
    back would find them: new results elsewhere, the old ones only in the caches) `dvc repro` restores each stage
    from the run-cache, running no stage command, the same bytes back."""
    root, dummies = finished_at(BEFORE_RUN_CACHE, tmp_path_factory, "run-cache")
    before = status(root)
    assert before == {stage: [{"changed outs": {out: "not in cache"}}] for stage, out in NEWLY_CACHED.items()}, before
    lock_text = (root / "dvc.lock").read_text()
    out = sh(root, "python", "-m", "pipeline", "upgrade-layout")
    for stage in STAGES:
        what = "outputs now cached: re-recorded" if stage in NEWLY_CACHED else "up to date: re-recorded into the run-cache"
        assert f"{stage}: {what}, not re-run" in out, out
    assert status(root) == {} and (root / "dvc.lock").read_text() == lock_text

    (root / "dvc.lock").unlink()
    for path in dummies:
        path.unlink()
    repro = sh(root, "dvc", "repro")
    assert "Running stage" not in repro, repro
    for stage in STAGES:
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in repro, repro
    for path, data in dummies.items():
        assert path.read_bytes() == data, path
    assert lock(root) == yaml.safe_load(lock_text)["stages"]
