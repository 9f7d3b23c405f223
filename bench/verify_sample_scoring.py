"""CPU cost of verify's per-sample scoring (`Coherence.score_samples`: a shard's samples in one batch), this tree
against an older commit's pipeline/verify_samples.py, on random layer-coherent data of a given shape: predictors fitted
by each, then the same samples scored by both (the scores are compared, not judged; compute in fp32, and in bf16 as on
a GPU with --bf16).

    python bench/verify_sample_scoring.py --rev 43cf16e --hidden 1024 --layers 4 --tokens 640 --samples 16
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
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="score with bf16 predictors, as on a GPU")
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
    mix = [torch.randn(H, H) / H**0.5 for _ in range(L)]

    def sample(tokens: int) -> tuple[np.ndarray, torch.Tensor]:
        ids = torch.randint(0, V, (tokens,))
        x, layers = embedding[ids], []
        for j in range(L):  # each layer a noisy function of the one before: the coherence the predictors fit
            x = x + 0.5 * torch.tanh(x @ mix[j]) + 0.05 * torch.randn(tokens, H)
            layers.append(x)
        return torch.stack(layers, 1).numpy(), ids

    samples = [sample(a.tokens) for _ in range(a.samples)]
    items = [(i, h, "F32", ids) for i, (h, ids) in enumerate(samples)]
    results = {}
    for label, module in modules.items():
        coherence = module.Coherence(list(range(L)), embedding, 4, 0)
        coherence.fit((coherence.fold(i), i, coherence.inputs(h[1:], "F32", ids[1:])[1]) for i, (h, ids) in enumerate(samples))
        if a.bf16:  # the GPU's compute dtype, on the CPU
            for fold in range(2):
                w = coherence.weights[fold]
                rows = w[: L * H].reshape(L, H, -1)
                coherence._compute_cache[fold] = (w, w.to(torch.bfloat16), (rows[:-1] - rows[1:]).to(torch.bfloat16))
                for half in range(2):
                    vectors, scales = coherence.whiteners[(fold, half)]
                    coherence._compute_cache[(fold, half)] = (vectors, vectors.to(torch.bfloat16), scales)
        coherence.score_samples(items[:2])  # first use
        runs = []
        for _ in range(a.repeat):
            wall = time.perf_counter()
            results[label] = coherence.score_samples(items)
            runs.append(time.perf_counter() - wall)
        print(f"{label}: {min(runs):.3f} s per shard batch ({len(items)} samples x {a.tokens} tokens; best of {a.repeat})")
    old, new = results[a.rev], results["tree"]
    same = all(torch.equal(o.shares, n.shares) and torch.equal(o.exchange, n.exchange) for o, n in zip(old, new, strict=True))
    diff = max(float((o.shares - n.shares).abs().max() / o.shares.abs().max()) for o, n in zip(old, new, strict=True))
    print(f"scores bit-identical: {same}; largest relative difference {diff:.2e}")


if __name__ == "__main__":
    main()
