"""`make bundle`: the wheels a stack needs, checksummed, for a host with no network; `make setup BUNDLE=` reads it.

A bundle is a directory: manifest.json (stack, CPython version, platform, what was left out and why), SHA256SUMS,
wheels/. The GPU stack's wheels are downloaded with --require-hashes against its lock, for the host's CPython and
Linux x86_64 whatever machine writes it. Two options shrink it for hosts that take only small transfers:
- host_packages: what the host's Python already holds (`python3 -m pip list --format=freeze` there, or bare names):
  left out of the bundle, for `make setup PYTHON=` on that Python, which installs only what is missing;
- cut_arch: vLLM cut to the kernels one GPU generation loads (its CUDA fat binaries to that SASS, the trees other
  generations use removed), the packages the offline engine never imports left out (CUT_LEAVES_OUT), every wheel
  stored uncompressed, and the whole as one xz tar in parts of at most part_mib MiB (bundle.tar.xz.part01, ...).
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

from pipeline.install import fatbin
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
)

# Installed from the bundle whatever the host holds: what `pip install -e .` builds the project with.
ALWAYS = {"setuptools"}
# The lock's packages without a wheel on PyPI (pure Python): their sdist is downloaded and built into a wheel.
SDIST_ONLY = {"antlr4-python3-runtime"}
# Left out by the cut: kernels vLLM imports only where present (flashinfer, cutlass-dsl, tilelang, quack, deep-gemm,
# humming, tokenspeed, fastsafetensors, torchcodec), the OpenAI/Anthropic server and its telemetry, Mistral's
# tokenizers, CUDA compilers (nvcc, nvvm: only JIT kernel builds need them), Ray (extract.engine: ray) and DVC's S3
# remote with its boto stack. `make setup` names them; a feature that needs one says so when it is used.
CUT_LEAVES_OUT = {
    "flashinfer-python", "flashinfer-cubin", "tilelang", "z3-solver", "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13", "cuda-python", "quack-kernels", "deep-gemm", "humming-kernels", "tokenspeed-mla",
    "tokenspeed-triton", "fastsafetensors", "torchcodec", "cuda-tile", "mistral-common", "pycountry", "anthropic",
    "mcp", "mcp-types", "fastapi-cloud-cli", "model-hosting-container-standards", "uvicorn",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto", "opentelemetry-semantic-conventions",
    "opentelemetry-semantic-conventions-ai", "opentelemetry-exporter-otlp", "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-http-transport", "nvidia-cuda-nvcc",
    "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-nvdisasm", "nvidia-cuda-cccl", "ray", "dvc-s3", "s3fs",
    "aiobotocore", "botocore", "boto3", "s3transfer", "jmespath",
}
# Inside vLLM's wheel, what one GPU generation never loads (arch 90, Hopper): FlashAttention-2 (pre-Hopper), the
# Blackwell fmha tree, vendored DeepGEMM (fp8 block GEMMs), the Rust frontend and the API server's Swagger assets.
CUT_VLLM_PATHS = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/",
                  "vllm/third_party/fmha_sm100/", "vllm/entrypoints/serve/instrumentator/static/")


def say(text: str) -> None:
    print(f"[bundle] {text}", flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def platform_flags(python_version: str) -> list[str]:
    """pip download flags for CPython `python_version` on glibc Linux x86_64."""
    abi = "cp" + python_version.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
             "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for n in range(39, 4, -1):
        flags += ["--platform", f"manylinux_2_{n}_x86_64"]
    return flags + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64", "--platform", "any"]


def host_inventory(path: Path) -> dict[str, str | None]:
    """Distribution names (and versions, where given) in a `pip list --format=freeze` file or one name per line."""
    held: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        for word in line.split("#")[0].split():
            name, _, version = word.partition("==")
            held[normalize(name.split("@")[0])] = version or None
    return held


def host_conflicts(wheels: Path, held: dict[str, str | None], python_version: str) -> set[str]:
    """Packages the host holds at a version that a wheel in `wheels` does not accept (vLLM pins numba exactly, for
    one): their locked version goes into the bundle too, for `make setup` to install into .venv over the host's."""
    from pip._vendor.packaging.requirements import Requirement  # pip's own copy: the online side has pip
    from pip._vendor.packaging.version import InvalidVersion, Version

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    found = set()
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        name = normalize(next(line[5:].strip() for line in meta.splitlines() if line.startswith("Name:")))
        for line in meta.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.partition(":")[2].strip())
            if (name, normalize(req.name)) in TOLERATED:
                continue
            version = held.get(normalize(req.name))
            if version is None or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            try:
                if not req.specifier.contains(Version(version), prereleases=True):
                    found.add(normalize(req.name))
            except InvalidVersion:
                continue
    return found


