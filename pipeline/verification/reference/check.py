"""verify's reference check: seeded samples re-run through a transformers forward, compared per
layer (error, cosine), for layer identity (closest reference state) and token alignment (+-1 shift),
and the final state's argmax against the reference forward's."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.hidden_states import format as shard_format
from pipeline.hidden_states import fp8
from pipeline.hidden_states.storage import engine_dtype
from pipeline.params import VerifyParams
from pipeline.progress import progress
from pipeline.verification.reference import agreement
from pipeline.verification.reference.model import References
from pipeline.verification.report import Report

BF16_REL_FLOOR = 2.0**-8  # bf16 rounding alone gives about this relative error
# |projection ratio - 1| allowed per layer (agreement.PooledError.scale_ratio). Clean runs of the embedded Llama and
# DeepSeek-V3 shapes stay within 0.067% in bf16 and 0.216% stored fp8 (docs/ARCHITECTURE.md, "Verify: the checks and
# their tolerances"); a few-percent scale of a layer hides in the per-element bf16/fp8 tolerance but not here
SCALE_BOUND = 0.01


def reference_selection(sample_ids: list[int], params: VerifyParams) -> list[int]:
    """The seeded samples re-run through the reference forward."""
    return sorted(random.Random(params.seed).sample(sorted(sample_ids), min(params.reference_samples, len(sample_ids))))


def check_reference(report: Report, params: VerifyParams, meta: dict, layer_ids: list[int], refs: References, sample_to_shard: dict[int, Path]) -> None:
    num_layers = meta["num_layers"]
    report.summary["final_layer_id"] = layer_ids[-1]
    if layer_ids[-1] != num_layers:
        report.fail("reference", f"the last layer id is {layer_ids[-1]}, but EAGLE-3 needs the final state (id N={num_layers}) last")
    candidates = sorted(sample_to_shard)
    if not candidates:
        return
    chosen = reference_selection(candidates, params)
    reference, low_precision = refs.fp32, refs.low
    calibrate = low_precision is not None
    stored_fp8 = meta["dtype"] == fp8.STORAGE_DTYPE
    # fp8: per layer, the sum over the reference tokens of the squared per-element quantization bound (fp8.error_bound)
    quant_sq: dict[int, float] = defaultdict(float)

    per_layer: dict[int, list[agreement.Closeness]] = defaultdict(list)
    pooled: dict[int, agreement.PooledError] = defaultdict(agreement.PooledError)
    pooled_cal: dict[int, agreement.PooledError] = defaultdict(agreement.PooledError)
    identity_sum = None
    shift_sum: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    agree = agree_n = ref_hits = ref_n = cal_agree = 0
    columns = [str(j) for j in range(num_layers + 1)] + [f"norm({num_layers})"]

    for sid in progress(chosen, desc="verify reference", unit="sample"):
        path = sample_to_shard[sid]
        sample = shard_format.load_sample(path, sid)  # fp8: dequantized, with its scales
        hs, ids, mask = sample.hidden_states.to(reference.device).float(), sample.input_ids, sample.loss_mask
        if hs.dim() != 3 or hs.shape[1] != len(layer_ids):
            continue  # already reported by the structure check
        if sample.scale is not None:
            bound = fp8.error_bound(hs, sample.scale.to(hs.device))
            for i, lid in enumerate(layer_ids):
                quant_sq[lid] += float(bound[:, i].double().pow(2).sum())
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
                cal_final = cal_states[num_layers][positions]
                if stored_fp8:  # its final state stored as the capture's is: quantized, so flips by rounding count alike
                    cal_final = fp8.dequantize(*fp8.quantize(cal_final))
                cal_pred = low_precision.final_logits(cal_final).argmax(-1).cpu()
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
        if stored_fp8:
            row["quantization_bound"] = (quant_sq[lid] / max(pooled[lid].ref_sq, 1e-24)) ** 0.5
        check_layer_tolerance(report, params, meta["dtype"], row, pooled_cal.get(lid))
        check_layer_scale(report, params, row, pooled[lid], pooled_cal.get(lid))
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


def allowed_error(params: VerifyParams, dtype: str, ref_abs_max: float, calibration: float,
                  quantization_bound: float | None = None) -> float:
    """What a captured layer may be off the fp32 reference: fp32, a max abs error of `fp32_max_abs_error` (relative to
    the reference's largest value); low precision, a relative error of `bf16_error_ratio` x the independent
    low-precision reference's (`calibration`, never below bf16's rounding), plus fp8's quantization bound."""
    if dtype == "float32":
        return params.fp32_max_abs_error * max(1.0, ref_abs_max)
    return params.bf16_error_ratio * max(calibration, BF16_REL_FLOOR) + (quantization_bound or 0.0)


