"""verify: prove the extracted hidden states are right, not just present.

Checks (docs/ARCHITECTURE.md lists what each catches):
  structure   every shard: size against its manifest, safetensors header (exact key set, dtype,
              [T, L, H] shape), token ids and loss mask equal prepare's, sample ids complete
              and unique; audited shards (seeded sample): sha256, recorded statistics vs bytes
  values      from the statistics the extractor recorded per sample and layer: finite, no
              all-zero or constant layer, per-layer stats per shard, outlier shards
  samples     every sample on its own (pipeline/verification/samples/scores.py): every sample_stride-th position
              of every sample, all captured layers, scored for coherence with the other layers and
              the token's embedding; runs of sample_window positions tested against the run's and
              the sample's own windows at a Bonferroni-bounded false-alarm rate; layers exchanged
  reference   a seeded subset re-run through transformers: per-layer error and cosine, a
              projection ratio (a systematic scale of a layer), a layer-identity matrix that must
              peak at the declared id, a +-1 token shift test
  final_state on a seeded sample of masked positions per shard (final_state_positions_per_shard, of
              those the per-sample tests judge; null: every one): argmax(lm_head(norm(h_N))) against
              the next token, and against the reference forward's argmax on the reference subset
  storage     bytes per token against the minimum L x H x dtype size
A failed check exits non-zero naming shard, sample, layer and check; no verdict is written.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.atomic import atomic_write_text
from pipeline.console import say
from pipeline.errors import PipelineError
from pipeline.hidden_states.format import engine_dtype, read_meta
from pipeline.layout import HIDDEN_STATES_DIR, METRICS, PREPARED_DATASET, VERIFY_VERDICT
from pipeline.params import VerifyParams
from pipeline.target import load_target
from pipeline.verification.reference.check import (  # noqa: F401
    BF16_REL_FLOOR,
    check_layer_tolerance,
    check_reference,
    reference_selection,
)
from pipeline.verification.reference.confirm import confirm_flagged, flagged_samples
from pipeline.verification.reference.model import FinalHeadModel, load_final_head, load_references
from pipeline.verification.reference.streamed import choose_reference, shard_sequences, stream_references
from pipeline.verification.report import CHECKS, REPORT_DIR, Report, not_run_line, write_outputs
from pipeline.verification.samples.fit import load_embedding
from pipeline.verification.scan import default_workers
from pipeline.verification.shards import audit_selection, check_final_state_rates, check_structure_and_values  # noqa: F401

PER_CHECK = 10  # failures of each check in the error message (all of them: reports/verify/report.md)

# The checks live in the modules above (one per check); the names are looked up here at run time,
# so bench/gpu_extract_bench.py can time each by wrapping it in this module.


class VerifyFailed(PipelineError):
    pass


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
    # whole model or streamed (pipeline/verification/reference/streamed.py); a budget too small fails here, before loading
    # the references are computed in the engine's dtype (fp8 storage: bf16; pipeline/hidden_states/format.py)
    computed = engine_dtype(meta["dtype"])
    choice = choose_reference(target.path, computed, params.reference_memory_gib,
                              max(prepared["seq_len"], default=1), target.trust_remote_code)
    # The final-state pass needs only the final norm and lm_head: loaded alone first (this also
    # starts the GPU and imports the model's code, before the scan's threads compete for the GIL),
    # they let the scan run while the full references load in the background.
    head = load_final_head(target.path, target.trust_remote_code)
    t0 = time.perf_counter()
    try:
        embedding = load_embedding(target.path, target.trust_remote_code)  # the per-sample tests' E[id]
    except FileNotFoundError as e:
        embedding = None
        report.warn("samples", f"per-sample tests not run: {e}")
    report.summary["embedding_load_seconds"] = round(time.perf_counter() - t0, 3)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-reference") as loader:
        references = None if choice.streamed else loader.submit(load_references, target.path, computed, target.trust_remote_code)
        alone = isinstance(head, FinalHeadModel)
        if choice.streamed and not alone:
            raise VerifyFailed(f"{target.path}: the streamed reference needs the final norm and lm_head read alone: {head}")
        report.summary["final_state_head_source"] = (
            f"final norm + lm_head loaded alone ({head.seconds:.2f} s)" if alone else f"the full fp32 reference's ({head})"
        )

        def head_model():
            return head if alone else references.result().fp32

        sample_to_shard = check_structure_and_values(report, params, meta, prepared, head_model, target.hidden_size, workers, embedding)
        refs = references.result() if references else stream_references(
            target.path, computed, shard_sequences(reference_selection(sorted(sample_to_shard), params), sample_to_shard),
            choice, head, target.trust_remote_code)
    report.summary.update(reference="streamed" if choice.streamed else "whole model", reference_choice=choice.why)
    report.summary.update(reference_load=refs.how, reference_load_seconds=round(refs.seconds, 3))
    t0 = time.perf_counter()
    check_reference(report, params, meta, layer_ids, refs, sample_to_shard)
    report.summary["reference_check_seconds"] = round(time.perf_counter() - t0, 3)
    flagged = flagged_samples(report)
    if flagged:  # before they are called corrupt: the flagged samples' own reference forward
        t0 = time.perf_counter()
        if choice.streamed:
            refs = stream_references(target.path, computed, shard_sequences(sorted(flagged), sample_to_shard), choice, head,
                                     target.trust_remote_code)
        confirm_flagged(report, params, meta, layer_ids, refs, sample_to_shard, flagged)
        report.summary["flagged_samples_seconds"] = round(time.perf_counter() - t0, 3)
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
        for check in CHECKS:  # at most PER_CHECK of each: a fault in every sample must not hide the other checks'
            of_check = report.failures(check)
            lines += [f"  [{f.check}] {f.where()}: {f.message}" for f in of_check[:PER_CHECK]]
            if len(of_check) > PER_CHECK:
                lines.append(f"  ... and {len(of_check) - PER_CHECK} more [{check}] failures")
        raise VerifyFailed("\n".join(lines))
    verdict = {"passed": True, "verdict": report.verdict(), "tests_not_run": report.not_run, "run_key": meta.get("run_key"),
               "layer_ids": layer_ids, "num_samples": len(prepared)}
    atomic_write_text(VERIFY_VERDICT, json.dumps(verdict, indent=1, sort_keys=True) + "\n")
    s = report.summary
    judged = (s.get("sample_tests") or {}).get("judged_positions")
    say(f"[verify] read {s.get('num_samples')} samples, {s.get('num_tokens', 0):,} tokens of layers {layer_ids} in "
        f"{s.get('num_shards')} shards; every sample's states judged"
        + (f" ({judged:,} positions in all layers by the per-sample tests)" if judged else "")
        + f", {len(s.get('reference_samples', []))} re-run by a transformers reference, "
        f"{len(s.get('audited_shards', []))} shards hashed and re-derived in full")
    say("[verify] " + ", ".join(f"{check} pass" for check in CHECKS)
        + f": all checks passed on {len(prepared)} samples ({s['verify_seconds']:.1f} s); report: {REPORT_DIR / 'report.md'}")
    for f in report.cleared():
        say(f"[verify] flagged, then cleared: {f.where()}: {f.message}")
    if report.not_run:
        say(f"[verify] {report.verdict()}:" + "".join(f"\n[verify]   {not_run_line(e)}" for e in report.not_run))