def download_gpu(wheels: Path, python_version: str, wanted: list) -> None:
    """The lock's wheels for `wanted`, hash-checked; sdist-only ones built into wheels here."""
    work = wheels.parent / "work"
    work.mkdir()
    binary = work / "binary.txt"
    binary.write_text("".join(e.text for e in wanted if normalize(e.name) not in SDIST_ONLY))
    pip("download", "-q", "--no-deps", "--require-hashes", *platform_flags(python_version), "-d", str(wheels),
        "-r", str(binary))
    sdists = [e for e in wanted if normalize(e.name) in SDIST_ONLY]
    if sdists:
        source = work / "sdist.txt"
        source.write_text("".join(e.text for e in sdists))
        pip("download", "-q", "--no-deps", "--require-hashes", "--no-binary=:all:", "-d", str(work / "sdists"),
            "-r", str(source))
        for sdist in sorted((work / "sdists").iterdir()):
            pip("wheel", "-q", "--no-deps", "-w", str(wheels), str(sdist))
    shutil.rmtree(work)


def download_cpu(wheels: Path) -> None:
    """requirements/cpu.txt's closure and requirements/no-deps.txt, as this machine's pip resolves them."""
    pip("wheel", "-q", "-w", str(wheels), "-r", str(REQUIREMENTS / "cpu.txt"), "setuptools>=68")
    pip("wheel", "-q", "--no-deps", "-w", str(wheels), "-r", str(REQUIREMENTS / "no-deps.txt"))


def record_row(name: str, data: bytes) -> list[str]:
    digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def rewrite_wheel(wheel: Path, drop: tuple[str, ...] = (), cut_arch: int | None = None) -> tuple[int, int]:
    """Rewrite `wheel` stored (uncompressed, so the bundle's xz sees the bytes), without `drop`, its shared
    libraries cut to `cut_arch`, its RECORD rewritten to match; (bytes before, after) of the files."""
    before = after = 0
    out = wheel.with_suffix(".new")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in src.infolist():
            before += info.file_size
            if info.filename == record_name or info.filename.startswith(drop) or info.filename in drop:
                continue
            data = src.read(info)
            if cut_arch is not None and ".so" in info.filename:
                with tempfile.NamedTemporaryFile(suffix=".so") as tmp:
                    Path(tmp.name).write_bytes(data)
                    fatbin.cut(Path(tmp.name), cut_arch)
                    data = Path(tmp.name).read_bytes()
            after += len(data)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
            records.append(record_row(info.filename, data))
        # RECORD is CSV: vLLM's tuning files have commas in their names
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*records, [record_name, "", ""]])
        dst.writestr(record_name, text.getvalue())
    out.replace(wheel)
    return before, after


