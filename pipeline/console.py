"""Where a stage's output goes: its own story on the console, everything else in its log file.

While a stage runs (`stage_output`), file descriptors 1 and 2 point at logs/<stage>.log: vLLM's
INFO and WARNING lines, the trainer's per-epoch log, library warnings, the output of every child
process (engine cores, torchrun ranks) go there. The pipeline's own lines (`say`), its progress
bars (pipeline/progress.py draws on `stream()`) and the "pipeline" loggers go to the console the
stage was started with (the terminal, or the log of `make repro`), and into the file too, so the
file alone tells the whole run in order. A failure names the file and shows its last lines.

logs/ is not a DVC output or dependency (and git ignores it): a run that writes it leaves
`dvc status` and the run-cache as they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

LOG_DIR = Path("logs")
# a Python traceback's header, frames, source lines and carets (also behind vLLM's "(EngineCore pid=N) "):
# in the file, not in a failure's tail
_TRACEBACK_FRAME = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:Traceback \(most recent call last\)|\s+File \"|\s{4}|\s*[~^]+\s*$)")
TAIL_LINES = 15
_console: TextIO | None = None  # the stage's stderr (bars, errors), set while its output is redirected
_console_out: TextIO | None = None  # the stage's stdout (its story), likewise
_log_file: TextIO | None = None
_log_path: Path | None = None
_said: set[str] = set()  # the pipeline's own lines: a failure's tail shows the others


def stream() -> TextIO:
    """The console's error stream (progress bars, errors): the stderr the stage was started with."""
    return _console if _console is not None else sys.stderr


def say(msg: str, err: bool = False) -> None:
    """One line of the pipeline's own story: on the stdout (err: the stderr) the stage was started with, and in its log file."""
    out = stream() if err else (_console_out if _console_out is not None else sys.stdout)
    print(msg, file=out, flush=True)
    if _log_file is not None:
        print(msg, file=_log_file, flush=True)
        _said.update(msg.splitlines())


class _ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            say(self.format(record))


def log_path(stage: str) -> Path:
    return LOG_DIR / f"{stage}.log"


def current_log() -> Path | None:
    """The file the running stage's output goes to (None outside `stage_output`)."""
    return _log_path


def tail(path: Path, n: int = TAIL_LINES, skip: set[str] = frozenset()) -> list[str]:
    """The last n non-blank lines of `path` not in `skip` and not a traceback's frames (of a progress bar's
    carriage returns, its last state): the log lines and the exception's own message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
    return [line for line in lines if line.strip() and line not in skip and not _TRACEBACK_FRAME.match(line)][-n:]


def failure_note(stage: str, path: Path) -> str:
    """The log file's name and its last lines that are not the pipeline's own (those are on the console)."""
    last = tail(path, skip=_said)
    body = "\n".join(f"  | {line}" for line in last)
    return f"[{stage}] the engine's and libraries' output: {path}" + (f"; its last lines:\n{body}" if body else "")


@contextlib.contextmanager
def stage_output(stage: str) -> Iterator[Path]:
    """Send fds 1 and 2 (this process's and its children's output) to logs/<stage>.log for the
    block; `say`, the progress bars and the "pipeline" loggers keep the console. An exception
    leaving the block: the console gets the error, then the file's name and last lines (not the
    pipeline's own); an unexpected one's traceback goes to the file; the process exits with status 1."""
    global _console, _console_out, _log_file, _log_path
    path = log_path(stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    try:  # held while the stage runs: a second run of it (refused by its output lock) must not clobber this one's log
        fcntl.flock(log_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        log_file.truncate(0)
    except BlockingIOError:
        log_file.close()
        path = LOG_DIR / f"{stage}.{os.getpid()}.log"
        log_file = open(path, "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    console_out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    _console, _console_out, _log_file, _log_path = console, console_out, log_file, path
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    pipeline_logger = logging.getLogger("pipeline")
    saved_level, saved_propagate = pipeline_logger.level, pipeline_logger.propagate
    pipeline_logger.addHandler(handler)
    pipeline_logger.setLevel(logging.INFO)
    pipeline_logger.propagate = False  # the handler writes both the console and the file
    try:
        yield path
    except Exception as e:
        expected = _is_pipeline_error(e)
        sys.stdout.flush()
        sys.stderr.flush()
        error = f"[{stage}] {'error' if expected else f'failed: {type(e).__name__}'}: {e}"
        print(error, file=log_file, flush=True)
        _said.update(error.splitlines())
        print(error, file=console, flush=True)
        print(failure_note(stage, path), file=console, flush=True)
        if not expected:  # after the tail shown: the tail is what led to it
            traceback.print_exc(file=log_file)
            print(f"[{stage}] the traceback is at the end of {path}", file=console, flush=True)
        raise SystemExit(1) from None
    finally:
        pipeline_logger.removeHandler(handler)
        pipeline_logger.setLevel(saved_level)
        pipeline_logger.propagate = saved_propagate
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        _console, _console_out, _log_file, _log_path = None, None, None, None
        _said.clear()
        console.close()
        console_out.close()
        log_file.close()


def _is_pipeline_error(e: BaseException) -> bool:
    from pipeline.errors import PipelineError

    return isinstance(e, PipelineError)
