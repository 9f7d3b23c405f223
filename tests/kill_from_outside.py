"""Kill a stage the way a user's crash does: the real CLI in its own process group, SIGKILL at an observed point.

The points are what anyone can see from outside the process: a line in its log, or a file appearing
in (created in, or renamed into) a directory, seen through Linux inotify, so the kill follows the
event by microseconds rather than a polling interval. Nothing in the product knows it is tested.
Waits are bounded by timeouts; nothing here sleeps for a fixed time as a correctness condition.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IN_CREATE, IN_MOVED_TO = 0x100, 0x80
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class DirWatch:
    """inotify on one directory: (event, name) for each file created in it or renamed into it."""

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self._libc.inotify_add_watch(self.fd, os.fsencode(os.path.realpath(directory)), IN_CREATE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def events(self, timeout_s: float) -> list[tuple[str, str]]:
        """The events that arrive within `timeout_s` (at least one, unless the time runs out)."""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return []
        try:
            buf = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out, i = [], 0
        while i < len(buf):
            _, mask, _, n = _EVENT.unpack_from(buf, i)
            name = buf[i + _EVENT.size : i + _EVENT.size + n].rstrip(b"\0").decode()
            out.append(("moved_to" if mask & IN_MOVED_TO else "created", name))
            i += _EVENT.size + n
        return out

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Run:
    returncode: int
    killed: bool  # SIGKILL was sent (it may still have come after the process ended by itself)
    log: str
    seen: str | None  # what the kill followed: the log line or the file event


class StageProcess:
    """`python -m pipeline --params params.yaml run <stage>` in `project`, in a new session (its own
    process group, engine subprocesses included); stdout and stderr go to one log file."""

    def __init__(self, project: Path, stage: str, env: dict | None = None) -> None:
        self.log_path = project / f".{stage}-{time.monotonic_ns()}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1", **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "--params", "params.yaml", "run", stage],
            cwd=project, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout_s: float) -> str | None:
        """The first log line containing `text`, once it is written; None if the process ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if text in line:
                    return line
            if self.proc.poll() is not None:
                return None
            time.sleep(0.02)  # a poll interval; the points waited for are seconds apart
        raise TimeoutError(f"no log line with {text!r} within {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def wait_for_dir(self, directory: Path, timeout_s: float) -> bool:
        """Whether `directory` came to exist (False: the process ended first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if directory.is_dir():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise TimeoutError(f"{directory} did not appear within {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self, killed: bool, seen: str | None, timeout_s: float = 120) -> Run:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.kill()
                self.proc.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):  # engine subprocesses left by a kill
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._log.close()
        text = self.log()
        self.log_path.unlink(missing_ok=True)
        return Run(rc, killed, text, seen)


def run_to_end(project: Path, stage: str, timeout_s: float = 600) -> Run:
    p = StageProcess(project, stage)
    return p.finish(killed=False, seen=None, timeout_s=timeout_s)


def kill_at_line(project: Path, stage: str, text: str, timeout_s: float = 300) -> Run:
    """SIGKILL the stage's process group as soon as a log line containing `text` appears."""
    p = StageProcess(project, stage)
    line = p.wait_for_line(text, timeout_s)
    if line is not None:
        p.kill()
    return p.finish(killed=line is not None, seen=line)


def kill_at_file(project: Path, stage: str, directory: Path, ready_line: str | None, is_point: Callable[[str, str], bool],
                 timeout_s: float = 300) -> Run:
    """SIGKILL the stage's process group at the first file event in `directory` that `is_point(event,
    name)` accepts. The watch starts at the log line `ready_line`, which the stage writes after it
    made `directory` and before it writes anything the points look for; with None, as soon as
    `directory` exists (for a stage that makes it seconds before its first point: engine start-up)."""
    p = StageProcess(project, stage)
    watch = None
    try:
        if ready_line is not None and p.wait_for_line(ready_line, timeout_s) is None:
            return p.finish(killed=False, seen=None)
        if ready_line is None and not p.wait_for_dir(directory, timeout_s):
            return p.finish(killed=False, seen=None)
        watch = DirWatch(directory)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event, name in watch.events(timeout_s=0.5):
                if is_point(event, name):
                    p.kill()
                    return p.finish(killed=True, seen=f"{event} {name}")
            if p.proc.poll() is not None:  # ended before the point (drain what arrived meanwhile)
                hit = next((f"{e} {n}" for e, n in watch.events(0) if is_point(e, n)), None)
                return p.finish(killed=False, seen=hit)
        raise TimeoutError(f"no file event at the point within {timeout_s:.0f} s:\n{p.log()[-3000:]}")
    finally:
        if watch is not None:
            watch.close()
        if p.proc.poll() is None and not p._log.closed:
            p.kill()
            p.finish(killed=True, seen=None)
