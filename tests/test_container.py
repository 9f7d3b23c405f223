"""The pipeline in a real container: a real Docker engine, the CPU image of docker/Dockerfile.cpu,
the embedded default (on small params) through `dvc repro` with runtime.mode: docker.

One module-scoped sequence, asserted on by the tests below:
    1. native `dvc repro` of the project (the reference);
    2. the same project and params in another directory, runtime.mode: docker, `dvc repro` as a
       non-root uid: `docker kill` of the extract container once it has written a shard;
    3. `dvc repro` again: extract resumes, every later stage runs, all in containers.
Each container start is seen in the engine's own event stream (the launcher labels each container
with its stage), so "every stage ran in the container" is the engine's word, not the launcher's.

Needs a Docker engine and the registry of docker/engine.sh on 127.0.0.1:5000 (for the base's
digest): `.ci/run` brings both up. Under CI=true a missing engine fails these tests; elsewhere
they are skipped. The image is built here (docker/base.sh, docker/build.sh) unless it already is.
"""

from __future__ import annotations

import grp
import json
import os
import pty
import select
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.hidden_states import format as shards
from pipeline.params import load_params
from pipeline.workflow import launcher, output_guard

pytestmark = [pytest.mark.slow, pytest.mark.container]
ROOT = Path(__file__).resolve().parents[1]
STAGES = ("model", "regenerate", "prepare", "extract", "verify", "train", "eval")
UID = 4242  # the caller when the tests run as root: a uid with no passwd entry, as on a shared host
# the embedded default, made small: ~1 min of CPU per stage at most
SMALL = {
    "model": {"embedded": {"train_steps": 40}},
    "data": {"max_samples": 96},
    "extract": {"samples_per_shard": 4},
    "verify": {"reference_samples": 4},
    "train": {"epochs": 2},
    "eval": {"num_prompts": 8, "max_tokens": 32},
}
COPIED = ("pipeline", "data", "bin", "docker", "requirements", "dvc.yaml", "pyproject.toml", "Makefile")


def merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return base


def engine_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def cpu_base() -> str:
    """runtime.image of the CPU recipe: $EAGLE3_CPU_BASE (.ci/run sets it) or docker/base.sh's answer."""
    if not engine_answers():
        msg = "no Docker engine answers: `docker/engine.sh up` (as root) starts one, as .ci/run does"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    if os.environ.get("EAGLE3_CPU_BASE"):
        return os.environ["EAGLE3_CPU_BASE"]
    proc = subprocess.run(["bash", str(ROOT / "docker" / "base.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1]


def reachable_by_all(path: Path) -> bool:
    return all(p.stat().st_mode & stat.S_IXOTH for p in [*path.parents][:-1])


@pytest.fixture(scope="module")
def caller_bin() -> Path:
    """The bin directory of a Python with this venv's packages that the caller can run. As root,
    with the venv's base Python under a private home (pyenv in /root), that is a venv of the
    system's Python of the same version reading this venv's site-packages."""
    here = Path(sys.executable).parent
    if os.getuid() != 0 or reachable_by_all(Path(os.path.realpath(sys._base_executable))):
        return here
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    assert system.is_file(), f"no Python the test uid can run: {sys._base_executable} is private and {system} is missing"
    venv = made_dir("eagle3-caller-venv-")
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (next(venv.glob("lib/python*/site-packages")) / "caller-venv.pth").write_text("\n".join(sorted(site)) + "\n")
    return venv / "bin"


def caller() -> dict:
    """subprocess arguments that run as the caller the tests stand for: uid 4242 (in the docker
    group, to reach the engine) when they run as root, else the user running them."""
    if os.getuid() != 0:
        return {}
    return {"user": UID, "group": UID, "extra_groups": [grp.getgrnam("docker").gr_gid]}


BIN: list[Path] = []  # caller_bin, set by the fixtures below before any project runs
MADE: list[Path] = []  # directories made under /var/tmp, removed at the end


# EAGLE3_KEEP_CONTAINER_PROJECTS=1 keeps the projects (native, docker, ...) for inspection: their paths are printed
KEEP = os.environ.get("EAGLE3_KEEP_CONTAINER_PROJECTS") == "1"


@pytest.fixture(scope="module", autouse=True)
def _remove_made_dirs():
    yield
    for top in MADE:
        if KEEP:
            print(f"\nkept (EAGLE3_KEEP_CONTAINER_PROJECTS=1): {top}")
        else:
            shutil.rmtree(top, ignore_errors=True)


def made_dir(prefix: str) -> Path:
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    top.chmod(0o755)
    MADE.append(top)
    return top


def new_project(name: str, base: str, mode: str, **params) -> Path:
    """A copy of the project, owned by the caller, in a directory the caller can reach."""
    top = made_dir(f"eagle3-{name}-")
    root = top / "repo"
    root.mkdir()
    for rel in COPIED:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / rel)
    os.symlink(BIN[0].parent, root / ".venv")  # for `make docker-shell`
    raw = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL)
    raw["runtime"].update(mode=mode, recipe="cpu", image=base, gpus="none")
    (root / "params.yaml").write_text(yaml.safe_dump(merge(raw, params), sort_keys=False))
    (top / "home").mkdir()
    if os.getuid() == 0:
        for p in [top, *top.rglob("*")]:
            os.lchown(p, UID, UID)
    run(root, ["python", "-m", "dvc", "init", "--no-scm", "-q"])
    return root


def env_for(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != launcher.IN_CONTAINER}
    env.update(HOME=str(root.parent / "home"), PYTHONPATH=str(root), TQDM_DISABLE="1",
               PATH=f"{BIN[0]}{os.pathsep}{env['PATH']}",
               DVC_SITE_CACHE_DIR=str(root.parent / "dvc-site"))
    if os.getuid() == 0:  # the test uid has no passwd entry: getpass.getuser() (DVC, torch) reads these
        env.update(USER="eagle3-caller", LOGNAME="eagle3-caller")
    return env


def run(root: Path, argv: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
    argv = [str(BIN[0] / "python"), *argv[1:]] if argv[0] in ("python", sys.executable) else argv
    return subprocess.run(argv, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout,
                          **caller())


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def stage_starts(since: str) -> list[str]:
    """The stage label of every container the engine started since `since`, in order."""
    until = now()
    proc = subprocess.run(["docker", "events", "--since", since, "--until", until, "--filter", "type=container",
                           "--filter", "event=start", "--filter", f"label={launcher.STAGE_LABEL}",
                           "--format", "{{json .Actor.Attributes}}"], capture_output=True, text=True, check=True)
    return [json.loads(line)[launcher.STAGE_LABEL] for line in proc.stdout.splitlines()]


def kill_extract_after_a_shard(root: Path, proc: subprocess.Popen) -> None:
    """`docker kill` the extract container as soon as one shard is complete in its work directory."""
    work = root / output_guard.partial_path(layout.HIDDEN_STATES_DIR)
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline and proc.poll() is None:
        ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label={launcher.STAGE_LABEL}=extract"],
                             capture_output=True, text=True).stdout.split()
        if ids and work.is_dir() and any(work.glob("shard-*.json")):
            subprocess.run(["docker", "kill", *ids], check=True, capture_output=True)
            return
        time.sleep(0.2)
    raise AssertionError(f"extract never wrote a shard in its container (dvc repro exit: {proc.poll()})")


@pytest.fixture(scope="module")
def cpu_image(cpu_base: str, caller_bin: Path) -> str:
    BIN[:] = [caller_bin]
    tag = launcher.image_tag(cpu_base, launcher.recipe_digest(ROOT, "cpu"))
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
        proc = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "docker/Dockerfile.cpu", cpu_base, tag],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tag


