"""verify: prove the extracted hidden states are right, not just present.

Checks (docs/ARCHITECTURE.md lists what each catches):
  structure   every shard: size against its manifest, safetensors header (exact key set, dtype,
              [T, L, H] shape), token ids and loss mask equal prepare's, sample ids complete
              and unique; audited shards (seeded sample): sha256, recorded statistics vs bytes
  values      from the statistics the extractor recorded per sample and layer: finite, no
              all-zero or constant layer, per-layer stats per shard, outlier shards
  reference   a seeded subset re-run through transformers: per-layer error and cosine, a
              layer-identity matrix that must peak at the declared id, a +-1 token shift test
  final_state on every masked position: argmax(lm_head(norm(h_N))) against the next token,
              and against the reference forward's argmax on the reference subset
  storage     bytes per token against the minimum L x H x dtype size
A failed check exits non-zero naming shard, sample, layer and check; no verdict is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pipeline import agreement
from pipeline.atomic import atomic_write_text
from pipeline.errors import PipelineError
from pipeline.layout import HIDDEN_STATES_DIR, METRICS, PREPARED_DATASET, REPORTS, VERIFY_VERDICT
from pipeline.params import VerifyParams
from pipeline.reference import DTYPES, FinalHeadModel, References, load_final_head, load_references
from pipeline.reference_cost import BUDGET_PARAM
from pipeline.shards import read_meta
from pipeline.streamed_reference import choose_reference, shard_sequences, stream_references
from pipeline.target import load_target
from pipeline.verify_scan import Finding, PreparedTokens, ScanContext, default_workers, scan_shards

REPORT_DIR = REPORTS / "verify"
LAYER_CSV = METRICS / "verify_layers.csv"
OUTLIER_FACTOR = 3.0  # a shard's per-layer RMS this far from the median of all shards is flagged
STORAGE_OVERHEAD_WARN = 1.5
CHERNOFF_EXPONENT = 14.0  # exp(-14) ~ 1e-6: the false-alarm bound of the per-shard accuracy check
BF16_REL_FLOOR = 2.0**-8  # bf16 rounding alone gives about this relative error


class VerifyFailed(PipelineError):
    pass


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    layer_rows: list[dict] = field(default_factory=list)
    identity: list[list[float]] = field(default_factory=list)
    identity_columns: list[str] = field(default_factory=list)
    shard_stats: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)

    def fail(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, **where))

    def warn(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, severity="warn", **where))

    def failures(self, check: str | None = None) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fail" and (check is None or f.check == check)]


def run(params: VerifyParams) -> None:
    started = time.perf_counter()
    target = load_target()
    meta = read_meta(HIDDEN_STATES_DIR)
    if not meta.get("complete"):
        raise VerifyFailed(f"{HIDDEN_STATES_DIR}: extraction is not complete (extract_meta.json complete=false); re-run extract")
    VERIFY_VERDICT.unlink(missing_ok=True)  # a stale "passed" must never outlive a failed run
    report = Report()
    layer_ids: list[int] = list(meta["layer_ids"])
    workers = params.workers or default_workers()
    from datasets import load_from_disk

    prepared = load_from_disk(str(PREPARED_DATASET))
    # whole model or streamed (streamed_reference.py); a budget too small fails here, before loading
    choice = choose_reference(target.path, meta["dtype"], params.reference_memory_gib,
                              max(prepared["seq_len"], default=1), target.trust_remote_code)
    # The final-state pass needs only the final norm and lm_head: loaded alone first (this also
    # starts the GPU and imports the model's code, before the scan's threads compete for the GIL),
    # they let the scan run while the full references load in the background.
    head = load_final_head(target.path, target.trust_remote_code)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-reference") as loader:
        references = None if choice.streamed else loader.submit(load_references, target.path, meta["dtype"], target.trust_remote_code)
        alone = isinstance(head, FinalHeadModel)
        if choice.streamed and not alone:
            raise VerifyFailed(f"{target.path}: the streamed reference needs the final norm and lm_head read alone: {head}")
        report.summary["final_state_head_source"] = (
            f"final norm + lm_head loaded alone ({head.seconds:.2f} s)" if alone else f"the full fp32 reference's ({head})"
        )

        def head_model():
            return head if alone else references.result().fp32

        sample_to_shard = check_structure_and_values(report, params, meta, prepared, head_model, target.hidden_size, workers)
        refs = references.result() if references else stream_references(
            target.path, meta["dtype"], shard_sequences(reference_selection(params, sample_to_shard), sample_to_shard),
            choice, head, target.trust_remote_code)
    report.summary.update(reference="streamed" if choice.streamed else "whole model", reference_choice=choice.why)
    report.summary.update(reference_load=refs.how, reference_load_seconds=round(refs.seconds, 3))
    t0 = time.perf_counter()
    check_reference(report, params, meta, layer_ids, refs, sample_to_shard)
    report.summary["reference_check_seconds"] = round(time.perf_counter() - t0, 3)
    check_final_state_rates(report, params)
    report.summary["verify_seconds"] = round(time.perf_counter() - started, 3)
    extract_metrics = METRICS / "extract.json"
    if extract_metrics.is_file():
        extract_seconds = json.loads(extract_metrics.read_text()).get("wall_s")
        if extract_seconds:
            report.summary["verify_over_extract_time"] = round(report.summary["verify_seconds"] / extract_seconds, 4)
    write_outputs(report, meta)

    failures = report.failures()
    if failures:
        lines = [f"{len(failures)} check(s) failed (full report: {REPORT_DIR / 'report.md'}):"]
        lines += [f"  [{f.check}] {f.where()}: {f.message}" for f in failures[:20]]
        if len(failures) > 20:
            lines.append(f"  ... and {len(failures) - 20} more")
        raise VerifyFailed("\n".join(lines))
    verdict = {"passed": True, "run_key": meta.get("run_key"), "layer_ids": layer_ids, "num_samples": len(prepared)}
    atomic_write_text(VERIFY_VERDICT, json.dumps(verdict, indent=1, sort_keys=True) + "\n")
    print(f"verify: all checks passed on {len(prepared)} samples ({report.summary['verify_seconds']:.1f} s); report: {REPORT_DIR / 'report.md'}")


# ---------------------------------------------------------------- structure, values, final state


def audit_selection(names: list[str], params: VerifyParams) -> frozenset[str]:
    """The seeded sample of shards read in full (sha256 and statistics re-derived from the bytes)."""
    k = min(len(names), max(params.audit_min_shards, math.ceil(params.audit_fraction * len(names))))
    return frozenset(random.Random(params.seed).sample(sorted(names), k))


@contextlib.contextmanager
def tf32_matmuls():
    """TF32 for the final-state pass's lm_head on the GPU (~7x an fp32 matmul on an H200): an
    argmax compared with next tokens at a rate does not need full fp32; the reference forward,
    whose errors are compared tightly, runs after and without it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def check_structure_and_values(report: Report, params: VerifyParams, meta: dict, prepared, head_model, hidden_size: int, workers: int) -> dict[int, Path]:
    layer_ids = meta["layer_ids"]
    dtype = DTYPES[meta["dtype"]]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    files = sorted(HIDDEN_STATES_DIR.glob("shard-*.safetensors"))
    orphans = [p for p in HIDDEN_STATES_DIR.glob("shard-*.json") if not p.with_suffix(".safetensors").is_file()]
    for p in orphans:
        report.fail("structure", "manifest without its shard file", shard=p.stem)
    if not files:
        report.fail("structure", f"no shards in {HIDDEN_STATES_DIR}")
    audit = audit_selection([p.stem for p in files], params)
    context = ScanContext(
        layer_ids, hidden_size, dtype, PreparedTokens(prepared), head_model,
        audit=audit, hash_all=params.hash_all_shards,
        final_state_positions=params.final_state_positions_per_shard, seed=params.seed,
    )
    t0 = time.perf_counter()
    with tf32_matmuls():
        scans = scan_shards(files, context, workers)
    report.summary["scan_seconds"] = round(time.perf_counter() - t0, 3)

    seen: dict[int, Path] = {}
    total_bytes = total_tokens = correct = counted = 0
    per_shard_acc: dict[str, float] = {}
    per_shard_positions: dict[str, int] = {}
    for scan in scans:  # in shard order, so "duplicate" names the later shard
        report.findings.extend(scan.findings)
        for sid in scan.sample_ids:
            if sid in seen:
                report.fail("structure", f"duplicate sample id, also in {seen[sid].stem}", shard=scan.name, sample=sid)
            else:
                seen[sid] = scan.path
        if not scan.read_ok:
            continue
        total_bytes += scan.bytes
        total_tokens += scan.tokens
        correct += scan.hits
        counted += scan.counted
        per_shard_acc[scan.name] = scan.hits / scan.counted if scan.counted else float("nan")
        per_shard_positions[scan.name] = scan.counted
        report.shard_stats[scan.name] = scan.stats

    missing = sorted(set(range(len(prepared))) - set(seen))
    if missing:
        report.fail("structure", f"{len(missing)} sample(s) of the prepared dataset have no hidden states: {missing[:10]}")
    check_outlier_shards(report, layer_ids)

    min_bytes = len(layer_ids) * hidden_size * itemsize + 8 + 1  # hidden states + int64 id + uint8 mask
    bytes_per_token = total_bytes / max(total_tokens, 1)
    report.summary.update(
        num_shards=len(files),
        num_samples=len(seen),
        num_tokens=total_tokens,
        total_bytes=total_bytes,
        bytes_per_token=round(bytes_per_token, 2),
        min_bytes_per_token=min_bytes,
        storage_overhead=round(bytes_per_token / min_bytes, 4),
        final_state_next_token_acc=(correct / counted) if counted else None,
        final_state_positions=counted,
        masked_positions=sum(scan.masked_positions for scan in scans),
        per_shard_next_token_acc=per_shard_acc,
        per_shard_positions=per_shard_positions,
        verify_workers=workers,
        audited_shards=sorted(scan.name for scan in scans if scan.audited),
        hashed_shards=sum(scan.hashed for scan in scans),
        final_state_head=context.final_head.mode,
        # summed over the worker threads (they overlap): where the per-shard pass spends its time
        scan_thread_seconds={k: round(sum(scan.seconds.get(k, 0.0) for scan in scans), 3)
                             for k in sorted({k for scan in scans for k in scan.seconds})},
    )
    if total_tokens and bytes_per_token > STORAGE_OVERHEAD_WARN * min_bytes:
        report.warn("storage", f"{bytes_per_token:.0f} bytes/token is over {STORAGE_OVERHEAD_WARN}x the minimum {min_bytes}")
    return seen


