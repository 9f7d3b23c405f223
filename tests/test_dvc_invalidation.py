"""The invalidation table (pipeline/workflow/invalidation.py) against the schema, dvc.yaml, the docs and real DVC.

Fast: every params.yaml key is classified, dvc.yaml's `params:` lists are exactly the table, and
docs/ARCHITECTURE.md shows the same table. Slow (one real `make repro` of the tiny embedded
project, tests/conftest.py `tiny_pipeline`, copied for the module): DVC's own status for a changed
value of every key, real repros for a few keys and the same keys changed back (every stage restored
from the run-cache, running nothing), a typo that must not cost verify's outputs, `dvc repro` from a clean shell, the same
bytes from a second run of model, prepare, extract and verify, and a killed training resumed or,
its param changed back, restored.

`dvc status` and `repro --dry` only show directly changed stages; what else runs follows from
which outputs change, so the real repros assert on the stages `Repo.reproduce()` actually ran.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from pipeline.params import Params
from pipeline.workflow import invalidation

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ALL = {"check", "model", "regenerate", "prepare", "extract", "verify", "train", "eval"}
# a train.lr other than the default's, whatever the default is
OTHER_LR = 2 * yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["lr"]
TINY = {
    "model": {"embedded": {"num_layers": 8, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 128, "train_steps": 30, "train_batch_size": 8, "train_seq_len": 128}},
    "data": {"max_samples": 24, "seq_len": 256},
    "extract": {"samples_per_shard": 8},
    "verify": {"reference_samples": 2},
    "train": {"epochs": 1},
    "eval": {"num_prompts": 2, "max_tokens": 8},
}
VERIFY_OUTS = ("artifacts/verify/verdict.json", "reports/verify/report.md", "reports/verify/findings.json",
               "metrics/verify.json", "metrics/verify_layers.csv")


def merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return base


# --- the table itself: no DVC run --------------------------------------------------------------


def test_every_param_is_classified():
    keys = invalidation.leaf_keys(Params)
    unclassified = [k for k in keys if k not in invalidation.RERUNS]
    assert not unclassified, (
        f"params.yaml keys with no entry in pipeline/workflow/invalidation.py RERUNS: {unclassified}. Add each with the "
        "stages whose output bytes it changes (reruns(...)) or tuning(why) if it changes none, list it in those "
        "stages' dvc.yaml params, and add its row to docs/ARCHITECTURE.md (python -m pipeline.workflow.invalidation)")
    assert not set(invalidation.RERUNS) - set(keys), "RERUNS names keys the schema no longer has"
    for key, rule in invalidation.RERUNS.items():
        assert set(rule.stages) <= set(invalidation.STAGES) and rule.why, key


def listed_keys(entries: list, all_keys: list[str]) -> set[str]:
    """The schema keys a dvc.yaml `params:` list covers: a key, a section (all below it), or a whole file."""
    covered = set()
    for entry in entries:
        if isinstance(entry, dict):  # `- params.yaml:` with no keys: every key of the file
            assert list(entry) == ["params.yaml"] and next(iter(entry.values())) is None, entry
            covered |= set(all_keys)
            continue
        hit = {k for k in all_keys if k == entry or k.startswith(f"{entry}.")}
        assert hit, f"dvc.yaml lists {entry!r}, which is no key of the schema"
        covered |= hit
    return covered


def test_dvc_yaml_params_are_exactly_the_table():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    keys = invalidation.leaf_keys(Params)
    assert set(stages) == {"check", *invalidation.STAGES}
    assert listed_keys(stages["check"]["params"], keys) == set(keys), "the check stage must see every key"
    for stage in invalidation.STAGES:
        got = listed_keys(stages[stage].get("params", []), keys)
        want = set(invalidation.stage_keys(stage))
        assert got == want, (f"dvc.yaml stage {stage}: lists but the table does not: {sorted(got - want)}; "
                             f"the table has but dvc.yaml does not list: {sorted(want - got)}")
        assert "artifacts/check.json" in stages[stage]["deps"], f"{stage} must depend on the check stage"


def test_architecture_doc_shows_the_table():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_.0-9]+)` \| ([^|]*) \|", doc, re.M)}
    want = {k: invalidation.stages_text(rule) for k, rule in invalidation.RERUNS.items()}
    assert {k: rows.get(k) for k in want} == want, "docs/ARCHITECTURE.md: re-generate with python -m pipeline.workflow.invalidation"


# --- real DVC on the tiny embedded project ------------------------------------------------------


def schema_field(key: str):
    model, field = Params, None
    for part in key.split("."):
        field = model.model_fields[part]
        model = field.annotation
    return field


def changed_value(key: str, value):
    """A different value of `key`, of the kind a user would type (not necessarily valid together)."""
    annotation = schema_field(key).annotation
    literal = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal]
    if literal:
        return next(c for c in typing.get_args(literal[0]) if c != value)
    if isinstance(value, bool):
        return not value
    if value is None:
        return {"extract.layer_ids": [1, 4, 6, 8], "runtime.shm_size": "16g", "runtime.model_cache": "/tmp/hf"}.get(key, 4)
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if isinstance(value, list):
        return [*value, "HF_TOKEN"]
    return f"{value}-other"


def get_path(d: dict, key: str):
    for part in key.split("."):
        d = d[part]
    return d


def set_path(d: dict, key: str, value) -> None:
    *head, last = key.split(".")
    for part in head:
        d = d[part]
    d[last] = value


def new_tiny_project(root: Path) -> Path:
    """The project as a clone has it (pipeline/, data/, bin/, dvc.yaml) at the TINY params, DVC initialised (no git)."""
    from dvc.repo import Repo

    for name in ("pipeline", "data", "bin"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    Repo.init(str(root), no_scm=True)
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_pipeline):
    """The tiny embedded project reproduced in full (tests/conftest.py `tiny_pipeline`, which asserts every stage ran),
    copied for this module: every slow test below starts from it finished."""
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    return Path(shutil.copytree(tiny_pipeline, tmp_path_factory.mktemp("project") / "tiny", symlinks=True))


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


def changed_stages(root: Path) -> set[str]:
    """The stages `dvc status` reports changed (directly: their own deps, params or outputs)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return {name.rpartition(":")[2] for name in repo.status()}


