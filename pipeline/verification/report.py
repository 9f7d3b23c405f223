"""verify's outputs: the findings and numbers of one run as metrics/verify.json, a per-layer CSV,
reports/verify/findings.json, plots and reports/verify/report.md (readable without the code)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from pipeline.atomic import atomic_write_text
from pipeline.layout import METRICS, REPORTS

REPORT_DIR = REPORTS / "verify"
LAYER_CSV = METRICS / "verify_layers.csv"
CHECKS = ("structure", "values", "samples", "reference", "final_state", "storage")


@dataclass
class Finding:
    check: str
    message: str
    shard: str | None = None
    sample: int | None = None
    layer: int | None = None
    severity: str = "fail"  # fail | warn | cleared (a flagged sample the reference forward agrees with)
    positions: list[int] | None = None  # [first, last] positions a per-sample test flagged

    def where(self) -> str:
        parts = [f"{k}={v}" for k, v in (("shard", self.shard), ("sample", self.sample), ("layer", self.layer)) if v is not None]
        return ", ".join(parts)


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    layer_rows: list[dict] = field(default_factory=list)
    identity: list[list[float]] = field(default_factory=list)
    identity_columns: list[str] = field(default_factory=list)
    shard_stats: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    sample_tests: list[dict] = field(default_factory=list)  # per-sample tests: what, bound, population (verification/samples/scores.py)
    # tests this run could not calibrate and did not run: check, test, why, and from how many of what they run
    not_run: list[dict] = field(default_factory=list)

    def fail(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, **where))

    def warn(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, severity="warn", **where))

    def clear(self, check: str, sample: int, evidence: str) -> None:
        """`sample`'s failures of `check` cleared: kept as findings, with the evidence that clears them."""
        for f in self.findings:
            if f.severity == "fail" and f.check == check and f.sample == sample:
                f.severity, f.message = "cleared", f"{f.message}; cleared: {evidence}"

    def cleared(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "cleared"]

    def failures(self, check: str | None = None) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fail" and (check is None or f.check == check)]

    def skip(self, check: str, test: str, why: str, have: int, needs: int, unit: str) -> None:
        """A test not run: this run has `have` `unit` where it is calibrated from `needs`."""
        self.not_run.append({"check": check, "test": test, "why": why, "have": have, "needs": needs, "unit": unit})

    def verdict(self) -> str:
        """"failed", "passed", or "passed, with these tests not run" (what they are: `not_run`)."""
        if self.failures():
            return "failed"
        return "passed, with these tests not run" if self.not_run else "passed"


def not_run_line(entry: dict) -> str:
    """One test not run, for a stage line and the report: what, from how many it runs, and why."""
    return (f"{entry['test']} ({entry['check']}): this run has {entry['have']:,} {entry['unit']}, it runs from "
            f"{entry['needs']:,}: {entry['why']}")