def check_outlier_shards(report: Report, layer_ids: list[int]) -> None:
    if len(report.shard_stats) < 3:
        return
    for lid in map(str, layer_ids):
        rms = {name: stats[lid]["rms"] for name, stats in report.shard_stats.items()}
        median = float(torch.tensor(list(rms.values())).median())
        for name, value in rms.items():
            if median > 0 and not (median / OUTLIER_FACTOR <= value <= median * OUTLIER_FACTOR):
                report.fail("values", f"RMS {value:.4g} is over {OUTLIER_FACTOR}x off the median {median:.4g} of all shards", shard=name, layer=int(lid))


def check_final_state_rates(report: Report, params: VerifyParams) -> None:
    """Every shard's next-token accuracy from its final states against the reference forward's."""
    ref_acc = report.summary.get("reference_next_token_acc")
    if not ref_acc:
        return
    floor = params.min_accuracy_ratio * ref_acc
    positions = report.summary.get("per_shard_positions", {})
    too_few = []
    for name, acc in report.summary.get("per_shard_next_token_acc", {}).items():
        # Only where a shortfall is evidence: with mu = expected hits, P(hits < (1 - d) mu) <=
        # exp(-d^2 mu / 2) (Chernoff), under 1e-6 for d = 1 - min_accuracy_ratio once mu is large
        # enough. A target at chance level (random weights: ~1/vocab) never gets there.
        mu = ref_acc * positions.get(name, 0)
        d = 1 - params.min_accuracy_ratio
        if d <= 0 or mu * d * d / 2 < CHERNOFF_EXPONENT:
            too_few.append(name)
            continue
        if acc == acc and acc < floor:  # NaN-safe
            report.fail(
                "final_state",
                f"next-token accuracy of lm_head(norm(h_N)) is {acc:.3f}, the reference forward gets {ref_acc:.3f}: "
                "the final layer is not the target's pre-norm final state (norm applied? token shift? other model?)",
                shard=name,
                layer=report.summary.get("final_layer_id"),
            )
    if too_few:
        d = 1 - params.min_accuracy_ratio
        needed = f"{2 * CHERNOFF_EXPONENT / (d * d):.0f}" if d > 0 else "infinitely many"
        report.warn(
            "final_state",
            f"next-token accuracy not compared on {len(too_few)} shard(s): at the reference forward's accuracy "
            f"({ref_acc:.4f}) each expects fewer correct tokens than the {needed} a shortfall below "
            f"verify.min_accuracy_ratio {params.min_accuracy_ratio} needs to be evidence (near-random target?); "
            "the argmax agreement with the reference still checks the final state",
        )