def set_param(root: Path, section: str, key: str, value) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    set_path(params, f"{section}.{key}", value)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
def test_dvc_status_of_every_key_is_the_table(project):
    """For each key, a changed value: DVC sees exactly the check plus the stages the table names."""
    path = project / "params.yaml"
    original = path.read_text()
    assert changed_stages(project) == set()
    wrong = {}
    try:
        for key, rule in invalidation.RERUNS.items():
            params = yaml.safe_load(original)
            set_path(params, key, changed_value(key, get_path(params, key)))
            path.write_text(yaml.safe_dump(params, sort_keys=False))
            got = changed_stages(project)
            if got != {"check", *rule.stages}:
                wrong[key] = sorted(got)
    finally:
        path.write_text(original)
    assert not wrong, f"DVC would run other stages than the table says: {wrong}"


def output_files(root: Path) -> list[str]:
    """Every file of every output dvc.yaml declares (outs, metrics, plots), folders walked."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    found = []
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for o in stage.get(kind, []):
                path = root / (o if isinstance(o, str) else next(iter(o)))
                found += [str(f.relative_to(root)) for f in sorted(path.rglob("*")) if f.is_file()] if path.is_dir() \
                    else [str(path.relative_to(root))]
    return sorted(found)


def repro_restores(root: Path, stages: set[str], ran: set[str] = frozenset()) -> None:
    """`dvc repro` as typed: it runs no stage command but those of `ran` and restores exactly `stages` from the
    run-cache."""
    proc = dvc_cli(root, "repro")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert set(re.findall(r"Running stage '(\w+)'", out)) == ran, out[-3000:]
    restored = set(re.findall(r"Stage '(\w+)' is cached - skipping run", out))
    assert restored == stages, out[-3000:]


@pytest.mark.slow
def test_a_changed_key_reruns_its_stages_and_what_their_changed_outputs_feed(project):
    """... and changed back, every stage it ran comes back from DVC's run-cache, the same bytes, running nothing."""
    assert reproduce(project) == set(), "no change must run nothing"
    original = (project / "params.yaml").read_text()
    first = digests(project, output_files(project))

    # engine tuning, all at once (any of them that reached a stage's params would add that stage; each key's own
    # place is test_dvc_status_of_every_key_is_the_table's)
    tuning = (("extract.max_num_seqs", 7), ("verify.workers", 1), ("eval.cpu_kvcache_gib", 2), ("data.regenerate.max_num_seqs", 3))
    for key, value in tuning:
        section, _, name = key.partition(".")
        set_param(project, section, name, value)
    assert reproduce(project) == {"check"}, f"{[k for k, _ in tuning]} are engine tuning: only the check runs"

    # with regeneration off, regenerate writes the same {"enabled": false}: prepare re-runs for its own key
    set_param(project, "data", "seq_len", 200)
    assert reproduce(project) == {"check", "regenerate", "prepare", "extract", "verify", "train", "eval"}

    set_param(project, "train", "lr", OTHER_LR)
    assert reproduce(project) == {"check", "train", "eval"}

    # the verdict is deterministic, so a verify-only change that passes again stops at verify
    set_param(project, "verify", "reference_samples", 3)
    assert reproduce(project) == {"check", "verify"}

    set_param(project, "eval", "max_tokens", 6)
    assert reproduce(project) == {"check", "eval"}
    assert reproduce(project) == set()

    # changed back, one stage's param at a time, then all of them
    before = digests(project, output_files(project))
    set_param(project, "eval", "max_tokens", TINY["eval"]["max_tokens"])
    repro_restores(project, {"check", "eval"})
    set_param(project, "eval", "max_tokens", 6)  # and forward again, to the value run above: no run, the same bytes
    repro_restores(project, {"check", "eval"})
    assert digests(project, output_files(project)) == before
    # params.yaml as a whole is new (only the check's output is the same bytes): the check runs, verify is restored
    set_param(project, "verify", "reference_samples", TINY["verify"]["reference_samples"])
    repro_restores(project, {"verify"}, ran={"check"})
    (project / "params.yaml").write_text(original)
    repro_restores(project, {"check", "regenerate", "prepare", "extract", "verify", "train", "eval"})
    assert output_files(project) == sorted(first) and digests(project, output_files(project)) == first
    assert changed_stages(project) == set()


