"""Sharing through a real DVC remote: an S3-compatible server (moto, a separate process on
loopback) started and stopped here, the real stages on the TINY params of
tests/test_dvc_invalidation.py, and fresh copies of the project holding only what git carries.

- origin: `make repro` (a copy of tests/conftest.py's `tiny_pipeline`), `make push` (`dvc push
  --run-cache` + the data of every recorded run, pipeline/workflow/share.py); then extract.layer_ids
  changed, repro, push again.
- a teammate's fresh copy: `dvc pull` restores the outputs, `dvc repro` runs nothing; after
  `train.lr` changes only train and eval run.
- another fresh copy (no cache) set back to the first, already pushed params: `dvc repro --pull`
  restores every stage from the run-cache instead of running it (the reports, metrics and draft of
  the first run, byte for byte).

Which stage commands really ran is read from a `python` wrapper first on PATH (every dvc.yaml cmd
is `bin/python -m pipeline run <stage>`, which runs the `python` on PATH where the project has no .venv), independently of timing and of what DVC reports.

A fast test on a toy pipeline shows why `make push` is more than `dvc push --run-cache`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_dvc_invalidation import OTHER_LR, reproduce, set_param

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BUCKET = "eagle3-dvc-remote"
# what a git clone of a project that ran the pipeline holds (docs/SHARING.md; reports/ is in DVC's
# cache: `dvc pull` brings it)
CARRIED = ("pipeline", "data", "bin", "dvc.yaml", "params.yaml", "dvc.lock", ".dvcignore", ".dvc/config", "metrics")
HIDDEN_META = Path("artifacts/hidden_states/extract_meta.json")
# what verify, train and eval give a teammate: the reports (DVC's cache), the metrics and plots (git), the draft
RESULTS = ("reports/verify/report.md", "reports/verify/findings.json", "reports/eval.md", "metrics/verify.json",
           "metrics/verify_layers.csv", "metrics/train.json", "metrics/train_curve.csv", "metrics/eval.json",
           "artifacts/verify/verdict.json", "artifacts/draft/final.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with one bucket; stopped (terminate, then kill) at the end."""
    import boto3

    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    proc, endpoint = None, None
    try:
        for _ in range(3):  # the port was free a moment ago; another process may take it first
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
            endpoint = f"http://127.0.0.1:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                  aws_access_key_id="testing", aws_secret_access_key="testing")
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    client.create_bucket(Bucket=BUCKET)
                    break
                except Exception:
                    time.sleep(0.3)
            else:
                proc.kill()
                proc.wait(10)
                continue
            break
        else:
            pytest.fail(f"moto server did not start; see {log.name}")
        yield endpoint
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def run_log(tmp_path_factory):
    """A `python` first on PATH that logs each `python -m pipeline run <stage>` and execs the real one."""
    bin_dir = tmp_path_factory.mktemp("bin")
    log = bin_dir / "stage-runs.log"
    log.write_text("")
    wrapper = bin_dir / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2 $3" = "-m pipeline run" ]; then echo "$4" >> "{log}"; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield log


def ran(log: Path, since: int) -> list[str]:
    return log.read_text().splitlines()[since:]


def mark(log: Path) -> int:
    return len(log.read_text().splitlines())


def dvc(root: Path, *args: str) -> str:
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def share_push(root: Path) -> None:
    """`make push`."""
    proc = subprocess.run([sys.executable, "-m", "pipeline.workflow.share", "push"], cwd=root, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stdout + proc.stderr


def credentials(root: Path) -> None:
    """Each teammate's own, in the git-ignored .dvc/config.local (docs/SHARING.md, "Remotes")."""
    dvc(root, "remote", "modify", "--local", "shared", "access_key_id", "testing")
    dvc(root, "remote", "modify", "--local", "shared", "secret_access_key", "testing")


def add_remote(root: Path, endpoint: str, prefix: str) -> None:
    """The S3 commands of docs/SHARING.md ("Remotes"), against the loopback server."""
    dvc(root, "remote", "add", "-d", "shared", f"s3://{BUCKET}/{prefix}")
    dvc(root, "remote", "modify", "shared", "endpointurl", endpoint)
    credentials(root)


def fresh_copy(origin: Path, dst: Path) -> Path:
    """What `git clone` of the origin would give: no artifacts, no DVC cache, no credentials."""
    for part in CARRIED:
        src = origin / part
        if src.is_dir():
            shutil.copytree(src, dst / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dst / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / part)
    credentials(dst)
    return dst


@pytest.fixture(scope="module")
def origin(tmp_path_factory, s3_endpoint, run_log, tiny_pipeline):
    """The first teammate: two runs (default layers, then other layers), each pushed with its run-cache. The first
    is tests/conftest.py's `tiny_pipeline` (every stage run by one `make repro`), copied."""
    root = Path(shutil.copytree(tiny_pipeline, tmp_path_factory.mktemp("origin") / "tiny", symlinks=True))
    add_remote(root, s3_endpoint, "eagle3")

    assert reproduce(root) == set()
    first = {"meta": (root / HIDDEN_META).read_text(), "metrics": (root / "metrics/extract.json").read_text(),
             "results": {p: (root / p).read_bytes() for p in RESULTS}}
    share_push(root)

    set_param(root, "extract", "layer_ids", [1, 4, 6, 8])
    assert reproduce(root) == {"check", "extract", "verify", "train", "eval"}
    share_push(root)
    return root, first


TOY_STAGE = """\
import json, pathlib, yaml
v = yaml.safe_load(open("params.yaml"))["toy"]["v"]
pathlib.Path("out").mkdir(exist_ok=True)
for name in "ab":
    pathlib.Path("out", name).write_text(f"{v}{name}")
pathlib.Path("m.json").write_text(json.dumps({"v": v}))
with open(LOG, "a") as f:
    f.write(f"{v}\\n")
"""


def toy_project(root: Path, log: Path) -> Path:
    root.mkdir()
    (root / "stage.py").write_text(f"LOG = {str(log)!r}\n" + TOY_STAGE)
    (root / "params.yaml").write_text("toy:\n  v: 1\n")
    stage = {"cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["toy"], "outs": ["out"],
             "metrics": [{"m.json": {"cache": False}}]}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"toy": stage}}))
    dvc(root, "init", "--no-scm", "-q")
    return root


