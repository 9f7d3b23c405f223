"""The invalidation contract, against real `dvc repro` runs of the real stages on tiny params.

`dvc status` and `repro --dry` only show directly changed stages, so these tests assert on
the stages `Repo.reproduce()` actually ran.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ALL = {"model", "regenerate", "prepare", "extract", "verify", "train", "eval"}
TINY = {
    "model": {"embedded": {"num_layers": 8, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128, "train_steps": 30, "train_batch_size": 8, "train_seq_len": 128}},
    "data": {"max_samples": 24, "seq_len": 256},
    "extract": {"samples_per_shard": 8},
    "verify": {"reference_samples": 2},
    "train": {"epochs": 1},
    "eval": {"num_prompts": 2, "max_tokens": 8},
}

pytestmark = pytest.mark.slow


def merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return base


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from dvc.repo import Repo

    root = tmp_path_factory.mktemp("project")
    for name in ("pipeline", "data"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    Repo.init(str(root), no_scm=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return root


def reproduce(root: Path, **kwargs) -> set[str]:
    """The stages `dvc repro` (with `kwargs`) actually ran in project `root`."""
    from dvc.repo import Repo

    cwd = os.getcwd()
    os.chdir(root)
    try:
        with Repo(str(root)) as repo:
            return {stage.addressing for stage in repo.reproduce(**kwargs)}
    finally:
        os.chdir(cwd)


def set_param(root: Path, section: str, key: str, value) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def test_invalidation_contract(project):
    assert reproduce(project) == ALL
    assert reproduce(project) == set(), "no change must run nothing"

    set_param(project, "extract", "layer_ids", [1, 4, 6, 8])
    assert reproduce(project) == {"extract", "verify", "train", "eval"}

    # regenerate reads data.seq_len (its generation budget), so it re-runs too (instantly, when off)
    set_param(project, "data", "seq_len", 200)
    assert reproduce(project) == {"regenerate", "prepare", "extract", "verify", "train", "eval"}

    set_param(project, "train", "lr", 0.001)
    assert reproduce(project) == {"train", "eval"}

    # the verdict is deterministic, so a verify-only change that passes again stops at verify
    set_param(project, "verify", "reference_samples", 3)
    assert reproduce(project) == {"verify"}

    set_param(project, "eval", "max_tokens", 6)
    assert reproduce(project) == {"eval"}
    assert reproduce(project) == set()
