"""What keeps a stage's outputs safe from a kill and from a second run: the kept work, the lock.

Resumable outputs (extract's shards, regenerate's rewritten data, train's epoch checkpoints): a DVC
stage with a `persist: true` output is never saved to the run-cache, and the run-cache is what
restores a result already computed (a param changed and changed back, `dvc exp run` of an
experiment already run, a teammate's `dvc repro --pull`). So no output is persisted, and DVC deletes
each before it runs the stage (or restores it from the run-cache). What the stage has finished must
outlive that deletion, yet nothing DVC does not know may stand at the output path when DVC checks a
cached result out there (it would refuse to remove it "without a confirmation", and the user would
be stuck). So the output is a plain directory while the stage writes it, and the launcher keeps a
hard link to each of its files (in its subfolders too) in `artifacts/.partial/<name>`
(`OutputMirror`, at most a quarter second behind). After a kill, even kill -9, `dvc repro` deletes the
output and either runs the stage (the links kept the work: the launcher puts it back, and the stage
keeps what it finished under the same run key: shards, complete epochs) or checks the cached result
out in its place; typed again, the command always recovers. A run that succeeds drops its links.

What a killed run leaves beside a result DVC then restored (its links, vLLM's scratch folder, the
lock file) is tidied by the next run of any stage, the check stage included (`tidy_left_behind`): a
run-cache restore runs no command of ours, so nothing can tidy at that moment. Links that still
share their files with the output are a killed run's work, which `dvc repro` may yet resume: they stay.

Concurrent runs: before touching a resumable output the launcher takes an exclusive flock on
`<output>.lock` beside it (`output_locks`); a second run of the stage on the same output is refused
with a PipelineError naming the lock and its holder (docs/RELIABILITY.md). The holder removes the
file when it ends; one a kill left behind is never stale (the kernel dropped the flock) and is
removed by the next tidy.
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
from pipeline.atomic import TMP_MARK, is_temp
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
    when the holder exits, even on kill -9: a lock file left on disk is never stale. The holder
    deletes the file when it is done; a run that opened the file just before that deletion finds
    the name gone or another file's and opens it again, so two runs never hold two files of one name.
    """
    held: list[tuple[Path, int]] = []
    try:
        for out in outs:
            lock = lock_path(out)
            lock.parent.mkdir(parents=True, exist_ok=True)
            while True:
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
                try:
                    same = os.stat(lock).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)  # its holder deleted it as we opened it: take the file now at that name
            held.append((lock, fd))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        for lock, fd in held:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            os.close(fd)  # releases the flock


def partial_path(out: Path) -> Path:
    return PARTIAL_DIR / out.relative_to(layout.ARTIFACTS)


def _files(root: Path) -> dict[str, int]:
    """Relative path -> inode of the finished regular files under `root` (symlinks and writes in progress left out)."""
    found: dict[str, int] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(root / rel)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                if is_temp(e.name):
                    continue
                name = f"{rel}/{e.name}" if rel else e.name
                with contextlib.suppress(FileNotFoundError):
                    if e.is_dir(follow_symlinks=False):
                        stack.append(name)
                    elif e.is_file(follow_symlinks=False):
                        found[name] = e.inode()
    return found


def _remove_empty_dirs(root: Path) -> None:
    for d in sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # not empty
            d.rmdir()


class OutputMirror:
    """Keeps `work` a tree of hard links to the files of `out` (its subfolders too), synced every
    `interval` seconds by a daemon thread and on `stop()`.

    Files still being written (`.tmp-` names and safetensors' temporaries, see pipeline/atomic.py)
    and symlinks are left out; a file the stage replaced (a new inode) is linked again; one it
    deleted (or a folder it deleted, e.g. a checkpoint of another run key) is dropped from `work`."""

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
        current = _files(self.out)
        linked = _files(self.work)
        for name in linked.keys() - current.keys():
            (self.work / name).unlink(missing_ok=True)
        for name, ino in current.items():
            if linked.get(name) == ino:
                continue
            dst = self.work / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f"{dst.name}{TMP_MARK}link"
            tmp.unlink(missing_ok=True)
            try:
                os.link(self.out / name, tmp)
            except FileNotFoundError:  # deleted by the stage since the listing
                continue
            os.replace(tmp, dst)
        if linked.keys() - current.keys():
            _remove_empty_dirs(self.work)


def _remove_temps(root: Path) -> None:
    """An interrupted link (`<name>.tmp-link`) anywhere under `root`."""
    for p in list(root.rglob(f"*{TMP_MARK}*")):
        if is_temp(p.name) and not p.is_dir():
            p.unlink(missing_ok=True)


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
        _remove_temps(work)  # an interrupted link
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


def scratch_path(out: Path) -> Path:
    """Where the stage writing `out` keeps its scratch files, beside it (vLLM's per-request files for extract)."""
    return out.parent / f"{out.name}.scratch"


def tidy_left_behind(outs: Sequence[Path]) -> list[Path]:
    """What killed runs left beside each of `outs` and nothing will use: vLLM's scratch folder, the
    lock file, and the kept links once they no longer link the output's files (DVC restored the
    cached result over a killed run's work). Links that still share their files with the output are
    a killed run's work, which `dvc repro` may yet resume (or delete and restore over): they stay.
    An output whose stage is running (its lock is held) is left alone. Returns what it removed."""
    removed = []
    for out in outs:
        work, scratch, lock = partial_path(out), scratch_path(out), lock_path(out)
        if not (work.exists() or scratch.exists() or lock.exists()):
            continue
        had_lock = lock.exists()
        try:
            with output_locks("tidy", [out]):
                if scratch.exists():
                    shutil.rmtree(scratch, ignore_errors=True)
                    removed.append(scratch)
                if work.is_dir() and out.is_dir() and not out.is_symlink():
                    kept = set(_files(work).items())
                    if not kept & set(_files(out).items()):
                        shutil.rmtree(work)
                        removed.append(work)
        except PipelineError:  # its stage is running: leave its files alone
            continue
        if had_lock and not lock.exists():
            removed.append(lock)
    _drop_empty_partial_dir()
    return removed
