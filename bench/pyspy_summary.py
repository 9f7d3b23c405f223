"""Where a profiled verify process's threads spent their samples: py-spy's raw (collapsed) stacks, as the
verifyall bench job records them (`py-spy record --idle --threads --format raw`), grouped by thread kind and by
the deepest frame of the project's own code, with the leaf frame under it.

    python bench/pyspy_summary.py verify_pyspy.txt [TOP] [RATE]

RATE: the record's samples a second (VERIFY_PYSPY_RATE; 100 by default).
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def thread_kind(head: str) -> str:
    """'thread (0x7f..): verify-scan_3' -> 'verify-scan' (digits and pool suffixes dropped)."""
    name = head.split(":", 1)[-1].strip()
    return re.sub(r"[_-]?\d+$", "", name) or name


def summarize(path: Path, top: int, rate: float = 100.0) -> str:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for raw in path.read_text().splitlines():
        stack, _, count = raw.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        kind, n = thread_kind(head), int(count)
        totals[kind] += n
        ours = [f for f in frames if "pipeline/" in f]
        where = ours[-1] if ours else (frames[0] if frames else "(no frame)")
        leaf = frames[-1] if frames else "(no frame)"
        by_kind[kind][(where, leaf if leaf != where else "")] += n
    lines = [f"{path}: {sum(totals.values())} samples ({rate:g} Hz per thread)"]
    for kind, n in totals.most_common():
        lines.append(f"\n== {kind}: {n} samples ({n / rate:.2f} thread-seconds)")
        for (where, leaf), k in by_kind[kind].most_common(top):
            lines.append(f"  {100 * k / n:5.1f}%  {where}" + (f"  <- {leaf}" if leaf else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 12,
                    float(sys.argv[3]) if len(sys.argv) > 3 else 100.0))
