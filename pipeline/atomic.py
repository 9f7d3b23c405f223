"""Write-then-rename helpers: a final path holds a complete file or nothing.

A crash (even kill -9) mid-write leaves only a `.tmp-*` sibling, which the next run removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path beside `final`; on success fsync it and rename it into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=final.name + TMP_MARK, dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(final: Path, text: str) -> None:
    with atomic_path(final) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp directory beside `final`; on success replace `final` with it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + TMP_MARK, dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; outputs are read by other users (container, teammates)
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temps(directory: Path) -> int:
    """Delete leftovers of killed writes in `directory`; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if TMP_MARK in p.name:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                n += 1
    return n
