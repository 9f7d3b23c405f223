"""The GPU's utilisation (nvidia-smi: the share of time a kernel ran), sampled every 100 ms by a thread."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time


class Utilisation:
    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), 0..1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if shutil.which("nvidia-smi") is None:  # CPU: no samples, the share stays None
            return
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.monotonic(), max(float(x) for x in out.split()) / 100))
            self._stop.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def mean(self, start: float | None = None, end: float | None = None) -> float | None:
        """The mean utilisation of the samples in [start, end] (all of them by default)."""
        picked = [u for t, u in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return round(sum(picked) / len(picked), 3) if picked else None
