"""How weak a fault confined to one sample verify's per-sample tests still catch (issue 18).

For a clean extraction project (artifacts/ of a real run), fits the tests' predictors as verify
does, scores every sample, then plants noise of relative RMS error e on two runs of 16 consecutive
positions of one captured layer of one sample (in memory) and prints the worst window's z in the
population and within-sample tests, against the clean run's maxima.

    python bench/verify_sample_sensitivity.py PROJECT_DIR [STRIDE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import load_from_disk

from pipeline import verify_sample_judge as J
from pipeline import verify_samples as V
from pipeline.params import VerifyParams
from pipeline.shards import complete_shards, load_sample, read_manifest


def main(root: Path, stride: int) -> None:
    target = json.loads((root / "artifacts/model/target.json").read_text())
    embedding = V.load_embedding(Path(target["path"]))
    files = complete_shards(root / "artifacts/hidden_states")
    prepared = load_from_disk(str(root / "artifacts/prepared/dataset"))
    layer_ids = json.loads((root / "artifacts/hidden_states/extract_meta.json").read_text())["layer_ids"]
    params = VerifyParams(sample_stride=stride)
    coherence = V.fit_coherence(files, layer_ids, embedding.shape[1], embedding, prepared, params)
    samples = {sid: load_sample(f, sid) for f in files for sid in read_manifest(f)["sample_ids"]}
    window = max(1, params.sample_window // stride)

    def scores(sid: int, h: torch.Tensor) -> torch.Tensor:
        bf16 = h.dtype == torch.bfloat16
        s = coherence.score(sid, h.view(torch.int16).numpy() if bf16 else h.numpy(), "BF16" if bf16 else "F32", samples[sid].input_ids)
        return J.window_scores(s.shares, window).float()

    every = {sid: scores(sid, s.hidden_states) for sid, s in samples.items()}
    pop_median, pop_sigma = J.robust(torch.cat(list(every.values())))
    long = [w - w.median(0).values for w in every.values() if w.shape[0] >= J.WITHIN_MIN_WINDOWS * window]
    within_median, within_sigma = J.robust(torch.cat(long))
    print(f"stride {stride}: clean max z population {((torch.cat(list(every.values())) - pop_median) / pop_sigma).max():.2f}, "
          f"within {((torch.cat(long) - within_median) / within_sigma).max():.2f}")
    victim = sorted(samples, key=lambda sid: samples[sid].input_ids.numel())[len(samples) // 2]
    print(f"sample {victim} ({samples[victim].input_ids.numel()} tokens)")
    for layer in range(len(layer_ids)):
        for eps in (0.1, 0.2, 0.3, 0.5, 1.0):
            h = samples[victim].hidden_states.clone()
            g = torch.Generator().manual_seed(0)
            for start in (40, 101):
                clean = h[start : start + 16, layer].float()
                noise = torch.randn(clean.shape, generator=g)
                h[start : start + 16, layer] = (clean + noise * (eps * clean.norm() / noise.norm())).to(h.dtype)
            w = scores(victim, h)
            z_pop = ((w - pop_median) / pop_sigma).max()
            z_within = ((w - w.median(0).values - within_median) / within_sigma).max()
            print(f"layer {layer_ids[layer]} e {eps}: z population {z_pop:.1f}, within {z_within:.1f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4)