def dvc_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, capture_output=True, text=True, timeout=900, env=env)


def digests(root: Path, paths) -> dict[str, str]:
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in paths}


@pytest.mark.slow
@pytest.mark.parametrize("key, typed, named", [
    ("verify.reference_samples", "eight", "verify.reference_samples"),
    ("verify.reference_samples", 0, "verify.reference_samples"),
    ("data.seq_len", 4096, "max_position_embeddings is 2048"),
])
def test_a_typo_costs_no_finished_output(project, key, typed, named):
    """As typed: a finished pipeline, a bad value, `dvc repro verify` refused naming it, verify's
    outputs (the cache: false report and metrics too) untouched; fixed, `dvc repro` re-runs nothing."""
    assert reproduce(project) == set()
    before = digests(project, VERIFY_OUTS)
    path = project / "params.yaml"
    original = path.read_text()
    section, _, name = key.partition(".")
    set_param(project, section, name, typed)
    proc = dvc_cli(project, "repro", "verify")
    assert proc.returncode != 0
    assert named in proc.stderr + proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert digests(project, VERIFY_OUTS) == before
    path.write_text(original)
    assert reproduce(project) <= {"check"}, "fixed: the check (or its run-cache) and nothing else"
    assert digests(project, VERIFY_OUTS) == before
    assert changed_stages(project) == set()


@pytest.mark.slow
def test_dvc_repro_as_typed_from_a_new_shell(project):
    """`make setup` made .venv; a new shell has neither it on PATH nor PYTHONPATH (env -i)."""
    os.symlink(ROOT / ".venv", project / ".venv")
    shell = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    try:
        set_param(project, "verify", "seed", 1)  # verify runs (real stage, real engine-free work)
        proc = subprocess.run([".venv/bin/dvc", "repro"], cwd=project, env=shell, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Running stage 'verify'" in proc.stdout and "Running stage 'model'" not in proc.stdout
        set_param(project, "extract", "max_num_seqs", 5)  # only the check runs, this time in an activated shell
        proc = subprocess.run(["sh", "-c", ". .venv/bin/activate && dvc repro && dvc status"], cwd=project,
                              env=shell, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Running stage 'check'" in proc.stdout and "up to date" in proc.stdout, proc.stdout
    finally:
        (project / ".venv").unlink()


def lock_outs(root: Path, stages) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {f"{s}:{o['path']}": o.get("md5") for s in stages for o in lock[s].get("outs", [])}


@pytest.mark.slow
def test_a_second_run_gives_the_same_bytes(project):
    """model, prepare, extract and verify run again alone (-f -s): dvc.lock records the same hashes for
    what later stages read (verify's report and metrics hold timings: not compared)."""
    assert reproduce(project) == set()
    stages = ("check", "model", "prepare", "extract")
    before = {**lock_outs(project, stages), "verdict": digests(project, VERIFY_OUTS[:1])}
    for stage in (*stages, "verify"):
        assert reproduce(project, targets=[stage], force=True, single_item=True) == {stage}
    after = {**lock_outs(project, stages), "verdict": digests(project, VERIFY_OUTS[:1])}
    after = {k: v for k, v in after.items() if "metrics/" not in k}
    before = {k: v for k, v in before.items() if "metrics/" not in k}
    assert after == before
    assert changed_stages(project) == set()


# --- a killed training --------------------------------------------------------------------------

DRAFT = Path("artifacts/draft")
KEPT_EPOCH_0 = Path("artifacts/.partial/draft/0/epoch_metrics.json")  # a complete epoch, kept by the launcher


def draft_files(root: Path) -> dict[str, bytes]:
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / DRAFT).rglob("*")) if p.is_file()}
    return files | {m: (root / m).read_bytes() for m in ("metrics/train.json", "metrics/train_curve.csv")}