# ---------------------------------------------------------------- reference agreement


def check_reference(report: Report, params: VerifyParams, meta: dict, layer_ids: list[int], refs: References, sample_to_shard: dict[int, Path]) -> None:
    num_layers = meta["num_layers"]
    report.summary["final_layer_id"] = layer_ids[-1]
    if layer_ids[-1] != num_layers:
        report.fail("reference", f"the last layer id is {layer_ids[-1]}, but EAGLE-3 needs the final state (id N={num_layers}) last")
    candidates = sorted(sample_to_shard)
    if not candidates:
        return
    chosen = reference_selection(params, sample_to_shard)
    reference, low_precision = refs.fp32, refs.low
    calibrate = low_precision is not None

    per_layer: dict[int, list[agreement.Closeness]] = defaultdict(list)
    pooled: dict[int, agreement.PooledError] = defaultdict(agreement.PooledError)
    pooled_cal: dict[int, agreement.PooledError] = defaultdict(agreement.PooledError)
    identity_sum = None
    shift_sum: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    agree = agree_n = ref_hits = ref_n = cal_agree = 0
    columns = [str(j) for j in range(num_layers + 1)] + [f"norm({num_layers})"]

    for sid in tqdm(chosen, desc="verify reference", unit="sample"):
        path = sample_to_shard[sid]
        with safe_open(str(path), framework="pt", device="cpu") as f:
            hs = f.get_tensor(f"{sid}/hidden_states").to(reference.device).float()
            ids = f.get_tensor(f"{sid}/input_ids")
            mask = f.get_tensor(f"{sid}/loss_mask")
        if hs.dim() != 3 or hs.shape[1] != len(layer_ids):
            continue  # already reported by the structure check
        ref = reference.states(ids).float()  # [N+1, T, H]
        ref_normed = reference.final_norm(ref[-1]).float()[None]
        candidates_all = torch.cat([ref, ref_normed])
        m = agreement.identity_matrix(hs.transpose(0, 1), candidates_all)
        identity_sum = m if identity_sum is None else identity_sum + m
        cal_states = low_precision.states(ids).float() if low_precision else None
        for i, lid in enumerate(layer_ids):
            if lid > num_layers:
                continue
            per_layer[lid].append(agreement.closeness(hs[:, i], ref[lid]))
            pooled[lid].add(hs[:, i], ref[lid])
            if cal_states is not None:
                pooled_cal[lid].add(cal_states[lid], ref[lid])
            for s, e in agreement.shift_errors(hs[:, i], ref[lid]).items():
                shift_sum[lid][s] += e
        positions = mask[:-1].bool().nonzero().squeeze(-1)
        if positions.numel():
            cap_pred = reference.final_logits(hs[positions, -1]).argmax(-1).cpu()
            ref_pred = reference.final_logits(ref[num_layers][positions]).argmax(-1).cpu()
            agree += int((cap_pred == ref_pred).sum())
            agree_n += int(positions.numel())
            if cal_states is not None:
                cal_pred = low_precision.final_logits(cal_states[num_layers][positions]).argmax(-1).cpu()
                cal_agree += int((cal_pred == ref_pred).sum())
            ref_hits += int((ref_pred == ids[positions + 1]).sum())
            ref_n += int(positions.numel())

    identity = identity_sum / len(chosen)
    report.identity = identity.tolist()
    report.identity_columns = columns
    for i, lid in enumerate(layer_ids):
        rows = per_layer.get(lid)
        if not rows:
            continue
        row = {
            "layer_id": lid,
            "max_abs_error": max(r.max_abs_error for r in rows),
            "ref_abs_max": max(r.ref_abs_max for r in rows),
            # over all reference tokens pooled (agreement.PooledError: robust to MoE routing flips)
            "rel_rms_error": pooled[lid].rel_rms,
            "rel_rms_error_worst_sample": max(r.rel_rms_error for r in rows),
            "token_rel_error_p50": pooled[lid].quantile(0.5),
            "token_rel_error_p99": pooled[lid].quantile(0.99),
            "token_rel_error_max": pooled[lid].quantile(1.0),
            "cosine_mean": sum(r.cosine_mean for r in rows) / len(rows),
            "cosine_min": min(r.cosine_min for r in rows),
            "closest_reference": columns[int(identity[i].argmin())],
            "shift_rel_error_-1": shift_sum[lid][-1] / len(rows),
            "shift_rel_error_0": shift_sum[lid][0] / len(rows),
            "shift_rel_error_+1": shift_sum[lid][1] / len(rows),
        }
        check_layer_tolerance(report, params, meta["dtype"], row, pooled_cal.get(lid))
        check_identity(report, lid, row["closest_reference"], num_layers)
        check_shift(report, lid, shift_sum[lid])
        report.layer_rows.append(row)

    argmax_agreement = agree / agree_n if agree_n else None
    required = params.min_argmax_agreement
    if calibrate and agree_n:
        # near-tied logits flip under bf16 rounding (often on random weights, and with MoE routing):
        # ask as much agreement as an independent reference in the same dtype reaches, with slack
        cal = cal_agree / agree_n
        required = min(required, 1 - params.argmax_disagreement_ratio * (1 - cal))
        report.summary["calibration_argmax_agreement"] = cal
    report.summary.update(
        reference_samples=chosen,
        reference_dtype="float32",
        argmax_agreement=argmax_agreement,
        required_argmax_agreement=required,
        reference_next_token_acc=ref_hits / ref_n if ref_n else None,
    )
    if argmax_agreement is not None and argmax_agreement < required:
        report.fail(
            "final_state",
            f"argmax of lm_head(norm(h_N)) agrees with the reference forward on {argmax_agreement:.3%} of masked positions "
            f"(needed {required:.1%}): missing/doubled final norm or a wrong last layer",
            layer=layer_ids[-1],
        )