def check_layer_tolerance(report: Report, params: VerifyParams, dtype: str, row: dict, calibration: agreement.PooledError | None) -> None:
    lid = row["layer_id"]
    if dtype == "float32":
        allowed = allowed_error(params, dtype, row["ref_abs_max"], 0.0)
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
    # either forward count as much as they weigh (docs/ARCHITECTURE.md, "Verify: the checks and their tolerances")
    cal = max(calibration.rel_rms if calibration else 0.0, BF16_REL_FLOOR)
    # fp8 storage: ||Q(x) - r|| <= ||Q(x) - x|| + ||x - r||, the first at most the per-element bound of the stored
    # values (pipeline/hidden_states/fp8.py), the second judged as a bf16 capture's is (the engine's output x is
    # bf16); the calibration is the independent bf16 reference's error (unquantized)
    allowed = allowed_error(params, dtype, 0.0, cal, row.get("quantization_bound"))
    row["calibration_rel_rms_error"] = cal
    if calibration:
        row["calibration_token_rel_error_p50"] = calibration.quantile(0.5)
        row["calibration_token_rel_error_p99"] = calibration.quantile(0.99)
        row["calibration_token_rel_error_max"] = calibration.quantile(1.0)
    row["allowed"] = allowed
    if row["rel_rms_error"] > allowed:
        quantized = (f" plus the fp8 quantization's bound {row['quantization_bound']:.3g}" if "quantization_bound" in row else "")
        report.fail(
            "reference",
            f"relative error {row['rel_rms_error']:.3g} vs the fp32 reference (pooled over all reference tokens) is over "
            f"{params.bf16_error_ratio}x that of an independent {engine_dtype(dtype)} reference ({cal:.3g}){quantized}; median token error "
            f"{row['token_rel_error_p50']:.3g} vs {row.get('calibration_token_rel_error_p50', float('nan')):.3g}; "
            f"cosine mean {row['cosine_mean']:.4f}",
            layer=lid,
        )


def check_layer_scale(report: Report, params: VerifyParams, row: dict, pooled: agreement.PooledError,
                      calibration: agreement.PooledError | None) -> None:
    """A systematic scale of the whole layer: the projection ratio of the captured states on the reference, pooled
    over every reference token, within SCALE_BOUND of 1, or within bf16_error_ratio times the independent
    low-precision reference's own departure where that is larger (its rounding is the engine's)."""
    ratio = pooled.scale_ratio
    bound = SCALE_BOUND
    if calibration is not None:
        row["calibration_scale_ratio"] = calibration.scale_ratio
        bound = max(bound, params.bf16_error_ratio * abs(calibration.scale_ratio - 1))
    row["scale_ratio"], row["scale_bound"] = ratio, bound
    if abs(ratio - 1) > bound:
        report.fail(
            "reference",
            f"projection ratio sum<captured, reference>/sum|reference|^2 = {ratio:.4f} over all reference tokens, "
            f"off 1 by {abs(ratio - 1):.2%} > the bound {bound:.2%}: the layer is systematically scaled by {ratio:.4f} "
            f"(a misapplied scale factor or norm weight)",
            layer=row["layer_id"],
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
