"""The one launcher behind every dvc.yaml cmd (`python -m pipeline run <stage>`).

`runtime.mode: native` runs the stage in this process. `runtime.mode: docker` replaces this
process with `docker run ... <image> python3 -m pipeline run <stage>`, which runs the very same
entry point inside the container, natively there (EAGLE3_IN_CONTAINER=1 tells it where it is).
The working tree is mounted at its own path with `-w` that path, so relative paths, DVC's view of
the outputs and the absolute model path in target.json mean the same on both sides, and the
stage code that runs is the working tree's, not the copy installed in the image.

`launch_argv` is a pure function of the params and a `Host` snapshot; tests/test_launcher.py
asserts its exact output. `launch` is the impure part (reads the host, prepares mounts, execs).

Resumable outputs and the lock against a second run: pipeline/workflow/output_guard.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.params import Params, RuntimeParams
from pipeline.workflow.output_guard import output_locks, resumable_outputs, tidy_left_behind

IN_CONTAINER = "EAGLE3_IN_CONTAINER"
IMAGE_REPO = "eagle3-pipeline"
# runtime.recipe -> what its image is built from beside the base image (the Dockerfile first): a
# change to any of them gives a new tag, so a stale image is never run (`check_image` refuses it)
RECIPES: dict[str, tuple[str, ...]] = {
    "gpu": ("docker/Dockerfile", "requirements/container.txt", "requirements/no-deps.txt", "pyproject.toml"),
    "cpu": ("docker/Dockerfile.cpu", "requirements/cpu.txt", "requirements/no-deps.txt", "pyproject.toml"),
    "gpu-debian": ("docker/Dockerfile.gpu-debian", "requirements/gpu-cp311.txt", "pyproject.toml"),
}
RECIPE_FILES = RECIPES["gpu"]
STAGE_LABEL = "eagle3-pipeline.stage"  # `docker ps --filter label=eagle3-pipeline.stage=extract`
# host environment passed into the container by name (docker takes the value from its own env)
PASS_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "HF_HUB_OFFLINE",
    "HF_TOKEN",
    "OMP_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TOKENIZERS_PARALLELISM",
    "TRANSFORMERS_OFFLINE",
)
PASS_ENV_PREFIXES = ("VLLM_", "NCCL_")
# stage -> outputs a killed run resumes from (pipeline/workflow/output_guard.py): none is `persist: true`
# in dvc.yaml, so that DVC's run-cache can restore every stage
RESUMABLE: dict[str, tuple[Path, ...]] = {
    "extract": (layout.HIDDEN_STATES_DIR,),
    "regenerate": (layout.REGENERATED_DIR,),
    "train": (layout.DRAFT_DIR,),  # its epoch checkpoints
}


def resumable(stage: str, params: Params, environ: Mapping[str, str]) -> tuple[Path, ...]:
    """The outputs this run of `stage` keeps work of: on several training nodes only node 0's, which alone
    writes the draft (pipeline/stages/train.py); the others' runs leave it to node 0."""
    if stage == "train" and params.train.nnodes > 1:
        rank = params.train.node_rank if params.train.node_rank is not None else environ.get("NODE_RANK")
        if str(rank).strip() != "0":
            return ()
    return RESUMABLE.get(stage, ())


def tidy_other_stages(stage: str | None = None) -> list[Path]:
    """Tidy what killed runs left beside the resumable outputs of every stage but `stage`
    (pipeline/workflow/output_guard.py: a run-cache restore runs nothing that could); returns what went."""
    return tidy_left_behind([o for s, outs in RESUMABLE.items() if s != stage for o in outs])


@dataclass(frozen=True)
class Host:
    """Everything about the calling machine that the docker command line depends on."""

    repo: Path  # absolute; the stage's working directory (DVC runs each cmd in the repo root)
    uid: int
    gid: int
    home: Path
    environ: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def current(cls) -> Host:
        return cls(Path.cwd().absolute(), os.getuid(), os.getgid(), Path.home(), dict(os.environ))


def in_container(host: Host) -> bool:
    return host.environ.get(IN_CONTAINER) == "1"


