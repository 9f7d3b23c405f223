"""CPU cost of verify's per-sample scoring (`Coherence.score`) per sample, this tree against an older commit's
pipeline/verify_samples.py, on random data of a given shape (scores are compared, not judged).

    python bench/verify_sample_scoring.py --rev 6bc171d --hidden 1024 --layers 4 --tokens 2048 --samples 4
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=4)
    a = ap.parse_args()
    old_source = subprocess.run(["git", "show", f"{a.rev}:pipeline/verify_samples.py"], capture_output=True, text=True,
                                check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old.py").write_text(old_source)
        modules = {a.rev: load(Path(tmp) / "old.py", "old_verify_samples"),
                   "tree": load(Path("pipeline/verify_samples.py"), "tree_verify_samples")}
    H, L, V = a.hidden, a.layers, 1000
    torch.manual_seed(0)
    embedding = torch.randn(V, H)
    weights = torch.randn((L + 1) * H + 1, (L + 1) * H) / ((L + 1) * H) ** 0.5
    samples = [(np.random.default_rng(i).standard_normal((a.tokens, L, H)).astype(np.float32), torch.randint(0, V, (a.tokens,)))
               for i in range(a.samples)]
    results = {}
    for _ in range(2):
        for label, module in modules.items():
            coherence = module.Coherence(list(range(L)), embedding, 4, 0)
            coherence.weights = [weights, weights]
            cpu = time.process_time()
            results[label] = [coherence.score(i, h, "F32", ids) for i, (h, ids) in enumerate(samples)]
            print(f"{label}: {(time.process_time() - cpu) / a.samples:.3f} CPU s per sample")
    old, new = results[a.rev], results["tree"]
    diff = max(float((o.shares - n.shares).abs().max() / o.shares.abs().max()) for o, n in zip(old, new, strict=True))
    ex = max(float((o.exchange.double() - n.exchange.double()).abs().max()) for o, n in zip(old, new, strict=True))
    print(f"largest relative difference of the scores {diff:.2e}, of the exchange gains (log) {ex:.2e}")


if __name__ == "__main__":
    main()
