"""verify's per-shard checks, merged over the shard scan (pipeline/verification/scan.py): structure,
recorded values, outlier shards, storage, and each shard's next-token accuracy of its final states."""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import torch

from pipeline.hidden_states import fp8
from pipeline.hidden_states.storage import state_bytes_per_token
from pipeline.layout import HIDDEN_STATES_DIR
from pipeline.params import VerifyParams
from pipeline.verification.reference.model import DTYPES
from pipeline.verification.report import Report
from pipeline.verification.samples.fit import fit_coherence
from pipeline.verification.samples.judge import check_samples
from pipeline.verification.scan import PreparedTokens, ScanContext, scan_shards, scan_threads, staging_for

OUTLIER_FACTOR = 3.0  # a shard's per-layer RMS this far from the median of all shards is flagged
STORAGE_OVERHEAD_WARN = 1.5
CHERNOFF_EXPONENT = 14.0  # exp(-14) ~ 1e-6: the false-alarm bound of the per-shard accuracy check


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


def check_structure_and_values(
    report: Report, params: VerifyParams, meta: dict, prepared, head_model, hidden_size: int, workers: int, embedding=None
) -> dict[int, Path]:
    layer_ids = meta["layer_ids"]
    stored_fp8 = meta["dtype"] == fp8.STORAGE_DTYPE
    dtype = torch.float32 if stored_fp8 else DTYPES[meta["dtype"]]  # what the scan reads: fp8 dequantized
    files = sorted(HIDDEN_STATES_DIR.glob("shard-*.safetensors"))
    orphans = [p for p in HIDDEN_STATES_DIR.glob("shard-*.json") if not p.with_suffix(".safetensors").is_file()]
    for p in orphans:
        report.fail("structure", "manifest without its shard file", shard=p.stem)
    if not files:
        report.fail("structure", f"no shards in {HIDDEN_STATES_DIR}")
    audit = audit_selection([p.stem for p in files], params)
    context = ScanContext(
        layer_ids, hidden_size, dtype, PreparedTokens(prepared), head_model, stored_dtype=fp8.TORCH_DTYPE if stored_fp8 else None,
        audit=audit, hash_all=params.hash_all_shards,
        final_state_positions=params.final_state_positions_per_shard, seed=params.seed,
    )
    t0 = time.perf_counter()
    if embedding is not None and files:
        context.coherence = fit_coherence(files, layer_ids, hidden_size, embedding, prepared, params, stored_fp8)
        report.summary["coherence_fit_seconds"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    # the scan threads' page-locked buffers, sized by the run's shape, not its data: a fixed cost, reported apart
    context.staging = staging_for(context, scan_threads(workers, len(files)))
    report.summary["staging_seconds"] = round(time.perf_counter() - t0, 3)
    report.summary["staging_bytes"] = context.staging.nbytes
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
    check_samples(report, [(scan.name, s) for scan in scans for s in scan.sample_scores], context.coherence, params)

    min_bytes = state_bytes_per_token(len(layer_ids), hidden_size, meta["dtype"]) + 8 + 1  # states (+ fp8 scales) + id + mask
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