@pytest.fixture(scope="module")
def runs(cpu_base: str, cpu_image: str) -> dict:
    native = new_project("native", cpu_base, "native")
    t0 = time.monotonic()
    proc = run(native, ["python", "-m", "dvc", "repro", "-q"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    native_wall = time.monotonic() - t0

    docker = new_project("docker", cpu_base, "docker")
    since = now()
    t0 = time.monotonic()
    killed = subprocess.Popen([str(BIN[0] / "python"), "-m", "dvc", "repro"], cwd=docker, env=env_for(docker), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, **caller())
    try:
        kill_extract_after_a_shard(docker, killed)
        killed_out, _ = killed.communicate(timeout=300)
    finally:  # a failure here must not leave that dvc repro starting containers under the next tests
        if killed.poll() is None:
            killed.kill()
            killed.communicate()
            for cid in subprocess.run(["docker", "ps", "-q", "--filter", f"label={launcher.STAGE_LABEL}"],
                                      capture_output=True, text=True).stdout.split():
                subprocess.run(["docker", "kill", cid], capture_output=True)
    # kept shards: both files linked (the mirror's listing can race a rename and keep a manifest without its data)
    after_kill = [shards.manifest_path(p).name for p in shards.complete_shards(docker / output_guard.partial_path(layout.HIDDEN_STATES_DIR))]
    resumed = run(docker, ["python", "-m", "dvc", "repro"])
    docker_wall = time.monotonic() - t0
    return {"native": native, "docker": docker, "killed_rc": killed.returncode, "killed_out": killed_out,
            "after_kill": after_kill, "resumed": resumed, "starts": stage_starts(since),
            "native_wall": native_wall, "docker_wall": docker_wall}


def lock_outs(root: Path) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", []) if "md5" in o}


def test_every_stage_runs_in_the_container_and_resumes_after_docker_kill(runs):
    assert runs["killed_rc"] != 0, runs["killed_out"][-3000:]
    assert runs["after_kill"], "the kill left the finished shards in the work directory"
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    # the first run: model .. extract (killed); the second: extract again, then the rest
    assert runs["starts"] == ["model", "regenerate", "prepare", "extract", "extract", "verify", "train", "eval"]
    metrics = json.loads((runs["docker"] / "metrics" / "extract.json").read_text())
    assert metrics["shards_resumed"] >= len(runs["after_kill"]) >= 1
    print(f"\nwall: native dvc repro {runs['native_wall']:.0f} s, docker (killed + resumed) {runs['docker_wall']:.0f} s")


def test_outputs_are_byte_identical_to_the_native_run_and_tau_is_the_same(runs):
    native, docker = lock_outs(runs["native"]), lock_outs(runs["docker"])
    for out in ("artifacts/model", "artifacts/regenerated", "artifacts/prepared", "artifacts/hidden_states"):
        assert docker[out] == native[out], out
    verdict = json.loads((runs["docker"] / layout.VERIFY_VERDICT).read_text())
    assert verdict["passed"]
    tau = [json.loads((r / "metrics" / "eval.json").read_text())["tau"] for r in (runs["native"], runs["docker"])]
    assert tau[0] == tau[1]
    assert json.loads((runs["docker"] / layout.TRAIN_METRICS).read_text()) != {}


def test_outputs_belong_to_the_caller_and_are_group_readable(runs):
    root = runs["docker"]
    uid = UID if os.getuid() == 0 else os.getuid()
    assert not (root / output_guard.PARTIAL_DIR).exists()
    for top in ("artifacts", "metrics", "reports"):
        for p in [root / top, *(root / top).rglob("*")]:
            st = p.lstat()
            assert st.st_uid == uid, f"{p} is owned by uid {st.st_uid}"
            assert st.st_mode & 0o002 == 0, f"{p} is world-writable ({oct(st.st_mode)})"
            if p.is_file():
                assert st.st_mode & 0o040, f"{p} is not group-readable ({oct(st.st_mode)})"


@pytest.fixture(scope="module")
def external_model(runs) -> Path:
    """The embedded target's HF directory, copied outside any repo, as a user's model.path."""
    model = made_dir("eagle3-model-") / "tiny"
    shutil.copytree(runs["native"] / layout.MODEL_DIR, model, ignore=shutil.ignore_patterns("target.json"))
    for p in [model.parent, *model.parent.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return model


def test_model_dir_is_mounted_read_only_and_stages_run_offline(cpu_base, cpu_image, external_model):
    root = new_project("shell", cpu_base, "docker", model={"path": str(external_model)})
    proc = run(root, [sys.executable, "-m", "pipeline", "run", "model"])
    assert proc.returncode == 0, proc.stderr
    assert f"-v {external_model}:{external_model}:ro" in proc.stderr and "--network=none" in proc.stderr
    assert json.loads((root / layout.TARGET_JSON).read_text())["path"] == str(external_model)

    # `make docker-shell`: the image as the stages get it (a real terminal: it runs `docker run -it`)
    # (the terminal echoes what is typed: each marker is printed as `$((...))` so only its output matches)
    script = (f"echo uid=$((0+$(id -u))) cwd=$(pwd)/; touch {external_model}/x || echo model-ro-$((1+1)); "
              "python3 -c 'import socket; socket.create_connection((\"pypi.org\", 443), timeout=5)' "
              "2>/dev/null || echo offline-$((1+1)); python3 -c 'import pipeline, vllm; print(pipeline.__file__)'; exit\n")
    out = in_terminal(root, ["make", "-o", "setup", "docker-shell"], script)
    uid = UID if os.getuid() == 0 else os.getuid()
    assert f"uid={uid} cwd={root}/" in out, out[-3000:]
    assert "Read-only file system" in out and "model-ro-2" in out, out[-3000:]
    assert "offline-2" in out, out[-3000:]
    assert f"{root}/pipeline/__init__.py" in out, "the stage code is the working tree's, not the image's copy"


def in_terminal(root: Path, argv: list[str], typed: str, timeout: float = 300) -> str:
    """Run `argv` on a pseudo-terminal, type `typed`, return everything it printed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=root, env=env_for(root), stdin=slave, stdout=slave, stderr=slave, **caller())
    os.close(slave)
    os.write(master, typed.encode())
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the shell exited
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    return out.decode(errors="replace")


def test_a_stale_image_is_refused_with_the_fix(cpu_base, cpu_image):
    root = new_project("stale", cpu_base, "docker")
    with open(root / "docker" / "Dockerfile.cpu", "a") as f:
        f.write("# a changed recipe\n")
    since = now()
    proc = run(root, [sys.executable, "-m", "pipeline", "run", "prepare"])
    assert proc.returncode == 1
    assert "is not built" in proc.stderr and "make docker-build" in proc.stderr, proc.stderr
    assert cpu_image in proc.stderr, "names the image that is built (the stale one)"
    assert "Traceback" not in proc.stderr
    assert stage_starts(since) == [], "no container started"
    assert load_params(root / "params.yaml").runtime.recipe == "cpu"
