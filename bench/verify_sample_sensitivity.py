"""How weak a fault confined to 16 positions of one layer of one sample verify's per-sample tests catch.

For a clean extraction project (artifacts/ of a real run), fits the predictors and scores every
sample as verify does, judges the clean run with the real `check_samples` (false alarms, clean maxima
against the thresholds), then plants a fault (in memory) on 16 consecutive positions of one captured
layer of a victim sample, re-scores that sample and judges the whole run again: caught = the victim
is failed with the planted layer named. Per layer and fault kind, the smallest relative RMS error e
caught in every victim, with the whitened tests (new) and without them (old: their scores held
constant, so they never fail).

    python bench/verify_sample_sensitivity.py PROJECT_DIR [STRIDE] [VICTIMS]

Env: EPS (the errors tried), SHARDS (only the first this many shards: the 8B shape's 34 GB does not fit the host
twice), DEVICE (where the fit and the scoring run: cpu, or cuda as verify on a GPU).

Fault kinds: noise (Gaussian, relative RMS e over the 16 positions), scale (rows times 1 + e), and
two of fixed size: `other` (the layer's rows from another request at the same positions) and `stale`
(the layer's rows of the previous position: a buffer copied a token late).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import load_from_disk

from pipeline.hidden_states.format import complete_shards, load_sample, read_manifest
from pipeline.params import VerifyParams
from pipeline.verification.report import Report
from pipeline.verification.samples import fit as verify_fit
from pipeline.verification.samples import scores as V
from pipeline.verification.samples import whitening as W
from pipeline.verification.samples.judge import check_samples

EPS = tuple(float(e) for e in os.environ.get("EPS", "0.05,0.1,0.15,0.2,0.3,0.5,1,2").split(","))
RUN = 16


def main(root: Path, stride: int, victims_wanted: int) -> None:
    torch.manual_seed(0)
    W.WHITEN_RIDGE = float(os.environ.get("WHITEN_RIDGE", W.WHITEN_RIDGE))  # to compare settings
    W.WHITEN_POWER = float(os.environ.get("WHITEN_POWER", W.WHITEN_POWER))
    target = json.loads((root / "artifacts/model/target.json").read_text())
    embedding = verify_fit.load_embedding(Path(target["path"]), device=os.environ.get("DEVICE", "cpu"))
    files = complete_shards(root / "artifacts/hidden_states")
    files = files[: int(os.environ["SHARDS"])] if os.environ.get("SHARDS") else files
    prepared = load_from_disk(str(root / "artifacts/prepared/dataset"))
    layer_ids = json.loads((root / "artifacts/hidden_states/extract_meta.json").read_text())["layer_ids"]
    params = VerifyParams(sample_stride=stride)
    coherence = verify_fit.fit_coherence(files, layer_ids, embedding.shape[1], embedding, prepared, params)
    L = len(layer_ids)
    shard_of = {sid: f.stem for f in files for sid in read_manifest(f)["sample_ids"]}
    samples = {sid: load_sample(f, sid) for f in files for sid in read_manifest(f)["sample_ids"]}

    def score(sid: int, h: torch.Tensor) -> V.SampleScores:
        bf16 = h.dtype == torch.bfloat16
        rows = h.view(torch.int16).numpy() if bf16 else h.numpy()
        return coherence.score_samples([(sid, rows, "BF16" if bf16 else "F32", samples[sid].input_ids)])[0]

    clean = {sid: score(sid, s.hidden_states) for sid, s in samples.items()}

    def judge(scores: dict[int, V.SampleScores], old: bool) -> Report:
        if old:  # the whitened columns held constant: z 0 everywhere, never over a threshold
            scores = {k: V.SampleScores(s.sample, s.positions, torch.cat([s.shares[:, : 2 * L + 3],
                      torch.ones_like(s.shares[:, 2 * L + 3 :])], 1), s.exchange) for k, s in scores.items()}
        report = Report()
        check_samples(report, [(shard_of[k], s) for k, s in scores.items()], coherence, params)
        return report

    dtype = next(iter(samples.values())).hidden_states.dtype
    print(f"whiten ridge {W.WHITEN_RIDGE} power {W.WHITEN_POWER}")
    print(f"{root}: {len(samples)} samples, {dtype}, L {L} H {embedding.shape[1]}, stride {stride}, fit tokens "
          f"{coherence.fit_tokens}, refit excluded {coherence.refit_excluded}")
    report = judge(clean, old=False)
    t = report.summary["sample_tests"]
    print(f"clean run: {len(report.failures('samples'))} per-sample failures, z* {t['z_threshold']}")
    for name, mz, pt, wz, wt in zip(t["tests"], t["max_z"], t["population_z_threshold"], t["max_within_z"] or [],
                                    t["within_z_threshold"], strict=False):
        print(f"  {name:34s} run's windows max {mz:5.1f} / threshold {pt:5.1f}   within max {wz:5.1f} / {wt:5.1f}")
    for f in report.failures("samples"):
        print("  FALSE ALARM:", f.where(), f.message)
    by_length = sorted((sid for sid, s in samples.items() if s.input_ids.numel() >= 72), key=lambda sid: samples[sid].input_ids.numel())
    if not by_length:
        print("no sample of 72 tokens or more: no victim to plant 16 positions from position 40-46 into")
        return
    victims = [by_length[i * (len(by_length) - 1) // max(victims_wanted, 1)] for i in range(victims_wanted)]

    def planted(sid: int, kind: str, layer: int, eps: float) -> torch.Tensor:
        h = samples[sid].hidden_states.clone()
        start = 40 + sid % 7
        span = slice(start, start + RUN)
        rows = h[span, layer].float()
        if kind == "noise":
            noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(sid))
            h[span, layer] = (rows + noise * (eps * rows.norm() / noise.norm())).to(h.dtype)
        elif kind == "scale":
            h[span, layer] = (rows * (1 + eps)).to(h.dtype)
        elif kind == "stale":
            h[span, layer] = samples[sid].hidden_states[start - 1 : start + RUN - 1, layer]
        else:  # other: another request's rows of this layer at the same positions
            other = next(o for o, s in samples.items() if o != sid and s.input_ids.numel() >= start + RUN)
            h[span, layer] = samples[other].hidden_states[span, layer]
        return h

    def judged(sid: int, h: torch.Tensor, layer: int, old: bool) -> tuple[bool, bool]:
        """(the victim failed, the victim failed with the planted layer named)"""
        found = [f for f in judge({**clean, sid: score(sid, h)}, old).failures("samples") if f.sample == sid]
        return bool(found), any(f.layer == layer_ids[layer] for f in found)

    print(f"victims {victims} (lengths {[samples[v].input_ids.numel() for v in victims]}); smallest e caught in every "
          "victim with the planted layer named (in brackets: the victim failed, whatever layer named)")
    for kind in ("noise", "scale"):
        for layer in range(L):
            line = []
            for old in (True, False):
                detected = named = None
                for e in EPS:
                    got = [judged(v, planted(v, kind, layer, e), layer, old) for v in victims]
                    detected = detected if detected is not None or not all(d for d, _ in got) else e
                    named = named if named is not None or not all(n for _, n in got) else e
                    if named is not None:
                        break
                line.append(f"{'old' if old else 'new'} {named} ({detected})")
            print(f"  {kind} layer {layer_ids[layer]}: {', '.join(line)}", flush=True)
    for kind in ("stale", "other"):
        for layer in range(L):
            got = {old: [judged(v, planted(v, kind, layer, 0), layer, old) for v in victims] for old in (True, False)}
            print(f"  {kind} layer {layer_ids[layer]}: named in old {sum(n for _, n in got[True])}/{len(victims)}, "
                  f"new {sum(n for _, n in got[False])}/{len(victims)} (failed: old {sum(d for d, _ in got[True])}, "
                  f"new {sum(d for d, _ in got[False])})", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
