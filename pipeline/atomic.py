"""Write-then-rename helpers: a final path holds a complete file or nothing.

A crash (even kill -9) mid-write leaves only a `.tmp-*` sibling, which the next run removes (and
safetensors' own: 0.8's save_file writes a `.tmpXXXXXX` beside the path it is given, then renames it).
Temp files and directories get the modes a plain open()/mkdir() would (0666/0777 less the umask),
not tempfile's owner-only 0600/0700: outputs are read by the group (teammates, a container's uid).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"
# Rust's tempfile crate's default name, which safetensors 0.8's save_file writes into before its rename
SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_temp(name: str) -> bool:
    """Whether `name` is a write in progress (ours or safetensors'), never a finished output."""
    return TMP_MARK in name or SAFETENSORS_TEMP.fullmatch(name) is not None


def process_umask() -> int:
    """The umask, read without setting it (os.umask sets it, racing every thread that creates files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_up_to_umask(top: Path) -> None:
    """Give `top` and everything under it the read (and, for directories, search) bits the umask
    allows, never a write bit: some writers create owner-only files whatever the umask (safetensors'
    save_file, hence transformers' save_pretrained: 0600), and outputs are read by the group
    (teammates, a container's uid). Files this uid does not own are left as they are."""
    allowed = 0o555 & ~process_umask()
    paths = [str(top)] if not os.path.isdir(top) else (
        os.path.join(root, name) for root, _, files in os.walk(top) for name in [".", *files])
    for p in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            want = allowed if stat.S_ISDIR(st.st_mode) else allowed & 0o444
            if st.st_mode & want != want:
                os.chmod(p, stat.S_IMODE(st.st_mode) | want)


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
        open_up_to_umask(tmp)  # the writer may have replaced the file with an owner-only one
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
    """Yield a temp directory beside `final`; on success replace `final` with it, its files given
    the read bits the umask allows (`open_up_to_umask`)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_temp(final, lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        open_up_to_umask(tmp)  # save_pretrained (safetensors' save_file) writes owner-only files
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
            if is_temp(p.name):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                n += 1
    return n
