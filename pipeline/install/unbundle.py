"""`make setup BUNDLE=DIR`: open what `make bundle` wrote (a bundle directory, or its xz parts), check that it is for
this stack and this Python and that every wheel matches its checksum, before anything is installed from it."""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.install.bundle import sha256


@dataclass(frozen=True)
class Bundle:
    path: Path  # what BUNDLE named
    root: Path  # the bundle directory (the unpacked one, for parts)
    manifest: dict
    manifest_bytes: bytes

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    def has(self, name: str, version: str) -> bool:
        stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
        return any(w.lower().startswith(stem) for w in self.manifest["wheels"])


def _refuse(text: str) -> None:
    raise SystemExit(f"[setup] refused: BUNDLE: {text}")


def _unpack(path: Path, parts: list[Path], into: Path) -> Path:
    sums = path / "bundle.tar.xz.sha256"
    if not sums.is_file():
        _refuse(f"{sums} is missing: copy every file `make bundle` wrote (the parts and their .sha256)")
    xz = into / "bundle.tar.xz"
    print(f"[setup] bundle: joining {len(parts)} part(s) of {path}", flush=True)
    with open(xz, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if sha256(xz) != sums.read_text().split()[0]:
        _refuse(f"the parts in {path} do not add up to the bundle {sums.name} names (a part missing, truncated or "
                "from another bundle): copy them again")
    with tarfile.open(xz, "r:xz") as tar:
        tar.extractall(into, filter="data")
    xz.unlink()
    return into / "bundle"


@contextmanager
def open_bundle(path: Path | None, stack: str, python_version: str, on_top: bool) -> Iterator[Bundle | None]:
    if path is None:
        yield None
        return
    if not path.is_dir():
        _refuse(f"{path} is not a directory; name the directory `make bundle` wrote (BUNDLE_OUT)")
    scratch = None
    try:
        if (path / "manifest.json").is_file():
            root = path
        elif parts := sorted(path.glob("bundle.tar.xz.part*")):
            scratch = Path(tempfile.mkdtemp(prefix="eagle3-bundle-"))
            root = _unpack(path, parts, scratch)
        else:
            _refuse(f"{path} holds neither manifest.json nor bundle.tar.xz.part* files; name what `make bundle` wrote")
        manifest_bytes = (root / "manifest.json").read_bytes()
        manifest = json.loads(manifest_bytes)
        if manifest["stack"] != stack:
            _refuse(f"{path} holds the {manifest['stack']} stack and the {stack} stack is asked for: "
                    f"DEVICE={manifest['stack']}, or a bundle of the {stack} stack")
        if manifest["python"] != python_version:
            _refuse(f"{path} is for CPython {manifest['python']} and this Python is {python_version}: write one with "
                    f"BUNDLE_PYTHON={python_version}, or name a {manifest['python']} with PYTHON=")
        if (manifest["host_held"] or manifest["cut"]) and not on_top:
            _refuse(f"{path} leaves out what a host's Python holds (written with BUNDLE_HOST_PACKAGES or "
                    "BUNDLE_CUT_ARCH): install it on top of that Python, PYTHON=<its python>")
        bad = [name for name, digest in manifest["wheels"].items()
               if not (root / "wheels" / name).is_file() or sha256(root / "wheels" / name) != digest]
        if bad:
            _refuse(f"{len(bad)} wheel(s) in {path} are missing or do not match manifest.json's sha256: "
                    f"{', '.join(bad[:5])}; copy the bundle again")
        print(f"[setup] bundle {path}: the {stack} stack for CPython {python_version}, "
              f"{len(manifest['wheels'])} wheels, checksums ok", flush=True)
        yield Bundle(path, root, manifest, manifest_bytes)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