def write_outputs(report: Report, meta: dict) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    METRICS.mkdir(parents=True, exist_ok=True)
    failures = report.failures()
    status = {c: ("fail" if report.failures(c) else "pass") for c in CHECKS}
    metrics = {
        "passed": not failures,
        "verdict": report.verdict(),
        "tests_not_run": report.not_run,
        "checks": status,
        "num_failures": len(failures),
        "num_warnings": sum(f.severity == "warn" for f in report.findings),
        "num_cleared": len(report.cleared()),
        "layer_ids": meta["layer_ids"],
        "dtype": meta["dtype"],
        **{k: v for k, v in report.summary.items() if k not in ("per_shard_next_token_acc", "per_shard_positions")},
        "layers": {str(r["layer_id"]): {k: v for k, v in r.items() if k != "layer_id"} for r in report.layer_rows},
    }
    atomic_write_text(METRICS / "verify.json", json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    header = ["layer_id", "max_abs_error", "rel_rms_error", "cosine_mean", "cosine_min"]
    csv = [",".join(header)] + [",".join(f"{r[h]:.6g}" if isinstance(r[h], float) else str(r[h]) for h in header) for r in report.layer_rows]
    atomic_write_text(LAYER_CSV, "\n".join(csv) + "\n")
    atomic_write_text(REPORT_DIR / "findings.json", json.dumps([asdict(f) for f in report.findings], indent=1) + "\n")
    plots = write_plots(report)
    atomic_write_text(REPORT_DIR / "report.md", render_markdown(report, metrics, status, plots))


def write_plots(report: Report) -> list[str]:
    if not report.layer_rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    ids = [str(r["layer_id"]) for r in report.layer_rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].bar(ids, [max(r["rel_rms_error"], 1e-12) for r in report.layer_rows], color="tab:blue", label="captured")
    if any("allowed" in r for r in report.layer_rows) and "calibration_rel_rms_error" in report.layer_rows[0]:
        axes[0].plot(ids, [r["allowed"] for r in report.layer_rows], "r_", markersize=30, label="allowed")
        axes[0].legend()
    axes[0].set_yscale("log")
    axes[0].set_title("relative RMS error vs reference")
    axes[0].set_xlabel("layer id (vLLM convention)")
    axes[1].bar(ids, [1 - r["cosine_min"] + 1e-12 for r in report.layer_rows], color="tab:orange")
    axes[1].set_yscale("log")
    axes[1].set_title("1 - min cosine over positions")
    axes[1].set_xlabel("layer id (vLLM convention)")
    fig.tight_layout()
    fig.savefig(REPORT_DIR / "layers.png", dpi=100)
    plt.close(fig)
    names.append("layers.png")

    fig, ax = plt.subplots(figsize=(1 + 0.5 * len(report.identity_columns), 1 + 0.5 * len(ids)))
    matrix = torch.tensor(report.identity).clamp_min(1e-9).log10()
    im = ax.imshow(matrix, cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(report.identity_columns)), report.identity_columns, rotation=45)
    ax.set_yticks(range(len(ids)), ids)
    ax.set_xlabel("reference state")
    ax.set_ylabel("declared layer id")
    ax.set_title("log10 relative error: must be smallest (brightest) on the declared id")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(REPORT_DIR / "layer_identity.png", dpi=100)
    plt.close(fig)
    names.append("layer_identity.png")
    return names