def image_tag(base_image: str, recipe: str) -> str:
    """Local tag of the image built FROM `base_image`: eagle3-pipeline:<base tag>-<digest12>-<recipe>."""
    name, _, digest = base_image.partition("@")
    tag = name.rsplit("/", 1)[-1].rpartition(":")[2]
    return f"{IMAGE_REPO}:{tag}-{digest.removeprefix('sha256:')[:12]}-{recipe}"


def recipe_digest(root: Path, recipe: str = "gpu") -> str:
    """8 hex digits of SHA-256 over the files the recipe's image is built from (RECIPES)."""
    h = hashlib.sha256()
    for rel in RECIPES[recipe]:
        h.update(rel.encode() + b"\0")
        p = root / rel
        h.update(p.read_bytes() if p.is_file() else b"(missing)")
        h.update(b"\0")
    return h.hexdigest()[:8]


def model_cache(runtime: RuntimeParams, host: Host) -> Path:
    """The host's Hugging Face cache, mounted at the same path and exported as HF_HOME."""
    if runtime.model_cache:
        p = Path(runtime.model_cache)
        p = host.home / p.relative_to("~") if p.parts[:1] == ("~",) else p
    elif host.environ.get("HF_HOME"):
        p = Path(host.environ["HF_HOME"])
    else:
        p = host.home / ".cache" / "huggingface"
    return p if p.is_absolute() else host.repo / p


def passed_env(runtime: RuntimeParams, environ: Mapping[str, str]) -> list[str]:
    """Names of host variables passed through, sorted; HF_HOME and IN_CONTAINER are set explicitly."""
    wanted = set(PASS_ENV) | set(runtime.env)
    names = {n for n in environ if n in wanted or n.startswith(PASS_ENV_PREFIXES)}
    return sorted(names - {"HF_HOME", IN_CONTAINER})


def stage_command(stage: str, params_file: Path | str) -> list[str]:
    """What runs inside the container: the same entry point as every dvc.yaml cmd."""
    return ["python3", "-m", "pipeline", "--params", str(params_file), "run", stage]


def docker_argv(
    command: Sequence[str],
    *,
    runtime: RuntimeParams,
    image: str,
    host: Host,
    mounts: Sequence[Path] = (),
    interactive: bool = False,
    stage: str = "shell",
) -> list[str]:
    """`docker run` for `command` in `image`; `mounts` (host paths outside the repo) go in read-only."""
    repo, cache = str(host.repo), str(model_cache(runtime, host))
    argv = ["docker", "run", "--rm", "--init", "--pull=never", f"--network={runtime.network}", "--label", f"{STAGE_LABEL}={stage}"]
    if runtime.gpus != "none":
        argv += ["--gpus", runtime.gpus]
    argv += [f"--shm-size={runtime.shm_size}"] if runtime.shm_size else ["--ipc=host"]
    argv += ["-u", f"{host.uid}:{host.gid}", "-v", f"{repo}:{repo}", "-w", repo, "-v", f"{cache}:{cache}"]
    for m in mounts:
        argv += ["-v", f"{m}:{m}:ro"]
    argv += ["-e", f"HF_HOME={cache}", "-e", "PYTHONUNBUFFERED=1", "-e", f"{IN_CONTAINER}=1"]
    for name in passed_env(runtime, host.environ):
        argv += ["-e", name]
    if interactive:
        argv += ["-it"]
    return [*argv, image, *command]


def _outside(path: Path, repo: Path) -> bool:
    return not path.is_relative_to(repo)


def input_mounts(params: Params, params_file: Path | str, host: Host, is_dir=os.path.isdir, is_file=os.path.isfile) -> list[Path]:
    """Inputs that live outside the repo and so must be mounted: a real model.path directory,
    data.path and the params file. Paths are made absolute against the repo; the checks are
    injectable so tests need no real files."""
    found: list[Path] = []
    candidates = [] if params.model.is_embedded else [(Path(params.model.path), is_dir)]
    candidates += [(Path(params.data.path), is_file), (Path(params_file), is_file)]
    for path, check in candidates:
        p = Path(os.path.normpath(host.repo / path.expanduser()))
        if _outside(p, host.repo) and check(str(p)) and p not in found:
            found.append(p)
    return found


