"""Write-then-rename helpers: a final path holds a complete file or nothing.

A crash (even kill -9) mid-write leaves only a `.tmp-*` sibling, which the next run removes.
Temp files and directories get the modes a plain open()/mkdir() would (0666/0777 less the umask),
not tempfile's owner-only 0600/0700: outputs are read by the group (teammates, a container's uid).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(final: Path, make) -> Path:
    """A new, unique `<final>.tmp-<random>` beside `final`, created by `make(path)` (which must fail
    if the path exists, as O_EXCL and mkdir do)."""
    while True:
        tmp = final.parent / f"{final.name}{TMP_MARK}{secrets.token_hex(4)}"
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path beside `final`; on success fsync it and rename it into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_temp(final, lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)))
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
    tmp = _create_temp(final, lambda p: os.mkdir(p, 0o777))
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
