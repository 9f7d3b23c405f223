"""Progress that fits where it goes: a live bar on a terminal, a plain line every few percent or minute in a log.

The pipeline's bars are `progress(...)` (tqdm's arguments), drawn on the console (pipeline/console.py).
On a terminal it is tqdm as is. When the bar's stream is not a terminal (a `make repro` log, CI,
`dvc repro` piped), a redrawn bar is thousands of carriage-return updates in one line; there it
writes whole lines instead: one when another `LOG_PERCENT` % is done, at least one every
`LOG_SECONDS` while work goes on, and the last.
`TQDM_DISABLE=1` turns every bar off, as for tqdm itself.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from pipeline import console

LOG_PERCENT = 10
LOG_SECONDS = 60.0


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogLines(tqdm):
    """tqdm drawn as whole lines, each when another LOG_PERCENT % is done or LOG_SECONDS passed, and at the end."""

    def __init__(self, *args, **kwargs) -> None:
        self._line_t = time.monotonic()
        self._line_step = -1
        kwargs["mininterval"] = max(float(kwargs.get("mininterval") or 0), 1.0)  # how often `display` is asked
        kwargs.setdefault("ascii", True)
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None) -> bool:
        closing = self.disable  # close() sets it before its last display, then ends the line itself
        step = int(100 * self.n / self.total) // LOG_PERCENT if self.total else self._line_step
        now = time.monotonic()
        if not (closing or step > self._line_step or now - self._line_t >= LOG_SECONDS):
            return True
        self._line_step, self._line_t = step, now
        self.fp.write(str(self) + ("" if closing else "\n"))
        self.fp.flush()
        return True


def progress(iterable=None, **kwargs) -> tqdm:
    """A progress bar (tqdm's arguments): live on a terminal, a line per LOG_PERCENT % or LOG_SECONDS elsewhere."""
    kwargs.setdefault("file", console.stream())  # the console, also while a stage's output goes to its log
    kwargs.setdefault("dynamic_ncols", True)  # as wide as the terminal is now
    if is_terminal(kwargs["file"]):
        return tqdm(iterable, **kwargs)
    return LogLines(iterable, **kwargs)