def launch_argv(
    stage: str, params: Params, params_file: Path | str, host: Host, image: str, mounts: Sequence[Path] = ()
) -> list[str] | None:
    """The command that runs `stage`, or None when it runs here, in this process (native mode, or
    already inside the container)."""
    if params.runtime.mode == "native" or in_container(host):
        return None
    return docker_argv(stage_command(stage, params_file), runtime=params.runtime, image=image, host=host, mounts=mounts,
                       stage=stage)


def built_image(params: Params, root: Path) -> str:
    return image_tag(params.runtime.image, recipe_digest(root, params.runtime.recipe))


def check_image(params: Params, image: str) -> None:
    """Refuse, before any container starts, an image that is not built from the recipe as it is now."""
    recipe = RECIPES[params.runtime.recipe]
    try:
        proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True)
    except FileNotFoundError:
        raise PipelineError(
            "runtime.mode is docker but `docker` is not installed here; set runtime.mode: native or install Docker"
        ) from None
    if proc.returncode == 0:
        return
    if "No such image" not in proc.stderr:
        raise PipelineError(f"runtime.mode is docker but the Docker engine did not answer ({proc.stderr.strip()}): "
                            f"start it (as root: docker/engine.sh up) or set runtime.mode: native")
    listed = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE_REPO],
                            capture_output=True, text=True).stdout.split()
    others = f" (built here: {', '.join(listed)}: stale, or from another runtime.image)" if listed else ""
    raise PipelineError(
        f"the image {image} is not built: it is the image of runtime.image {params.runtime.image} and "
        f"runtime.recipe {params.runtime.recipe} ({', '.join(recipe)}) as they are now{others}. "
        f"The recipe changed since the last build, or it was never built: run `make docker-build`"
    )


def launch(stage: str, params: Params, params_file: Path, run_native) -> None:
    """Run `stage`: `run_native()` here, or exec docker (this process is replaced by it)."""
    host = Host.current()
    docker = params.runtime.mode == "docker" and not in_container(host)
    mounts = input_mounts(params, params_file, host) if docker else []
    image = built_image(params, host.repo) if docker else ""
    argv = launch_argv(stage, params, params_file, host, image, mounts)
    if argv is None:
        outs = resumable(stage, params, host.environ)
        with output_locks(stage, outs), resumable_outputs(outs):
            tidy_other_stages(stage)
            run_native()
        return
    check_image(params, image)
    model_cache(params.runtime, host).mkdir(parents=True, exist_ok=True)  # else docker creates it as root
    print(f"[{stage}] {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        raise PipelineError(
            f"runtime.mode is docker but `{argv[0]}` is not installed here; set runtime.mode: native or install Docker"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipeline.workflow.launcher image|recipe|tag|shell` for the Makefile's docker targets."""
    import argparse
    import shlex

    from pipeline.params import load_params

    ap = argparse.ArgumentParser(prog="python -m pipeline.workflow.launcher")
    ap.add_argument("what", choices=["image", "recipe", "tag", "shell"],
                    help="base image | recipe's Dockerfile | built image tag | docker-shell argv")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--print-only", action="store_true", help="shell: print the docker command, do not run it")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    host = Host.current()
    if args.what == "image":
        print(params.runtime.image)
    elif args.what == "recipe":
        print(RECIPES[params.runtime.recipe][0])
    elif args.what == "tag":
        print(built_image(params, host.repo))
    else:  # an interactive shell in the stages' container, as they get it
        mounts = input_mounts(params, args.params, host)
        image = built_image(params, host.repo)
        argv = docker_argv(["bash"], runtime=params.runtime, image=image, host=host, mounts=mounts, interactive=True)
        print(shlex.join(argv), file=sys.stderr, flush=True)
        if not args.print_only:
            try:
                check_image(params, image)
            except PipelineError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            model_cache(params.runtime, host).mkdir(parents=True, exist_ok=True)
            os.execvp(argv[0], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
