"""verify's per-sample verdicts: every sample's coherence scores (pipeline/verification/samples/scores.py) judged against the run's.

Windows of sample_window positions are compared with all windows of the run (median and robust
sigma) and with the sample's own other windows, at a Bonferroni-bounded false-alarm rate for the
whole run; whole samples with the other samples; adjacent layers tried exchanged. A failure names
the shard, sample, layer and positions with the evidence (docs/ARCHITECTURE.md "Per-sample tests: what is
caught, what cannot be").
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import torch

from pipeline.verification.report import Report
from pipeline.verification.samples.calibration import (
    EARLY_MIN_ROWS,
    TAIL_MIN_SCORES,
    TAIL_QUANTILES,
    WHOLE_MIN_SAMPLES,
    WITHIN_Z_FACTOR,
    calibrated,
    robust,
    rounding_sigmas,
    tail_kind,
    tail_threshold,
    whole_sample_means,
    whole_sample_z,
)
from pipeline.verification.samples.scores import EXCHANGE_POSITIONS, Coherence, SampleScores, tests_per_position

WITHIN_MIN_WINDOWS = 4  # x the window: a sample this long has a median that a confined fault does not move
# an exchange fails only where swapping back explains this much better: two captured layers can be
# nearly alike (tiny DeepSeek-V3 bf16, layers 4 and 5: a clean sample 1.01x "better" exchanged)
EXCHANGE_MIN_GAIN = 1.5
# A token's first positions have little context yet: their whitened residual shares run higher (log +0.2..0.5
# at positions 1-15 on the tiny Llama; a clean 20-token sample failed the whole-sample test, z 7.8 > 6.5).
# The whitened tests judge them against the run's own positions of the same range (bucket edges below)
EARLY_POSITION_EDGES = (4, 8, 12, 16)
# The token-identity test's windows are this many of the other tests' windows long (64 positions at the defaults): its
# evidence per position is a rank (token_identity), at most ~4.3 normal units in a run of 60k judged positions, so the
# other tests' windows of 3-4 judged positions cannot clear the Bonferroni threshold with it; rows shifted over 48
# positions fill 12 of a long window's 16
IDENTITY_WINDOW_FACTOR = 3


def centre_early_positions(scores: list[SampleScores], columns: slice) -> list[SampleScores]:
    """The scores with the `columns` of positions before EARLY_POSITION_EDGES[-1] divided by how much higher the
    run's median is in their range than from there on (never multiplied up: only the clean excess goes)."""
    edges = np.array(EARLY_POSITION_EDGES)
    buckets = [torch.from_numpy(np.searchsorted(edges, s.positions, side="right")) for s in scores]
    every = torch.cat(buckets)
    logs = torch.cat([s.shares[:, columns] for s in scores]).double().clamp_min(1e-30).log()
    later = every == len(edges)
    if not later.any():
        return scores
    offsets = torch.zeros(len(edges) + 1, logs.shape[1], dtype=torch.float64)
    for k in range(len(edges)):
        rows = every == k
        if int(rows.sum()) >= EARLY_MIN_ROWS:
            offsets[k] = (logs[rows].median(0).values - logs[later].median(0).values).clamp_min(0)
    out = []
    for s, b in zip(scores, buckets, strict=True):
        shares = s.shares.clone()
        shares[:, columns] = (shares[:, columns].double() * (-offsets[b]).exp()).to(shares.dtype)
        out.append(SampleScores(s.sample, s.positions, shares, s.exchange, rounding=s.rounding))
    return out


def window_scores(shares: torch.Tensor, window: int) -> torch.Tensor:
    """[P, K] -> [max(P - window + 1, 1), K]: per run of `window` judged rows, the mean log residual
    share without the window's largest (a confined fault raises every row of a run; one clean token
    off, e.g. a rare MoE routing, raises one)."""
    w = min(window, shares.shape[0])
    logs = shares.double().clamp_min(1e-30).log().T.unfold(1, w, 1)  # [K, windows, w]
    if w >= 3:
        logs = logs.sort(-1).values[..., :-1]
    return logs.mean(-1).T