def reference_selection(params: VerifyParams, sample_to_shard: dict[int, Path]) -> list[int]:
    """The seeded samples the reference forward re-runs."""
    candidates = sorted(sample_to_shard)
    return sorted(random.Random(params.seed).sample(candidates, min(params.reference_samples, len(candidates))))


def check_layer_tolerance(report: Report, params: VerifyParams, dtype: str, row: dict, calibration: agreement.PooledError | None) -> None:
    lid = row["layer_id"]
    if dtype == "float32":
        allowed = params.fp32_max_abs_error * max(1.0, row["ref_abs_max"])
        row["allowed"] = allowed
        if row["max_abs_error"] > allowed:
            report.fail(
                "reference",
                f"max |captured - reference| = {row['max_abs_error']:.3g} > {allowed:.3g} (fp32; cosine min {row['cosine_min']:.5f})",
                layer=lid,
            )
        return
    # low precision: as close to the fp32 reference as an independent reference in the same dtype,
    # both pooled over all reference tokens, so that the MoE routing flips bf16 rounding causes in
    # either forward count as much as they weigh (docs/FORMAT.md, "How verify judges closeness")
    cal = max(calibration.rel_rms if calibration else 0.0, BF16_REL_FLOOR)
    allowed = params.bf16_error_ratio * cal
    row["calibration_rel_rms_error"] = cal
    if calibration:
        row["calibration_token_rel_error_p50"] = calibration.quantile(0.5)
        row["calibration_token_rel_error_p99"] = calibration.quantile(0.99)
        row["calibration_token_rel_error_max"] = calibration.quantile(1.0)
    row["allowed"] = allowed
    if row["rel_rms_error"] > allowed:
        report.fail(
            "reference",
            f"relative error {row['rel_rms_error']:.3g} vs the fp32 reference (pooled over all reference tokens) is over "
            f"{params.bf16_error_ratio}x that of an independent {dtype} reference ({cal:.3g}); median token error "
            f"{row['token_rel_error_p50']:.3g} vs {row.get('calibration_token_rel_error_p50', float('nan')):.3g}; "
            f"cosine mean {row['cosine_mean']:.4f}",
            layer=lid,
        )