def render_markdown(report: Report, metrics: dict, status: dict, plots: list[str]) -> str:
    s = report.summary
    verdict = metrics["verdict"].replace("passed", "PASSED", 1).replace("failed", "FAILED", 1)
    sampled = s.get("final_state_positions") != s.get("masked_positions")
    positions_note = (" (a seeded sample per shard of those the per-sample tests judge: verify.final_state_positions_per_shard)"
                      if sampled else "")
    out = [
        f"# Hidden-state verification: {verdict}",
        "",
        f"Layers {metrics['layer_ids']} (vLLM convention: id k = input of decoder layer k, id N = last layer's output before the final norm), "
        f"dtype {metrics['dtype']}; {s.get('num_samples')} samples, {s.get('num_tokens')} tokens in {s.get('num_shards')} shards.",
        "",
        "| check | what it proves | result |",
        "| --- | --- | --- |",
        f"| structure | every shard matches its manifest's size and has exactly 3 tensors per sample of shape [T, L, H] (its header), token ids and loss masks equal prepare's, every sample once; "
        f"{len(s.get('audited_shards', []))} audited shard(s) read in full: sha256 equal to the manifest's and the recorded statistics equal to the bytes' "
        f"(sha256 checked on {s.get('hashed_shards')} of {s.get('num_shards')} shards) | {status['structure']} |",
        f"| values | no NaN/Inf, no all-zero or constant layer (per sample and layer, from the statistics the extractor recorded as it wrote them), no shard far off the others | {status['values']} |",
        f"| samples | every sample on its own: {samples_line(s)} | {status['samples']} |",
        f"| reference | a transformers forward on {len(s.get('reference_samples', []))} seeded samples agrees per layer, and no layer is scaled as a whole (its projection ratio on the reference near 1); each layer is closest to the reference state of its declared id; states align with their tokens (no +-1 shift) | {status['reference']} |",
        f"| final_state | lm_head(norm(h_N)) predicts like the target: argmax agreement {fmt(s.get('argmax_agreement'))} with the reference; next-token accuracy {fmt(s.get('final_state_next_token_acc'))} on {s.get('final_state_positions')} of the {s.get('masked_positions')} masked positions{positions_note} (reference forward: {fmt(s.get('reference_next_token_acc'))}) | {status['final_state']} |",
        f"| storage | {s.get('bytes_per_token')} bytes/token against a minimum of {s.get('min_bytes_per_token')} ({s.get('total_bytes')} bytes total) | {status['storage']} |",
        "",
    ]
    failures = report.failures()
    if failures:
        out += ["## Failures", "", "| check | where | what |", "| --- | --- | --- |"]
        out += [f"| {f.check} | {f.where()} | {f.message} |" for f in failures[:200]]
        out.append("")
    cleared = report.cleared()
    if cleared:
        out += ["## Flagged, then cleared by the reference forward", "",
                "The per-sample tests flagged these samples; re-run through the reference forward of their own tokens, "
                "their stored states agree with it on every captured layer over the flagged positions, at the reference "
                "check's tolerance: clean samples that the other samples' linear maps explain poorly, not faults.", "",
                "| check | where | what |", "| --- | --- | --- |"]
        out += [f"| {f.check} | {f.where()} | {f.message} |" for f in cleared[:200]] + [""]
    if report.not_run:
        out += ["## Tests not run", "", "Too few of what these tests are calibrated on: the run passes what it could judge, "
                "and these tests judged nothing (neither pass nor fail).", ""]
        out += [f"- {not_run_line(e)}" for e in report.not_run] + [""]
    out += render_sample_tests(s.get("sample_tests"))
    warnings = [f for f in report.findings if f.severity == "warn"]
    if warnings:
        out += ["## Warnings", ""] + [f"- [{f.check}] {f.where()} {f.message}" for f in warnings] + [""]
    if report.layer_rows:
        # fp32 bounds the max abs error; bf16/fp16 bound the relative RMS error (self-calibrated)
        calibrated = "calibration_rel_rms_error" in report.layer_rows[0]
        bound = "allowed rel. RMS error (calibrated)" if calibrated else "allowed max abs error"
        out += [
            "## Per layer, against the reference forward",
            "",
            f"| layer id | max abs error | rel. RMS error (pooled) | {bound} | projection ratio (allowed off 1) | cosine mean | cosine min | closest reference state | rel. error at t-1 / t / t+1 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in report.layer_rows:
            out.append(
                f"| {r['layer_id']} | {r['max_abs_error']:.3g} | {r['rel_rms_error']:.3g} | {r.get('allowed', float('nan')):.3g} | "
                f"{r.get('scale_ratio', float('nan')):.5f} ({r.get('scale_bound', float('nan')):.2%}) | {r['cosine_mean']:.6f} | {r['cosine_min']:.6f} | {r['closest_reference']} | "
                f"{r['shift_rel_error_-1']:.3g} / {r['shift_rel_error_0']:.3g} / {r['shift_rel_error_+1']:.3g} |"
            )
        out.append("")
    out += [f"![{p}]({p})" for p in plots] + [""]
    if report.shard_stats:
        out += ["## Per-layer statistics per shard (RMS)", "", "| shard | " + " | ".join(f"layer {k}" for k in next(iter(report.shard_stats.values()))) + " |"]
        out.append("| --- |" + " --- |" * len(next(iter(report.shard_stats.values()))))
        for name, stats in report.shard_stats.items():
            out.append(f"| {name} | " + " | ".join(f"{v['rms']:.4g}" for v in stats.values()) + " |")
        out.append("")
    out.append(f"Verify took {s.get('verify_seconds')} s" + (f" ({s['verify_over_extract_time']:.1%} of extraction time)." if "verify_over_extract_time" in s else "."))
    out.append(
        f"Reference forward: {s.get('reference')}, because {s.get('reference_choice')} (verify.reference_memory_gib). "
        f"Reference models: {s.get('reference_load')} ({s.get('reference_load_seconds')} s{', while the shards were scanned' if s.get('reference') == 'whole model' else ', after the scan'}); "
        f"per-sample predictors fitted in {s.get('coherence_fit_seconds')} s; the scan's staging buffers made in "
        f"{s.get('staging_seconds')} s; shard scan {s.get('scan_seconds')} s; reference forwards and comparisons "
        f"{s.get('reference_check_seconds')} s."
    )
    return "\n".join(out) + "\n"


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def samples_line(s: dict) -> str:
    t = s.get("sample_tests")
    if not t:
        return "not run (no shards with readable samples)"
    return (f"{t['judged_positions']} positions (every {t['stride']}th of each sample, all layers) scored for coherence of the "
            f"captured layers with each other and with the token; every run of {t['window_positions']} positions judged against "
            f"the whole run's, false-alarm bound {t['false_alarm_bound']:g} for the run")


def render_sample_tests(t: dict | None) -> list[str]:
    """What the per-sample tests measure, their thresholds and the clean population (pipeline/verification/samples/scores.py)."""
    if not t:
        return []
    out = [
        "## Per-sample tests",
        "",
        "Each captured layer of each token is predicted from the token's other captured layers and its embedding E[id] by "
        "a linear map fitted on this run's data; the token test predicts the first captured layer from E[id] alone. The "
        "score of a position is the *residual share*: the part of the state's energy the prediction leaves unexplained. "
        f"A window is {t['window_positions']} consecutive positions ({max(1, t['window_positions'] // t['stride'])} judged, every "
        f"{t['stride']}th); its score is the mean log residual share of its judged positions (the largest left out), compared with all {t['windows']} windows of the run "
        f"(median and a robust sigma, 1.4826 x the median absolute deviation). z* = {t['z_threshold']} is "
        f"the normal quantile that holds the whole run's false-alarm probability to {t['false_alarm_bound']:g} over every "
        "window of every test (Bonferroni). Clean scores have heavier tails than the robust sigma's normal law, so each "
        "test's threshold (against the run's windows, and against the window's own sample's median in samples long "
        "enough: the last column) is that normal quantile with the location and scale of this run's own scores of that "
        "test at their 80th and 99th percentiles (fitted without the samples above z* in it), never below z*; each "
        "sample's mean over all its positions is judged the same way against the other samples scored by the same "
        "predictors (the run's samples fall into two seeded folds, each scored by the map fitted on the other). Separately, each sample's adjacent captured layers are tried exchanged: a sample "
        "that fits 1.5x better with two layers swapped has them swapped. The *whitened* tests score the same residual "
        "weighed by the inverse of the clean residual's covariance (estimated on other samples of the run): noise or "
        "wrong values on a layer land in directions clean residuals rarely use, so they show there first.",
        "",
        "| test | run's median residual share | robust sigma (log) | highest window z of the run | threshold z | highest within-sample z | threshold |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    within = t.get("max_within_z") or [float("nan")] * len(t["tests"])
    within_at = t.get("within_z_threshold") or [float("nan")] * len(t["tests"])
    pop_at = t.get("population_z_threshold") or [t["z_threshold"]] * len(t["tests"])
    for name, med, sig, mz, pt, wz, wt in zip(t["tests"], t["population_median_share"], t["robust_sigma_log"], t["max_z"],
                                              pop_at, within, within_at, strict=True):
        out.append(f"| {name} | {med:.3g} | {sig:.3g} | {mz:.1f} | {pt:.1f} | {wz:.1f} | {wt:.1f} |")
    out += ["", f"Predictors fitted on {t['fit_tokens']} token rows. Exchange test: the best gain of any sample from an "
            f"exchange is {t.get('exchange_max_gain_log', float('nan')):.3g} (log; > 0 fails).", ""]
    identity = t.get("token_identity")
    if identity:
        whole = (f"; each whole sample's sum against the other samples': highest z {identity['max_whole_sample_z']:.1f}, "
                 f"threshold {identity['whole_sample_z_threshold']:.1f}" if identity.get("max_whole_sample_z") is not None else "")
        out += [
            "The *token-identity* test asks whether each judged position's states belong to this sample's tokens, from "
            "both ends of the captured stack: the token test's ratio (the first layer against E[id] and its "
            "neighbours') and, where the next token is one the target answers with, the next-token contrast (the final "
            "layer through the target's own lm_head: log p(the current or the after-next token) - log p(the next)), "
            "each ranked among the run's positions as a normal score and summed. Every run of "
            f"{identity['window_positions']} positions is judged by the sum of its scores over the root of their "
            f"number against the run's: highest z {identity['max_window_z']:.1f}, threshold "
            f"{identity['window_z_threshold']:.1f}{whole}.",
            "",
        ]
    return out
