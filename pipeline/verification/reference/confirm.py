"""Samples the per-sample tests flag, re-run through the reference forward before they are called corrupt.

The per-sample tests judge each sample against linear maps fitted on the run's other samples. On a target whose layers
explain each other poorly for a few clean samples (a barely trained one: the DeepSeek-V3 trained 20 steps, 2-4 clean
samples of 540 flagged at 1.2-2.5 of their thresholds; a narrow Llama of hidden 64, one sample at 1.03-1.23), such a
sample and a faulty one look alike to those tests. A transformers forward of the flagged sample's own tokens does not:
every fault the tests exist for (rows zeroed, cut short, shifted, exchanged, another request's, noise) makes the stored
states disagree with it. So each flagged sample (at most CONFIRM_MAX_SAMPLES) is compared with the reference over the
positions it was flagged on, per captured layer, at the reference check's own tolerance (pipeline/verification/reference/check.py):
one that agrees on every layer is cleared (kept in the report as cleared, with the evidence), one that does not stays a
failure, its disagreement added to the evidence.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.hidden_states import format as shard_format
from pipeline.hidden_states import fp8
from pipeline.params import VerifyParams
from pipeline.progress import progress
from pipeline.verification.reference.check import allowed_error
from pipeline.verification.reference.model import References
from pipeline.verification.report import Finding, Report

CONFIRM_MAX_SAMPLES = 16  # flagged samples re-run; beyond them a run's failures stand as the tests found them


def flagged_samples(report: Report) -> dict[int, list[Finding]]:
    """The samples the per-sample tests failed, each with its findings, the first CONFIRM_MAX_SAMPLES in report order."""
    out: dict[int, list[Finding]] = {}
    for f in report.failures("samples"):
        if f.sample is not None and (f.sample in out or len(out) < CONFIRM_MAX_SAMPLES):
            out.setdefault(f.sample, []).append(f)
    return out


def confirm_flagged(report: Report, params: VerifyParams, meta: dict, layer_ids: list[int], refs: References,
                    sample_to_shard: dict[int, Path], flagged: dict[int, list[Finding]]) -> None:
    """Clear each flagged sample whose stored states agree with the reference forward over its flagged positions."""
    rows = {r["layer_id"]: r for r in report.layer_rows}
    cleared = []
    for sid, findings in progress(list(flagged.items()), desc="verify flagged samples", unit="sample"):
        sample = shard_format.load_sample(sample_to_shard[sid], sid)  # fp8: dequantized, with its scales
        hs = sample.hidden_states.to(refs.fp32.device).float()
        T = hs.shape[0]
        spans = [f.positions for f in findings]
        # the positions flagged (a finding without positions, e.g. layers exchanged, is about the whole sample)
        lo, hi = (min(s[0] for s in spans), max(s[1] for s in spans)) if all(spans) else (0, T - 1)
        span = slice(lo, hi + 1)
        ref = refs.fp32.states(sample.input_ids).float()[:, span]
        low = refs.low.states(sample.input_ids).float()[:, span] if refs.low is not None else None
        bound = fp8.error_bound(hs[span], sample.scale[span].to(hs.device)) if sample.scale is not None else None
        layers, agree = {}, True
        for i, lid in enumerate(layer_ids):
            if lid >= ref.shape[0]:
                continue
            error, allowed = layer_agreement(params, meta["dtype"], hs[span, i], ref[lid], rows.get(lid, {}),
                                             low[lid] if low is not None else None,
                                             bound[:, i] if bound is not None else None)
            layers[lid] = {"error": error, "allowed": allowed}
            agree = agree and error <= allowed
        measure = "max abs error" if meta["dtype"] == "float32" else "relative error"
        evidence = (f"the reference forward of its tokens over positions {lo}..{hi}: {measure} per layer "
                    + ", ".join(f"{lid}: {v['error']:.3g} (allowed {v['allowed']:.3g})" for lid, v in layers.items()))
        if agree:
            report.clear("samples", sid, f"agrees with {evidence}: a clean sample the other samples' linear maps "
                         "explain poorly, not a fault")
            cleared.append({"sample": sid, "shard": findings[0].shard, "positions": [lo, hi], "layers": layers})
        else:
            findings[0].message += f"; confirmed: the stored states disagree with {evidence}"
    report.summary["flagged_samples_cleared"] = cleared
    report.summary["flagged_samples_confirmed"] = [sid for sid in flagged if sid not in {c["sample"] for c in cleared}]


def layer_agreement(params: VerifyParams, dtype: str, captured: torch.Tensor, ref: torch.Tensor, row: dict,
                    low: torch.Tensor | None, bound: torch.Tensor | None) -> tuple[float, float]:
    """One layer's error over the flagged positions and what the reference check allows (`check.allowed_error`): fp32,
    the max abs error; otherwise the relative error, calibrated by the independent low-precision reference's over the
    same positions or the run's, whichever is larger (a routing flip in the span raises both forwards'), plus fp8's
    per-element bound over the span."""
    if dtype == "float32":
        return float((captured - ref).abs().max()), allowed_error(params, dtype, float(ref.abs().max()), 0.0)
    norm = float(ref.norm()) or 1e-30
    calibration = max(float((low - ref).norm()) / norm if low is not None else 0.0, row.get("calibration_rel_rms_error", 0.0))
    quantization = float(bound.norm()) / norm if bound is not None else None
    return float((captured - ref).norm()) / norm, allowed_error(params, dtype, 0.0, calibration, quantization)
