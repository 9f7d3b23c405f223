"""bench step verify: the project's verify stage on the GPU-extracted shards."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import time
from pathlib import Path

from gpu_jobs.common import log


def _run_verify(proj: Path, **params) -> tuple[str | None, float]:
    """The verify stage in project `proj`, default params unless overridden: (failure message or None, seconds)."""
    import gc

    from pipeline.params import VerifyParams
    from pipeline.stages import verify

    gc.collect()  # the last run's reference models (48 GB at 8B) are freed before this one loads its own
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    t = time.monotonic()
    with contextlib.chdir(proj):
        try:
            verify.run(VerifyParams(**params))
        except verify.VerifyFailed as e:
            return str(e), time.monotonic() - t
    return None, time.monotonic() - t


def fit_inputs(meta: dict) -> dict:
    """The per-sample tests' fit at this shape (pipeline/verification/samples/least_squares.py, fit_folds; since 50ca83e):
    inputs (L + 1) H + 1 per row, one fp64 Gram matrix of them at a time (a fold's, solved in place), the fit's rows
    (fp32), the fold's map, and per fold and half the whitened test's residual sums L H^2 in fp64."""
    layers, hidden = len(meta["layer_ids"]), int(meta["hidden_size"])
    inputs = (layers + 1) * hidden + 1
    return {"inputs": inputs, "gram_bytes_fp64": inputs * inputs * 8, "grams_held": 1,
            "residual_sums_bytes_fp64": 4 * layers * hidden * hidden * 8,
            "map_bytes_fp64": inputs * (layers + 1) * hidden * 8}


def job_verify(state: dict, name: str) -> dict:
    """The project's verify stage on the first two shards (both prompt lengths), or on all of them where the
    workload says so (`verify_all`: the seed), on the GPU."""
    import datasets
    import torch

    from gpu_jobs.gpu_peaks import Peaks
    from pipeline import layout
    from pipeline.hidden_states import format as shards
    from pipeline.stages import verify
    from pipeline.verification import shards as verify_shards
    from pipeline.verification.reference import model as reference

    src = Path(state[f"project_{name}"])
    spec = state[f"spec_{name}"]
    full = datasets.load_from_disk(str(src / layout.PREPARED_DATASET))
    hs_src = src / layout.HIDDEN_STATES_DIR
    n_shards = len(list(hs_src.glob("shard-*.safetensors"))) if spec.get("verify_all") else 2
    n = min(len(full), n_shards * spec["samples_per_shard"])
    proj = Path(state["work"]) / f"verify-{name}"
    shutil.rmtree(proj, ignore_errors=True)
    (proj / layout.TARGET_JSON).parent.mkdir(parents=True)
    shutil.copy2(src / layout.TARGET_JSON, proj / layout.TARGET_JSON)
    (proj / layout.METRICS).mkdir(parents=True)
    shutil.copy2(src / layout.METRICS / "extract.json", proj / layout.METRICS / "extract.json")
    full.select(range(n)).save_to_disk(str(proj / layout.PREPARED_DATASET))
    hs_dst = proj / layout.HIDDEN_STATES_DIR
    hs_dst.mkdir(parents=True)
    for k in range(n_shards):
        for p in (hs_src / shards.shard_name(k), shards.manifest_path(hs_src / shards.shard_name(k))):
            os.link(p, hs_dst / p.name)
    shutil.copy2(hs_src / shards.META_FILE, hs_dst / shards.META_FILE)
    sub_bytes = sum(p.stat().st_size for p in hs_dst.glob("shard-*.safetensors"))

    # Keep the reference models and their final states, to measure how often transformers' own
    # bf16 forward agrees with its fp32 one on the argmax (what the final-state check asks of vLLM).
    loaded, finals = [], {}
    orig_load = reference.ReferenceModel.load.__func__
    orig_states = reference.ReferenceModel.states

    def load(cls, *a, **kw):
        t = time.monotonic()
        m = orig_load(cls, *a, **kw)
        log(f"reference {m.dtype} loaded on {m.device} in {time.monotonic() - t:.1f} s")
        loaded.append(m)
        return m

    def states(self, input_ids):
        out = orig_states(self, input_ids)
        finals[(str(self.dtype), tuple(input_ids[:16].tolist()), len(input_ids))] = out[-1].float()
        return out

    reference.ReferenceModel.load = classmethod(load)
    reference.ReferenceModel.states = states
    timings = {}
    orig_struct = verify.check_structure_and_values

    def struct(*a, **kw):
        t = time.monotonic()
        r = orig_struct(*a, **kw)
        timings["structure_values_s"] = round(time.monotonic() - t, 2)
        return r

    verify.check_structure_and_values = struct
    # the seed: the streamed reference under a budget below the model's size; GPU peaks of the
    # reference alone, of the per-sample tests' fit and of the shard scan, and of the whole process
    budget = {"reference_memory_gib": state[f"reference_gib_{name}"]} if state.get(f"reference_gib_{name}") else {}
    peaks = Peaks()
    peaks.wrap(verify, "stream_references", "reference")
    peaks.wrap(verify_shards, "fit_coherence", "per_sample_fit")
    peaks.wrap(verify_shards, "scan_shards", "scan")
    failed, verify_s = _run_verify(proj, **budget)
    peak = peaks.process_peak()
    log(f"verify {name}: GPU peaks {json.dumps(peaks.parts)}, process {peak}")
    metrics = json.loads((proj / layout.METRICS / "verify.json").read_text())
    report_md = (proj / "reports/verify/report.md").read_text()
    findings = json.loads((proj / "reports/verify/findings.json").read_text())
    (Path(state["out"]) / f"verify_{name}_report.md").write_text(report_md)

    # bf16 transformers vs fp32 transformers: argmax agreement of lm_head(norm(h_N))
    cal = {}
    fp32 = next((m for m in loaded if m.dtype == torch.float32), None)
    if fp32 is not None:
        agree = count = 0
        for key, h in finals.items():
            if key[0] != "torch.bfloat16":
                continue
            ref = finals.get(("torch.float32", key[1], key[2]))
            if ref is None:
                continue
            a = fp32.final_logits(h).argmax(-1)
            b = fp32.final_logits(ref).argmax(-1)
            agree += int((a == b).sum())
            count += int(a.numel())
        if count:
            cal = {"hf_bf16_vs_fp32_argmax_agreement": round(agree / count, 5), "positions": count}
    summary = {
        "passed": failed is None,
        "failure": failed,
        "verify_s": round(verify_s, 2),
        "subset_samples": n,
        "subset_bytes": sub_bytes,
        "structure_gb_s": round(sub_bytes / timings["structure_values_s"] / 1e9, 4)
        if timings.get("structure_values_s")
        else None,
        **timings,
        **cal,
        "gpu_peak_bytes": peak,
        "gpu_peaks": peaks.parts,
        # the child process's own host peak (it runs verify alone): ru_maxrss is in KiB on Linux
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "per_sample_fit_inputs": fit_inputs(shards.read_meta(hs_dst)),
        "subset_shards": n_shards,
        "reference_budget_bytes": int(budget["reference_memory_gib"] * 2**30) if budget else None,
        "metrics_summary": {k: metrics.get(k) for k in ("reference", "reference_choice", "reference_load", "reference_load_seconds",
                                                        "reference_check_seconds", "verify_seconds", "verify_over_extract_time",
                                                        "coherence_fit_seconds", "scan_seconds", "embedding_load_seconds",
                                                        "num_shards", "num_tokens", "total_bytes")},
        "layers": metrics.get("layers"),
        "argmax_agreement": metrics.get("argmax_agreement"),
        "checks": metrics.get("checks"),
    }
    log(f"verify {name}: passed={summary['passed']} {json.dumps(summary['layers'])}")
    return {"summary": summary, "metrics": metrics, "findings": findings[:50]}