@pytest.mark.parametrize("push", ["make push", "dvc push --run-cache"])
def test_push_sends_the_data_of_every_recorded_run(s3_endpoint, tmp_path, push):
    """Two runs (v=1, then v=2), one push; a fresh copy set back to v=1 restores it with `dvc repro
    --pull` after `make push`. After a plain `dvc push --run-cache` DVC 3.67 finds the run record
    but not its data, and runs the stage (if a DVC upgrade changes that, pipeline/workflow/share.py can go)."""
    log = tmp_path / "runs.log"
    origin = toy_project(tmp_path / "origin", log)
    add_remote(origin, s3_endpoint, f"toy-{push.split()[0]}")
    assert reproduce(origin) == {"toy"}
    (origin / "params.yaml").write_text("toy:\n  v: 2\n")
    assert reproduce(origin) == {"toy"}
    share_push(origin) if push == "make push" else dvc(origin, "push", "--run-cache")

    clone = tmp_path / "clone"
    for part in ("stage.py", "dvc.yaml", "dvc.lock", "m.json", ".dvc/config"):
        (clone / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin / part, clone / part)
    credentials(clone)
    (clone / "params.yaml").write_text("toy:\n  v: 1\n")
    reproduce(clone, pull=True)
    assert (clone / "out" / "a").read_text() == "1a" and json.loads((clone / "m.json").read_text()) == {"v": 1}
    runs = log.read_text().split()
    assert runs == (["1", "2"] if push == "make push" else ["1", "2", "1"])


@pytest.mark.slow
def test_teammate_pulls_then_repro_runs_nothing_and_lr_reruns_only_train(origin, tmp_path, run_log):
    origin_root, _ = origin
    clone = fresh_copy(origin_root, tmp_path / "clone")
    assert not (clone / "artifacts").exists() and not (clone / ".dvc" / "cache").exists()

    dvc(clone, "pull")
    for out in ("artifacts/hidden_states/extract_meta.json", *RESULTS):
        assert (clone / out).read_bytes() == (origin_root / out).read_bytes(), out

    start = mark(run_log)
    assert reproduce(clone) == set(), "after dvc pull nothing is stale"
    assert ran(run_log, start) == []

    set_param(clone, "train", "lr", OTHER_LR)
    assert reproduce(clone) == {"check", "train", "eval"}
    assert sorted(ran(run_log, start)) == ["check", "eval", "train"]


@pytest.mark.slow
def test_repro_pull_restores_every_stage_already_run(origin, tmp_path, run_log):
    """The run-cache: params set back to a combination the origin ran and pushed (the default
    layers; its dvc.lock now holds the other layers) restore every stage instead of running it."""
    origin_root, first = origin
    clone = fresh_copy(origin_root, tmp_path / "clone")
    set_param(clone, "extract", "layer_ids", None)

    start = mark(run_log)
    reproduce(clone, pull=True)
    runs = ran(run_log, start)
    assert runs == [], f"ran instead of being restored: {runs}"
    # the restored results are the origin's first ones, byte for byte: the extraction, its metrics
    # (their timings too), the reports, the draft
    assert (clone / HIDDEN_META).read_text() == first["meta"]
    assert (clone / "metrics/extract.json").read_text() == first["metrics"]
    for out, data in first["results"].items():
        assert (clone / out).read_bytes() == data, out
    assert json.loads(first["meta"])["layer_ids"] == [2, 4, 5, 8]
    assert reproduce(clone) == set()