def pack(bundle: Path, out: Path, part_mib: int) -> list[Path]:
    """bundle/ as one xz tar cut into parts of at most part_mib MiB under out/, with its sha256."""
    tar_path = out / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(bundle, arcname="bundle")
    if shutil.which("xz"):
        subprocess.run(["xz", "-9", "-T0", "-f", str(tar_path)], check=True)
    else:
        import lzma

        with open(tar_path, "rb") as src, lzma.open(str(tar_path) + ".xz", "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tar_path.unlink()
    xz = out / "bundle.tar.xz"
    (out / "bundle.tar.xz.sha256").write_text(f"{sha256(xz)}  bundle.tar.xz\n")
    parts, size = [], part_mib << 20
    with open(xz, "rb") as f:
        while chunk := f.read(size):
            parts.append(out / f"bundle.tar.xz.part{len(parts) + 1:02d}")
            parts[-1].write_bytes(chunk)
    xz.unlink()
    return parts


def write(stack: str, out: Path, python_version: str | None = None, host_packages: Path | None = None,
          cut_arch: int | None = None, part_mib: int = 60) -> None:
    """Write the bundle of `stack` for CPython `python_version` to `out` (a new directory), atomically."""
    this_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    python_version = python_version or this_python
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"[bundle] {out} exists and is not empty: name a new directory (BUNDLE_OUT=...)")
    if stack == CPU and (python_version != this_python or platform.machine() != "x86_64"):
        raise SystemExit(f"[bundle] the CPU stack is bundled for this machine's Python ({this_python}); run the "
                         "command on a machine like the offline host, or use the GPU stack's bundle (DEVICE=gpu)")
    if stack == GPU and python_version not in GPU_PYTHONS:
        raise SystemExit(f"[bundle] BUNDLE_PYTHON={python_version}: the GPU stack is locked for CPython "
                         f"{', '.join(GPU_PYTHONS)} (requirements/gpu-cp3XX.txt)")
    if cut_arch is not None and stack != GPU:
        raise SystemExit("[bundle] BUNDLE_CUT_ARCH cuts vLLM's CUDA kernels: it applies to the GPU stack (DEVICE=gpu)")
    if out.exists():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(stack, work, out, python_version, host_packages, cut_arch, part_mib)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"[bundle] failed: `{' '.join(e.cmd[2:5])} ...` exited {e.returncode} (its output is above); "
                         f"nothing was written to {out}") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _write(stack, work, out, python_version, host_packages, cut_arch, part_mib) -> None:
    bundle = work / "bundle"
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True)
    held = {n: v for n, v in host_inventory(host_packages).items() if n not in ALWAYS} if host_packages else {}
    left_out = sorted(CUT_LEAVES_OUT) if cut_arch is not None else []
    if stack == GPU:
        lock = read_lock(gpu_lock(python_version))
        wanted = [e for n, e in sorted(lock.items()) if n not in held and n not in left_out]
        say(f"GPU stack for CPython {python_version}: {len(wanted)} of the {len(lock)} locked packages "
            f"({len(lock) - len(wanted)} left out: held by the host or by the cut), hash-checked")
        download_gpu(wheels, python_version, wanted)
        carried = {normalize(e.name) for e in wanted}
        while extra := sorted(host_conflicts(wheels, held, python_version) - carried - set(GPU_SUPPORTED)):
            say(f"the host's versions of {', '.join(f'{n} {held[n]}' for n in extra)} are not what the stack's "
                "packages accept: their locked versions go in too")
            download_gpu(wheels, python_version, [lock[n] for n in extra if n in lock])
            carried |= set(extra)
    else:
        say(f"CPU stack for CPython {python_version}: requirements/cpu.txt and no-deps.txt")
        download_cpu(wheels)
    cut = None
    if cut_arch is not None:
        vllm = next(wheels.glob("vllm-*.whl"))
        before, after = rewrite_wheel(vllm, CUT_VLLM_PATHS, cut_arch)
        cut = {"arch": cut_arch, "vllm_bytes_before": before, "vllm_bytes_after": after}
        say(f"vLLM cut to sm_{cut_arch}: {before / 1e6:.0f} MB of files to {after / 1e6:.0f} MB")
        for wheel in sorted(wheels.glob("*.whl")):
            if wheel != vllm:
                rewrite_wheel(wheel)
    files = sorted(wheels.iterdir())
    manifest = {
        "stack": stack, "python": python_version, "platform": "linux_x86_64",
        "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "lock": str(gpu_lock(python_version).relative_to(ROOT)) if stack == GPU else "requirements/cpu.txt",
        "host_held": sorted(held), "left_out": left_out, "cut": cut,
        "wheels": {f.name: sha256(f) for f in files},
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (bundle / "SHA256SUMS").write_text("".join(f"{h}  wheels/{n}\n" for n, h in manifest["wheels"].items()))
    say(f"{len(files)} wheels, {sum(f.stat().st_size for f in files) / 1e6:.0f} MB")
    if cut_arch is None:
        bundle.rename(out)
    else:
        say(f"compressing (xz -9) into parts of at most {part_mib} MiB")
        parts = pack(bundle, work, part_mib)
        shutil.rmtree(bundle)
        work.rename(out)
        say(f"{len(parts)} part(s): " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in
                                                   sorted(out.glob("bundle.tar.xz.part*"))))
    shutil.rmtree(work, ignore_errors=True)
    say(f"written: {out}; on the host: make setup BUNDLE={out} (with PYTHON=<its python> to install on top of it)")