@pytest.mark.slow
def test_killed_training_resumes_from_its_last_complete_epoch(project: Path) -> None:
    """train's output is not persist (so DVC run-caches it): DVC deletes it before the run, and the
    launcher puts the kept epochs back. The kill and the retyped command as in tests/test_recovery.py."""
    from tests.test_recovery import kill_when, retype, up_to_date

    set_param(project, "train", "epochs", 3)
    kill_when(project, KEPT_EPOCH_0, "repro", "train")  # after its first complete epoch
    assert not (project / DRAFT / "final.json").exists()
    out = retype(project, "repro", "train")
    assert "Running stage 'train'" in out, out[-3000:]
    resumed = re.search(r"resuming after epoch (\d+)", out)
    assert resumed and int(resumed.group(1)) < 2, out[-3000:]
    assert "Starting fresh training run" not in out, out[-3000:]
    assert json.loads((project / "metrics/train.json").read_text())["epochs_trained"] == 3
    up_to_date(project, "train")
    assert not (project / "artifacts" / ".partial").exists(), "a completed run keeps no checkpoints beside it"


@pytest.mark.slow
def test_killed_training_then_a_param_changed_back_restores_the_finished_draft(project: Path) -> None:
    from tests.test_recovery import env, kill_when, retype, up_to_date

    before = draft_files(project)
    set_param(project, "train", "lr", OTHER_LR)
    kill_when(project, KEPT_EPOCH_0, "repro", "train")
    set_param(project, "train", "lr", yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["lr"])
    out = retype(project, "repro", "train")
    assert "Stage 'train' is cached - skipping run, checking out outputs" in out, out[-3000:]
    assert "Running stage 'train'" not in out, out[-3000:]
    assert draft_files(project) == before, "the finished draft, its metrics and curve, byte for byte"
    up_to_date(project, "train")
    # the killed run's checkpoint (another lr: never resumed) goes at the end of `make train` (its summary), or
    # with the next stage run under bare `dvc repro`
    assert (project / "artifacts/.partial/draft").is_dir() and (project / "artifacts/draft.lock").is_file()
    summary = subprocess.run([sys.executable, "-m", "pipeline", "summary"], cwd=project, env=env(project),
                             capture_output=True, text=True)
    assert summary.returncode == 0, summary.stderr[-3000:]
    assert "tidied what a killed run left" in summary.stdout and "artifacts/.partial/draft" in summary.stdout, summary.stdout
    assert not (project / "artifacts" / ".partial").exists() and not (project / "artifacts/draft.lock").exists()
    up_to_date(project, "train")
@pytest.mark.slow
def test_fp8_shards_run_end_to_end(project):
    """extract.dtype float8_e4m3 on the embedded default: extract stores format version 2, verify passes it with its
    fp8 tolerances, train reads the fp8 shards themselves and eval measures the draft."""
    from pipeline.hidden_states import format as shard_format

    set_param(project, "extract", "dtype", "float8_e4m3")
    reproduce(project, targets=["extract"])
    hs = project / "artifacts" / "hidden_states"
    meta = shard_format.read_meta(hs)
    assert (meta["dtype"], meta["format_version"]) == ("float8_e4m3", 2)
    assert reproduce(project) == {"verify", "train", "eval"}  # check ran with extract, upstream of it
    assert all(shard_format.read_manifest(p)["format_version"] == 2 for p in shard_format.complete_shards(hs))
    assert not list(project.glob("artifacts/**/*dequant*")), "no dequantized second copy on disk"
    verify = json.loads((project / "metrics" / "verify.json").read_text())
    assert verify["passed"] and verify["dtype"] == "float8_e4m3"
    assert all("quantization_bound" in row for row in verify["layers"].values())
    evaluated = json.loads((project / "metrics" / "eval.json").read_text())
    assert evaluated["tau"] >= 1
    assert reproduce(project) == set()