def check_identity(report: Report, lid: int, closest: str, num_layers: int) -> None:
    if closest == str(lid):
        return
    if closest == f"norm({num_layers})":
        hint = "the final norm was applied to the last layer (vLLM's id N is before the norm)"
    elif closest.isdigit() and int(closest) == lid + 1:
        hint = "off by +1: speculators 0.3.0's convention (id k = output of layer k) mixed with vLLM's?"
    elif closest.isdigit() and int(closest) == lid - 1:
        hint = "off by -1"
    else:
        hint = "layers swapped or mislabelled"
    report.fail("reference", f"declared layer {lid} is closest to reference state {closest}: {hint}", layer=lid)


def check_shift(report: Report, lid: int, shifts: dict[int, float]) -> None:
    best = min(shifts, key=shifts.get)
    if best != 0:
        report.fail(
            "reference",
            f"hidden states are closer to the reference at position t{best:+d} than at t "
            f"(errors {shifts[-1]:.3g} / {shifts[0]:.3g} / {shifts[1]:.3g}): tokens and states are misaligned",
            layer=lid,
        )


# ---------------------------------------------------------------- outputs


def write_outputs(report: Report, meta: dict) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    METRICS.mkdir(parents=True, exist_ok=True)
    failures = report.failures()
    checks = ("structure", "values", "reference", "final_state", "storage")
    status = {c: ("fail" if report.failures(c) else "pass") for c in checks}
    metrics = {
        "passed": not failures,
        "checks": status,
        "num_failures": len(failures),
        "num_warnings": sum(f.severity == "warn" for f in report.findings),
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
    ax.set_title("log10 relative error: must be darkest on the declared id")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(REPORT_DIR / "layer_identity.png", dpi=100)
    plt.close(fig)
    names.append("layer_identity.png")
    return names


def render_markdown(report: Report, metrics: dict, status: dict, plots: list[str]) -> str:
    s = report.summary
    verdict = "PASSED" if metrics["passed"] else "FAILED"
    sampled = s.get("final_state_positions") != s.get("masked_positions")
    positions_note = " (a seeded sample per shard: verify.final_state_positions_per_shard)" if sampled else ""
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
        f"| reference | a transformers forward on {len(s.get('reference_samples', []))} seeded samples agrees per layer; each layer is closest to the reference state of its declared id; states align with their tokens (no +-1 shift) | {status['reference']} |",
        f"| final_state | lm_head(norm(h_N)) predicts like the target: argmax agreement {fmt(s.get('argmax_agreement'))} with the reference; next-token accuracy {fmt(s.get('final_state_next_token_acc'))} on {s.get('final_state_positions')} of the {s.get('masked_positions')} masked positions{positions_note} (reference forward: {fmt(s.get('reference_next_token_acc'))}) | {status['final_state']} |",
        f"| storage | {s.get('bytes_per_token')} bytes/token against a minimum of {s.get('min_bytes_per_token')} ({s.get('total_bytes')} bytes total) | {status['storage']} |",
        "",
    ]
    failures = report.failures()
    if failures:
        out += ["## Failures", "", "| check | where | what |", "| --- | --- | --- |"]
        out += [f"| {f.check} | {f.where()} | {f.message} |" for f in failures[:200]]
        out.append("")
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
            f"| layer id | max abs error | rel. RMS error (pooled) | {bound} | cosine mean | cosine min | closest reference state | rel. error at t-1 / t / t+1 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in report.layer_rows:
            out.append(
                f"| {r['layer_id']} | {r['max_abs_error']:.3g} | {r['rel_rms_error']:.3g} | {r.get('allowed', float('nan')):.3g} | "
                f"{r['cosine_mean']:.6f} | {r['cosine_min']:.6f} | {r['closest_reference']} | "
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
        f"Reference forward: {s.get('reference')}, because {s.get('reference_choice')} ({BUDGET_PARAM}). "
        f"Reference models: {s.get('reference_load')} ({s.get('reference_load_seconds')} s{', while the shards were scanned' if s.get('reference') == 'whole model' else ', after the scan'}); "
        f"shard scan {s.get('scan_seconds')} s; reference forwards and comparisons {s.get('reference_check_seconds')} s."
    )
    return "\n".join(out) + "\n"


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
