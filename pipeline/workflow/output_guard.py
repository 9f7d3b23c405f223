"""What keeps a stage's outputs safe from a kill and from a second run: the kept work, the lock.

Resumable outputs: a DVC stage with a `persist: true` output is never saved to the run-cache, and
the run-cache is what lets a teammate's `dvc repro --pull` restore an extraction already run. So
extract's output is not persisted, and DVC deletes it before it runs the stage (or restores it from
the run-cache). What the stage has finished must outlive that deletion, yet nothing DVC does not
know may stand at the output path when DVC checks a cached result out there (it would refuse to
remove it "without a confirmation", and the user would be stuck). So the output is a plain
directory while the stage writes it, and the launcher keeps a hard link to each of its files in
`artifacts/.partial/<name>` (`OutputMirror`, at most a quarter second behind). After a kill, even kill -9,
`dvc repro` deletes the output and either runs the stage (the links kept the work: the launcher
puts it back, and the stage keeps its complete shards of the same run key) or checks the cached
result out in its place; typed again, the command always recovers. Links that a complete output makes redundant are
dropped by the next stage run through the launcher (`prune_partials`).

Concurrent runs: before touching a resumable output the launcher takes an exclusive flock on
`<output>.lock` beside it (`output_locks`); a second run of the stage on the same output is refused
with a PipelineError naming the lock and its holder (docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline import layout
from pipeline.atomic import TMP_MARK, is_temp, remove_stale_temps
from pipeline.errors import PipelineError

PARTIAL_DIR = layout.ARTIFACTS / ".partial"


def lock_path(out: Path) -> Path:
    """The lock file of output `out`: beside it, outside the DVC output (artifacts/hidden_states.lock)."""
    return out.parent / f"{out.name}.lock"


@contextlib.contextmanager
def output_locks(stage: str, outs: Sequence[Path]) -> Iterator[None]:
    """Hold an exclusive flock on each output's lock file for the stage's run, or refuse at once.

    Taken before anything in the output is touched, so a second concurrent run of the stage on
    the same output fails with a clear message instead of interleaving. The kernel drops the lock
    when the holder exits, even on kill -9: a lock file left on disk is never stale.
    """
    fds: list[int] = []
    try:
        for out in outs:
            lock = lock_path(out)
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise PipelineError(
                    f"another {stage} run is writing {out}: it holds the lock {lock} (holder: {holder}). "
                    f"Wait for it to finish (or stop that process) and re-run; two runs on one output would "
                    f"interleave. The lock frees itself when the holder exits, even if it is killed."
                ) from None
            fds.append(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # releases the flock


def partial_path(out: Path) -> Path:
    return PARTIAL_DIR / out.relative_to(layout.ARTIFACTS)


class OutputMirror:
    """Keeps `work` a directory of hard links to the files of `out` (flat: the resumable outputs
    hold files only), synced every `interval` seconds by a daemon thread and on `stop()`.

    Files still being written (`.tmp-` names, see pipeline/atomic.py) are left out; a file the
    stage replaced (a new inode) is linked again; one it deleted is dropped from `work`."""

    def __init__(self, out: Path, work: Path, interval: float = 0.25) -> None:
        self.out, self.work, self.interval = out, work, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"mirror-{out.name}", daemon=True)

    def start(self) -> OutputMirror:
        self.sync()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sync()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):  # e.g. a full disk: the stage reports it; the next sync retries
                self.sync()

    def sync(self) -> None:
        if not self.out.is_dir():
            return
        self.work.mkdir(parents=True, exist_ok=True)
        current = {}
        with os.scandir(self.out) as it:
            for e in it:
                if not is_temp(e.name) and e.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        current[e.name] = e.inode()
        linked = {e.name: e.inode() for e in os.scandir(self.work) if not is_temp(e.name)}
        for name in linked.keys() - current.keys():
            (self.work / name).unlink(missing_ok=True)
        for name, ino in current.items():
            if linked.get(name) == ino:
                continue
            tmp = self.work / f"{name}{TMP_MARK}link"
            tmp.unlink(missing_ok=True)
            try:
                os.link(self.out / name, tmp)
            except FileNotFoundError:  # deleted by the stage since the listing
                continue
            os.replace(tmp, self.work / name)


def _take_back(out: Path, work: Path) -> None:
    """Put the kept work back at `out` where DVC (or the user) deleted it; a complete output that
    is there stays the starting point and makes the links redundant."""
    if out.is_symlink():  # left by a killed run of the launcher before OutputMirror
        if os.path.normpath(out.parent / os.readlink(out)) != os.path.normpath(work):
            raise PipelineError(f"{out} is a symlink to {os.readlink(out)}; DVC outputs must be real "
                                f"directories: remove the link (or move what it points to) and re-run")
        out.unlink()
    if out.exists():
        if work.exists():
            shutil.rmtree(work)
    elif work.is_dir():
        remove_stale_temps(work)  # an interrupted link
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
    out.mkdir(parents=True, exist_ok=True)


def _drop_empty_partial_dir() -> None:
    if PARTIAL_DIR.is_dir() and not any(PARTIAL_DIR.rglob("*")):
        shutil.rmtree(PARTIAL_DIR)


@contextlib.contextmanager
def resumable_outputs(outs: Sequence[Path]) -> Iterator[None]:
    """Run the body with each of `outs` a plain directory (holding the work kept from an earlier
    run, if any) mirrored by hard links into `artifacts/.partial`; on success the links go."""
    mirrors = []
    for out in outs:
        _take_back(out, partial_path(out))
        mirrors.append(OutputMirror(out, partial_path(out)).start())
    try:
        yield
    except BaseException:
        for m in mirrors:
            with contextlib.suppress(OSError):  # the stage's own error is the one to report
                m.stop()
                if not any(m.out.iterdir()):  # a run that failed before writing anything leaves nothing
                    m.out.rmdir()
                    shutil.rmtree(m.work)
        _drop_empty_partial_dir()
        raise
    for m in mirrors:
        m.stop()
        shutil.rmtree(m.work)
    _drop_empty_partial_dir()


def prune_partials(outs: Sequence[Path]) -> None:
    """Drop the kept links of each of `outs` that no longer link its files: DVC checked the cached
    result out over a killed run's work, so they only hold the disk. Links that still share their
    files with the output are a killed run's work, which `dvc repro` may yet delete: they stay."""
    for out in outs:
        work = partial_path(out)
        if not work.is_dir() or out.is_symlink() or not out.is_dir():
            continue
        kept = {(e.name, e.inode()) for e in os.scandir(work)}
        if kept & {(e.name, e.inode()) for e in os.scandir(out)}:
            continue
        with contextlib.suppress(PipelineError):  # its stage is running: leave its work alone
            with output_locks("prune", [out]):
                shutil.rmtree(work)
    _drop_empty_partial_dir()
