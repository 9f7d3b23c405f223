"""Peak GPU memory of named parts of a process, measured from outside their code (the streamed
reference's own peak against its budget, apart from the rest of verify).

`Peaks.wrap(module, "name", label)` replaces a module-level function (looked up at call time by its
callers) with one that resets CUDA's peak counter on entry and reads it on exit: that part's peak,
and what the process already held when it began (`held_at_entry_bytes`: not the part's own). The
process's peak is the maximum over every interval between resets, so it stays exact. Counts what
PyTorch's caching allocator hands out (`max_memory_allocated`), not its reserve or other libraries'.
"""

from __future__ import annotations

import functools
import time


class Peaks:
    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.parts: dict[str, dict] = {}
        self._process = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _close_interval(self) -> int:
        """The peak since the last reset (into the process's peak), then a new interval."""
        import torch

        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
        self._process = max(self._process, peak)
        torch.cuda.reset_peak_memory_stats()
        return peak

    def wrap(self, module, name: str, label: str) -> None:
        original = getattr(module, name, None)
        if original is None:  # renamed or moved since this was written: measure the rest, say what is missing
            self.parts[label] = {"not_measured": f"{module.__name__}.{name} not found"}
            return

        @functools.wraps(original)
        def measured(*args, **kwargs):
            if not self.cuda:
                return original(*args, **kwargs)
            import torch

            self._close_interval()
            held = int(torch.cuda.memory_allocated())
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                peak = self._close_interval()
                self.parts[label] = {"peak_bytes": peak, "held_at_entry_bytes": held, "own_peak_bytes": peak - held,
                                     "held_at_exit_bytes": int(torch.cuda.memory_allocated()),
                                     "seconds": round(time.monotonic() - started, 3)}

        setattr(module, name, measured)

    def process_peak(self) -> int | None:
        """The whole process's peak so far (every interval)."""
        if not self.cuda:
            return None
        self._close_interval()
        return self._process