def ranked_normal(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample [P]: its values as normal scores of their rank among every value of the run, Phi^-1((rank + 1/2) / N)."""
    every = torch.cat([v.double() for v in values])
    ranks = torch.empty_like(every)
    ranks[every.argsort(stable=True)] = torch.arange(every.numel(), dtype=every.dtype)
    return list(torch.special.ndtri((ranks + 0.5) / every.numel()).split([v.numel() for v in values]))


def token_identity(scores: list[SampleScores], layers: int) -> list[torch.Tensor]:
    """Per sample [P]: does each judged position's state belong to this sample's tokens, from both ends of the captured
    stack: the token test's ratio (the first layer against E[id] and its neighbours') and the next-token test's contrast
    (the final layer through lm_head: pipeline/verification/samples/next_token.py), each as its normal score ranked over the run, summed
    and divided by sqrt(2). Ranked, because neither has a clean law that robust sigmas describe: the contrast is skewed
    and heavy-tailed (a user's new question after an answer: a trained target confidently predicts another
    continuation), and on the tiny DeepSeek-V3 the token ratio's clean tail lifted its threshold to 10.4 robust sigmas.
    Each position's score is then centred on the run's median at positions of its range [2^k, 2^(k+1)) (less context,
    less predictable: as `whole_sample_means` does)."""
    token = ranked_normal([s.shares[:, layers].double().clamp_min(1e-30).log() for s in scores])
    answered = [s.next_token.isfinite() for s in scores]
    contrast = ranked_normal([s.next_token[a] for s, a in zip(scores, answered, strict=True)])
    combined = []
    for t, c, a in zip(token, contrast, answered, strict=True):
        z = t.clone()
        z[a] = (t[a] + c) / math.sqrt(2)
        combined.append(z)
    ranges = [torch.from_numpy(np.floor(np.log2(np.maximum(s.positions, 1))).astype(np.int64)) for s in scores]
    every, where = torch.cat(combined), torch.cat(ranges)
    offsets = torch.zeros(int(where.max()) + 1, dtype=torch.float64)
    for r in where.unique().tolist():
        rows = where == r
        if int(rows.sum()) >= EARLY_MIN_ROWS:
            offsets[r] = every[rows].median() - every.median()
    return [z - offsets[r] for z, r in zip(combined, ranges, strict=True)]


def stouffer_windows(z: torch.Tensor, length: int) -> torch.Tensor:
    """[P] normal scores -> per run of `length` consecutive judged positions (the whole sample if shorter) the sum of
    their scores over the root of their number: N(0, 1) for independent clean positions whatever the run's length, so
    a short sample's one window and a long sample's many are one population."""
    m = min(length, z.numel())
    return z.unfold(0, m, 1).sum(-1) / math.sqrt(m)


def check_samples(report: Report, scores: list[tuple[str, SampleScores]], coherence: Coherence | None, params) -> None:
    """Judge every sample's windows against the run's (population test: whole-sample faults) and,
    in samples of at least WITHIN_MIN_WINDOWS windows, against the sample's own median (within test:
    local faults, sharper since samples differ from each other); one failure per faulty sample, naming
    the layer furthest off, the positions and the evidence; and each sample's exchange test."""
    if coherence is None or coherence.weights is None or not scores:
        return
    L = len(coherence.layer_ids)
    names = ([f"layer {lid} vs other positions" for lid in coherence.layer_ids] + [f"token (layer {coherence.layer_ids[0]} vs E[id])",
             "all layers vs other positions"] + [f"layer {lid}" for lid in coherence.layer_ids] + ["all layers"]
             + [f"layer {lid} whitened" for lid in coherence.layer_ids])
    window = max(1, params.sample_window // params.sample_stride)
    scores = [(shard, s) for shard, s in scores if s.shares.shape[0]]
    centred = centre_early_positions([s for _, s in scores], slice(2 * L + 3, None)) if scores else []
    per_sample = [(shard, s, window_scores(s.shares, window)) for (shard, _), s in zip(scores, centred, strict=True)]
    if not per_sample:
        return
    pooled = torch.cat([w for _, _, w in per_sample])
    median, sigma = robust(pooled)
    local = [w - w.median(0).values for _, _, w in per_sample if w.shape[0] >= WITHIN_MIN_WINDOWS * window]
    within_median, within_sigma = robust(torch.cat(local)) if local else (None, None)
    rounding = rounding_sigmas([s for _, s, _ in per_sample], window)  # fp8: the least sigma the rounding leaves
    if rounding is not None:
        sigma = torch.maximum(sigma, rounding[0])
        within_sigma = torch.maximum(within_sigma, rounding[0]) if local else None
    # whole-sample test: each sample's mean log score over all its judged positions (each centred on its range of
    # positions), against the other samples' of its fold
    folds = [coherence.fold(s.sample) for _, s, _ in per_sample]
    whole = whole_sample_means([s for _, s, _ in per_sample], folds)
    whole_z = whole_sample_z(whole, folds, rounding[1] if rounding is not None else None)
    tests = pooled.numel() + sum(w.numel() for w in local) + (whole.numel() if whole_z is not None else 0)
    identity = None
    if all(s.next_token is not None for _, s in scores):  # the token-identity test, where the scan read the final head
        identity = token_identity([s for _, s in scores], L)
        identity_windows = [stouffer_windows(z, window * IDENTITY_WINDOW_FACTOR) for z in identity]
        tests += sum(w.numel() for w in identity_windows) + (len(identity) if whole_z is not None else 0)
    report_not_run(report, len(per_sample), identity is not None, bool(local), window, params.sample_stride)
    z_star = -NormalDist().inv_cdf(params.sample_false_alarm / tests)
    within_z = torch.cat([(w - within_median) / within_sigma for w in local]) if local else None
    if within_z is not None and within_z.shape[0] >= TAIL_MIN_SCORES:
        within_threshold, within_rule = tail_threshold(within_z, tests, params.sample_false_alarm).clamp_min(z_star), "tail"
    else:
        within_threshold, within_rule = torch.full((tests_per_position(L),), WITHIN_Z_FACTOR * z_star, dtype=torch.float64), "factor"
    within_factor = within_threshold / z_star  # per test
    window_sample = torch.cat([torch.full((w.shape[0],), i) for i, (_, _, w) in enumerate(per_sample)])
    pop_threshold, pop_rule = calibrated((pooled - median) / sigma, window_sample, tests, params.sample_false_alarm, z_star)
    pop_factor = pop_threshold / z_star
    whole_threshold, whole_rule = (calibrated(whole_z, torch.arange(len(per_sample)), tests, params.sample_false_alarm, z_star)
                                   if whole_z is not None else (None, None))
    whole_factor = whole_threshold / z_star if whole_threshold is not None else None
    pop_share = median.exp()
    summary = report.summary["sample_tests"] = {
        "tests": names,
        "windows": int(pooled.shape[0]),
        "window_positions": params.sample_window,
        "stride": params.sample_stride,
        "false_alarm_bound": params.sample_false_alarm,
        "z_threshold": round(z_star, 3),
        "population_z_threshold": [round(float(v), 3) for v in pop_threshold],
        "population_threshold_rule": pop_rule,  # "tail": fitted to the run's window scores; "normal": z*
        "whole_sample_z_threshold": [round(float(v), 3) for v in whole_threshold] if whole_threshold is not None else None,
        "whole_sample_threshold_rule": whole_rule,
        "population_median_share": [float(v) for v in pop_share],
        "robust_sigma_log": [float(v) for v in sigma],
        # fp8: the least sigma of each test, the rounding's own in a window's score (robust_sigma_log is never below it)
        "rounding_sigma_log": [float(v) for v in rounding[0]] if rounding is not None else None,
        "within_robust_sigma_log": [float(v) for v in within_sigma] if local else None,
        "within_z_threshold": [round(float(v), 3) for v in within_threshold],
        "within_threshold_rule": within_rule,  # "tail": fitted to the run's within scores; "factor": WITHIN_Z_FACTOR z*
        "within_z_quantiles": ({str(q): [round(float(v), 3) for v in row] for q, row in zip(
            (*TAIL_QUANTILES, 0.999), np.quantile(within_z.numpy(), [*TAIL_QUANTILES, 0.999], axis=0),
            strict=True)} if within_z is not None else None),
        "fit_tokens": coherence.fit_tokens,
        "fit_excluded_samples": coherence.refit_excluded,
        "judged_positions": int(sum(s.positions.size for _, s in scores)),
        "exchange_positions": EXCHANGE_POSITIONS,
    }
    max_z = torch.full((tests_per_position(L),), -math.inf, dtype=torch.float64)
    max_within = max_z.clone()
    exchange_gain = -math.inf
    max_whole = max_z.clone()
    for k, (shard, s, w) in enumerate(per_sample):
        z = (w - median) / sigma
        max_z = torch.maximum(max_z, z.max(0).values)
        z = z / pop_factor  # in units of the threshold z*, as every test's here
        kind = tail_kind("the run's windows", pop_rule, pop_factor, pop_threshold, z)
        if whole_z is not None:
            zs = whole_z[k]
            max_whole = torch.maximum(max_whole, zs)
            zs = zs / whole_factor
            if zs.max() > z.max():  # the whole sample, as one window
                z, w = zs.expand_as(z).clone(), whole[k].expand_as(w).clone()
                kind = tail_kind("the other samples (the whole sample's mean)", whole_rule, whole_factor, whole_threshold, z)
        if local and w.shape[0] >= WITHIN_MIN_WINDOWS * window:
            zw = (w - w.median(0).values - within_median) / within_sigma
            max_within = torch.maximum(max_within, zw.max(0).values)  # in robust sigmas (fails above within_threshold)
            zw = zw / within_factor  # in units of the threshold z*, as the population test's
            if zw.max() > z.max():
                k_worst = int(zw.max(0).values.argmax())
                z, kind = zw, (f"this sample's other windows, divided by {float(within_factor[k_worst]):.2f} for the "
                               f"tail of the run's within-sample scores of this test (fails at "
                               f"{float(within_threshold[k_worst]):.1f})")
        if s.exchange is not None and s.exchange.numel():
            exchange_gain = max(exchange_gain, float(s.exchange.max()))
            fail_exchange(report, shard, s, coherence.layer_ids)
        bad = z > z_star
        if bad.any():
            fail_windows(report, shard, s, w, z, bad, kind, names, coherence.layer_ids, median, window, z_star, params,
                         coherence.leak)
    if identity is not None:
        summary["token_identity"] = check_token_identity(report, [(shard, s) for shard, s, _ in per_sample], identity,
                                                         identity_windows, folds, tests, z_star, coherence.layer_ids,
                                                         window * IDENTITY_WINDOW_FACTOR, params)
    summary["max_z"] = [float(v) for v in max_z]
    summary["max_within_z"] = [float(v) for v in max_within] if local else None
    summary["max_whole_sample_z"] = [float(v) for v in max_whole] if whole_z is not None else None
    summary["exchange_max_gain_log"] = exchange_gain


def report_not_run(report: Report, samples: int, identity: bool, within: bool, window: int, stride: int) -> None:
    """The tests this run cannot judge by, said in the report (`Report.skip`): the whole-sample tests below
    WHOLE_MIN_SAMPLES samples, the within-sample test where no sample is long enough to have a median of its own."""
    if samples < WHOLE_MIN_SAMPLES:
        report.skip("samples", "the whole-sample tests (each sample's mean over all its positions against the other "
                    f"samples'{': coherence and token identity' if identity else ''})",
                    "each sample is one score, and the threshold is fitted to the tail of the samples' scores; judged at "
                    "the normal z* with the median and robust sigma of so few samples, clean runs failed. Whole-sample "
                    "faults are judged by the window tests", samples, WHOLE_MIN_SAMPLES, "samples")
    if not within:
        judged = WITHIN_MIN_WINDOWS * window + window - 1  # judged positions that make WITHIN_MIN_WINDOWS x window windows
        report.skip("samples", "the within-sample test (a sample's windows against its own median)",
                    f"no sample has the {WITHIN_MIN_WINDOWS * window} windows ({judged} judged positions, every "
                    f"{stride}th) a median of its own needs", 0, 1, f"samples of at least {judged * stride} tokens")


def check_token_identity(report: Report, scores: list[tuple[str, SampleScores]], identity: list[torch.Tensor],
                         windows: list[torch.Tensor], folds: list[int], tests: int, z_star: float, layer_ids: list[int],
                         length: int, params) -> dict:
    """Judge every sample's token-identity windows (Stouffer sums over `length` judged positions) against the run's,
    and each whole sample's sum against the other samples' of its fold, each at a threshold calibrated on the run's
    own scores as the other tests' (`calibrated`); a failing sample is named with the first captured layer (every
    captured layer is off where states are shifted or another request's). Returns the summary for the metrics."""
    pooled = torch.cat(windows)
    median, sigma = robust(pooled[:, None])
    sample_of = torch.cat([torch.full((w.numel(),), i) for i, w in enumerate(windows)])
    threshold, rule = calibrated((pooled[:, None] - median) / sigma, sample_of, tests, params.sample_false_alarm, z_star)
    whole = torch.stack([stouffer_windows(z, z.numel())[0] for z in identity])[:, None]
    whole_z = whole_sample_z(whole, folds)
    whole_threshold = (calibrated(whole_z, torch.arange(len(identity)), tests, params.sample_false_alarm, z_star)[0]
                       if whole_z is not None else None)
    max_window = max_whole = -math.inf
    for i, (shard, s) in enumerate(scores):
        z = (windows[i] - median[0]) / sigma[0]
        max_window = max(max_window, float(z.max()))
        over = float(z.max()) / float(threshold[0])
        evidence = (f"over {min(length, s.positions.size)} judged positions: Stouffer sum {float(windows[i].max()):.2f} "
                    f"against the run's median {float(median[0]):.2f}; z = {float(z.max()):.1f} robust sigmas > "
                    f"{float(threshold[0]):.1f}")
        at = int(z.argmax())
        first, last = int(s.positions[at]), int(s.positions[min(at + length - 1, s.positions.size - 1)])
        if whole_z is not None:
            max_whole = max(max_whole, float(whole_z[i, 0]))
            if float(whole_z[i, 0]) / float(whole_threshold[0]) > over:
                over = float(whole_z[i, 0]) / float(whole_threshold[0])
                evidence = (f"over the whole sample ({s.positions.size} judged positions): Stouffer sum "
                            f"{float(whole[i, 0]):.2f}; z = {float(whole_z[i, 0]):.1f} robust sigmas from the other "
                            f"samples' > {float(whole_threshold[0]):.1f}")
                first, last = int(s.positions[0]), int(s.positions[-1])
        if over > 1.0:
            report.fail(
                "samples",
                f"positions {first}..{last} (every {params.sample_stride}th judged): the captured states do not belong to "
                f"this sample's tokens (shifted rows, or another request's): layer {layer_ids[0]} does not match the "
                f"tokens' embeddings and layer {layer_ids[-1]} does not predict the next tokens through the target's "
                f"lm_head. Evidence (token-identity test: the token test's ratio and the next-token contrast as normal "
                f"scores of their ranks in the run, summed) {evidence} (false-alarm bound {params.sample_false_alarm:g} "
                f"for the run)",
                shard=shard, sample=s.sample, layer=layer_ids[0], positions=[first, last],
            )
    return {"window_positions": length * params.sample_stride, "max_window_z": max_window,
            "window_z_threshold": round(float(threshold[0]), 3), "window_threshold_rule": rule,
            "max_whole_sample_z": max_whole if whole_z is not None else None,
            "whole_sample_z_threshold": round(float(whole_threshold[0]), 3) if whole_z is not None else None}


def fail_exchange(report: Report, shard: str, s: SampleScores, layer_ids: list[int]) -> None:
    i = int(s.exchange.argmax())
    if float(s.exchange[i]) <= math.log(EXCHANGE_MIN_GAIN):
        return
    a, b = layer_ids[i], layer_ids[i + 1]
    report.fail(
        "samples",
        f"layers {a} and {b} are exchanged: with the two swapped back the captured layers explain each other "
        f"{math.exp(float(s.exchange[i])):.2f}x better (residual share, geometric mean over the first "
        f"{min(s.positions.size, EXCHANGE_POSITIONS)} judged positions; fails above {EXCHANGE_MIN_GAIN}x)",
        shard=shard, sample=s.sample, layer=a,
    )


def fail_windows(report, shard, s, w, z, bad, kind, names, layer_ids, median, window, z_star, params, leak=None) -> None:
    L = len(layer_ids)
    worst = int(z.max(0).values.argmax())
    rows = bad.any(1).nonzero().squeeze(-1)
    n = s.positions.size
    first = int(s.positions[int(rows[0])])
    last = int(s.positions[min(int(rows[-1]) + window - 1, n - 1)])
    peak = int(z[:, worst].argmax())
    # the layer named: the layer test furthest off where the worst test peaks (the token test: the first layer)
    if worst == L:  # the token test: the first layer
        named = 0
    elif L + 2 <= worst < 2 * L + 2:  # a raw share
        # of the layers whose raw share is over the threshold there, the one with the largest share: a faulty layer's
        # own prediction comes from clean inputs, so its residual carries the whole fault, while another layer's
        # carries it only through its map's weight on the faulty one (another request's layer 4 on the tiny
        # DeepSeek-V3 flagged layer 5's test furthest in z, with a smaller share)
        raw = slice(L + 2, 2 * L + 2)
        over = bad[peak, raw]
        named = int(torch.where(over, w[peak, raw], torch.full_like(w[peak, raw], -math.inf)).argmax()) if over.any() \
            else worst - L - 2
    elif worst >= 2 * L + 3:
        # a whitened share: noise on one layer also lands in its neighbours' whitened residuals (it is an input of
        # their predictions, and there it can weigh more: noise on layer 4 of the tiny Llama flagged layer 5 first).
        # The layer named is the one whose leak pattern (Coherence.leak: what noise on it adds to each layer's
        # test) best matches the window's rise of the whitened shares above the run's median
        white = slice(2 * L + 3, 3 * L + 3)
        rise = (w[peak, white].exp() - median[white].exp()).clamp_min(0).float()
        named = int(((leak @ rise) / leak.norm(dim=1).clamp_min(1e-30)).argmax()) if leak is not None else worst - 2 * L - 3
    else:  # a contrast ratio, or an all-layers test: the layer whose contrast is furthest off there
        named = worst if worst < L else int(z[peak, :L].argmax())
    value = math.exp(float(w[peak, worst]))
    others = [names[k] for k in range(len(names)) if k != worst and bad[:, k].any()]
    if worst == L:
        what = "the captured states do not belong to this sample's tokens (shifted rows, or another request's)"
    elif worst >= 2 * L + 3:
        what = (f"layer {layer_ids[named]}'s state is off the other captured layers' prediction in directions where clean "
                "states' residuals rarely go (noise or wrong values on these rows)")
    else:
        what = (f"layer {layer_ids[named]}'s state is not explained by the other captured layers and the token's "
                "embedding (zeroed, from another request or layer, shifted, or noisy rows)")
    report.fail(
        "samples",
        f"positions {first}..{last} (every {params.sample_stride}th judged): {what}. Evidence ({names[worst]} test): "
        f"residual share {value:.3g} of the state's energy over {min(window, n)} judged positions, against the run's "
        f"median {float(median[worst].exp()):.3g}; z = {float(z[peak, worst]):.1f} robust sigmas from {kind} > {z_star:.1f} "
        f"(false-alarm bound {params.sample_false_alarm:g} for the run)" + (f"; also off: {', '.join(others)}" if others else ""),
        shard=shard, sample=s.sample, layer=layer_ids[named], positions=[first, last],
    )
