"""Progress output: tqdm's live bar on a terminal; in a log, whole lines every LOG_PERCENT % and at the end."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from tqdm import tqdm

from pipeline import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdms_live_bar() -> None:
    bar = progress.progress(total=3, file=Terminal(), desc="x")
    assert type(bar) is tqdm
    bar.close()


def test_a_log_gets_a_line_per_step_of_percent_and_a_last_one() -> None:
    log = io.StringIO()
    bar = progress.progress(total=1000, file=log, desc="extract", unit="sample")
    assert isinstance(bar, progress.LogLines)
    for _ in range(1000):
        bar.update(1)
        bar.refresh()  # as tqdm asks for a redraw once its interval has passed; most are not drawn
    bar.close()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    # the start, one per 10 % (the 100 % one included), and the closing line
    assert len(lines) == 1 + 100 // progress.LOG_PERCENT + 1, lines
    assert lines[0].startswith("extract:   0%") and "1000/1000" in lines[-1] and "1000/1000" in lines[-2]


def test_a_log_gets_a_line_after_log_seconds_without_a_step(monkeypatch) -> None:
    log = io.StringIO()
    bar = progress.progress(total=1000, file=log, desc="slow")
    bar.update(1)
    bar.refresh()
    assert len(log.getvalue().splitlines()) == 1  # only the start: no step done, no time passed
    later = progress.time.monotonic() + progress.LOG_SECONDS + 1
    monkeypatch.setattr(progress.time, "monotonic", lambda: later)
    bar.refresh()
    assert len(log.getvalue().splitlines()) == 2 and "1/1000" in log.getvalue().splitlines()[-1]
    bar.close()


def test_tqdm_disable_turns_the_log_lines_off_too() -> None:
    # tqdm reads TQDM_* variables when it is imported: a child process with the variable set
    code = ("import io; from pipeline.progress import progress; log = io.StringIO(); bar = progress(range(5), file=log); "
            "assert list(bar) == list(range(5)); bar.close(); print(repr(log.getvalue()))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "''", out
