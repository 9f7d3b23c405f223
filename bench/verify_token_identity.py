"""How long a shift, and whether another request's states, verify's per-sample tests catch on a finished project.

Fits the predictors and scores every sample as verify's scan does (the token-identity test's next-token contrast
through the target's own lm_head included), judges the clean run with the real `check_samples`, then per victim
plants, in memory, every captured layer's rows (then the final layer's alone) shifted by one token over K positions
(from position 40) or taken from another request of at least the victim's length, re-scores that sample and judges
the whole run again.

    python bench/verify_token_identity.py PROJECT_DIR [VICTIMS] [LENGTHS]

LENGTHS: the shifts' lengths in positions, comma-separated (default 16,32,48). docs/ARCHITECTURE.md ("Per-sample
tests: what is caught, what cannot be", per architecture and dtype) has runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import load_from_disk

from pipeline.hidden_states.format import complete_shards, load_sample, read_manifest
from pipeline.params import VerifyParams
from pipeline.verification.final_head import FinalHead
from pipeline.verification.reference.check import reference_selection
from pipeline.verification.reference.model import load_final_head
from pipeline.verification.report import Report
from pipeline.verification.samples.fit import fit_coherence, load_embedding
from pipeline.verification.samples.judge import check_samples
from pipeline.verification.samples.next_token import answered_positions, contrast_scores, contrast_tokens

START = 40


def main(root: Path, victims_wanted: int, lengths: list[int]) -> None:
    target = json.loads((root / "artifacts/model/target.json").read_text())
    model = Path(target["path"]) if Path(target["path"]).is_absolute() else root / target["path"]
    params = VerifyParams()
    embedding = load_embedding(model, device="cpu")
    head = FinalHead(load_final_head(model, device="cpu"))
    files = complete_shards(root / "artifacts/hidden_states")
    layer_ids = json.loads((root / "artifacts/hidden_states/extract_meta.json").read_text())["layer_ids"]
    coherence = fit_coherence(files, layer_ids, embedding.shape[1], embedding, load_from_disk(str(root / "artifacts/prepared/dataset")), params)
    shard_of = {sid: f.stem for f in files for sid in read_manifest(f)["sample_ids"]}
    samples = {sid: load_sample(f, sid) for f in files for sid in read_manifest(f)["sample_ids"]}

    def score(sid: int, h: torch.Tensor):
        rows = h.view(torch.int16).numpy() if h.dtype == torch.bfloat16 else h.numpy()
        s = coherence.score_samples([(sid, rows, "BF16" if h.dtype == torch.bfloat16 else "F32", samples[sid].input_ids)])[0]
        ids, mask = samples[sid].input_ids.numpy(), samples[sid].loss_mask.numpy()
        answered = answered_positions(s.positions, mask)
        s.next_token = torch.full((s.positions.size,), float("nan"))
        if len(answered):
            log_probs = head.predict(h[torch.from_numpy(answered), -1], torch.from_numpy(contrast_tokens(ids, answered)))[1]
            s.next_token = contrast_scores(log_probs, answered, s.positions, mask)
        return s

    def judge(scores: dict) -> Report:
        report = Report()
        check_samples(report, [(shard_of[k], s) for k, s in scores.items()], coherence, params)
        return report

    clean = {sid: score(sid, s.hidden_states) for sid, s in samples.items()}
    report = judge(clean)
    identity = report.summary["sample_tests"]["token_identity"]
    print(f"{root}: {len(samples)} samples, {next(iter(samples.values())).hidden_states.dtype}; clean: "
          f"{len(report.failures('samples'))} per-sample failures; token identity: windows max {identity['max_window_z']:.1f} / "
          f"{identity['window_z_threshold']:.1f}, whole samples max {identity['max_whole_sample_z']:.1f} / "
          f"{identity['whole_sample_z_threshold']:.1f}")
    refs = set(reference_selection(list(samples), params))
    longest = max(s.input_ids.numel() for s in samples.values())
    candidates = [sid for sid in sorted(samples) if sid not in refs and 100 <= samples[sid].input_ids.numel() < longest]
    victims = [candidates[i * (len(candidates) - 1) // max(victims_wanted - 1, 1)] for i in range(victims_wanted)]
    kinds = ([f"shifted over {k}" for k in lengths] + ["another request's every layer"]
             + [f"final layer only, shifted over {k}" for k in lengths] + ["another request's final layer"])
    for kind in kinds:
        caught = failed = 0
        layers = slice(-1, None) if "final layer" in kind else slice(None)
        named = layer_ids[-1] if "final layer" in kind else layer_ids[0]
        for sid in victims:
            h = samples[sid].hidden_states.clone()
            if "shifted" in kind:
                k = int(kind.split()[-1])
                h[START : START + k, layers] = samples[sid].hidden_states[START - 1 : START + k - 1, layers]
            else:
                length = h.shape[0]
                other = next(o for o, s in sorted(samples.items()) if o != sid and s.input_ids.numel() >= length)
                h[:, layers] = samples[other].hidden_states[:length, layers]
            found = [f for f in judge({**clean, sid: score(sid, h)}).failures("samples") if f.sample == sid]
            caught += any(f.layer == named or "token-identity" in f.message for f in found)
            failed += bool(found)
        print(f"  {kind}: caught in {failed}, named (layer {named} or the token identity) in {caught} of {len(victims)} "
              f"victims {victims}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4,
         [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "16,32,48").split(",")])
