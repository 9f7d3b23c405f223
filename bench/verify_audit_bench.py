"""An audited shard read in full (`pipeline.verification.audit.read_in_full`: sha256 and every sample's statistics) at the
8B workload's shape, against another revision's: a 1.07 GB shard of 16 samples of 2,048 x 4 x 4,096 bf16 written by the
project's shard writer, each reader run `--repeat` times, interleaved; digests and statistics must agree.

    python bench/verify_audit_bench.py --work /dev/shm/auditbench --rev fbdd1a4

Session 21 (docs/BENCHMARKS.md "Verify's scan, session 21"): the two reads of fbdd1a4 against the one of 4d120a0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.hidden_states.format import Sample, write_shard
from pipeline.verification import audit as verify_audit


def module_at(rev: str):
    """pipeline/verification/audit.py (before the layout pipeline/verify_audit.py) as of `rev`, imported under a name of
    its own."""
    for at in ("pipeline/verification/audit.py", "pipeline/verify_audit.py"):
        shown = subprocess.run(["git", "show", f"{rev}:{at}"], capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "verify_audit_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("verify_audit_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="a directory for the shard (removed after)")
    ap.add_argument("--rev", required=True, help="the revision to compare with")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    try:
        g = torch.Generator().manual_seed(0)
        samples = [Sample(i, torch.randint(0, 128000, (a.tokens,), generator=g), torch.ones(a.tokens, dtype=torch.long),
                          torch.randn(a.tokens, 4, a.hidden, generator=g).to(torch.bfloat16)) for i in range(a.samples)]
        write_shard(a.work, 0, samples, {})
        del samples
        path = next(a.work.glob("*.safetensors"))
        readers = {a.rev: module_at(a.rev).read_in_full, "this tree": verify_audit.read_in_full}
        found = {}
        for _ in range(a.repeat):
            for name, read in readers.items():
                t = time.perf_counter()
                found[name] = read(path, True)
                print(json.dumps({"reader": name, "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t, 3),
                                  **{k: round(v, 3) for k, v in found[name].seconds.items()}}), flush=True)
        first, second = found.values()
        same = first.digest == second.digest and first.stats.keys() == second.stats.keys() and all(
            np.array_equal(first.stats[k], second.stats[k], equal_nan=True) for k in first.stats)
        print(json.dumps({"same_digest_and_statistics": same}))
        if not same:
            sys.exit(1)
    finally:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
