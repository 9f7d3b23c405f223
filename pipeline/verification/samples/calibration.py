"""How far off the run's own scores a per-sample test's score must be to fail: robust location and scale, each
sample's whole-sample score against its fold's, and thresholds fitted to the tail of the run's scores at a
Bonferroni-bounded false-alarm rate (used by pipeline/verification/samples/judge.py)."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import torch

from pipeline.verification.samples.scores import FOLD_MIN_SAMPLES, SampleScores

EARLY_MIN_ROWS = 8  # a range of positions with fewer judged rows in the run (or the fold) is left as it is

# Clean scores have heavier tails than the MAD's normal law: within-sample maxima 7.7-9.4 robust sigmas on the
# tiny Llama where z* was 6.4, 17.1 on its INT4 extraction; against the run's windows 7.0 > z* = 6.88 on the
# 540 samples of `make repro` (a clean sample: its states equal a transformers forward to 1e-6). Per test and
# per kind (run's windows, within-sample, whole samples), the threshold is the normal quantile with the location
# and scale of the run's own scores at these quantiles (a confined fault's few windows barely move them), never
# below z*. An exponential tail through them would miss noise of relative RMS 1
TAIL_QUANTILES = (0.8, 0.99)
# Fewer scores than this: too few for the fit. 300 is the smallest number of scores whose maximum is a 95 % upper
# confidence bound of their 99th percentile (0.99^299 < 0.05): below it the data do not bound the quantile the tail is
# extrapolated from. The windows' tests then judge at z* (within-sample: WITHIN_Z_FACTOR x z*); the whole-sample tests,
# whose scores are samples, are not run (WHOLE_MIN_SAMPLES)
TAIL_MIN_SCORES = 300
WITHIN_Z_FACTOR = 2.0
# The whole-sample tests (coherence and token identity) run from this many samples: each sample is one score, and the
# threshold is fitted to the tail of the samples' scores. Judged at the normal law's z* instead, with the median and
# robust sigma of a fold of 8-24 samples, clean runs failed: the Llama default (300 steps, fp32) at 16-40 samples had
# whole-sample maxima of 0.56-1.19 z* and failed 3 runs of 15 (seeds 2-4; z 7.0 > 6.6 at 40 samples); the DeepSeek-V3
# trained 200 steps, 240 samples, bf16, two samples at 7.3 and 6.9 > 6.8
WHOLE_MIN_SAMPLES = TAIL_MIN_SCORES


def robust(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column: median and 1.4826 x the median absolute deviation (a normal law's sigma)."""
    median = x.median(0).values
    return median, ((x - median).abs().median(0).values * 1.4826).clamp_min(1e-6)


def rounding_sigmas(scores: list[SampleScores], window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp8 states: per test, the least robust sigma its scores are judged with, the standard deviation the rounding
    alone leaves in them (`SampleScores.rounding`, per position; a mean of n logs has mean(u^2) / n of variance):
    [K] the run's median over the windows of `window_scores` (`window` judged positions, the largest left out), and
    [N, K] each sample's over its whole mean. Where most positions sit on the rounding's floor, the run's own spread
    collapses to the floor's and is no measure of a clean window's; None: not fp8."""
    if any(s.rounding is None for s in scores):
        return None
    windows, whole = [], []
    for s in scores:
        u2 = s.rounding.double().square()
        m = min(window, u2.shape[0])
        kept = m - 1 if m >= 3 else m
        windows.append((u2.T.unfold(1, m, 1).mean(-1) / kept).sqrt().T)
        whole.append((u2.mean(0) / u2.shape[0]).sqrt())
    return torch.cat(windows).median(0).values, torch.stack(whole)


def whole_sample_means(scores: list[SampleScores], folds: list[int]) -> torch.Tensor:
    """[N, K]: each sample's mean log score over its judged positions, each position first centred on the median of
    its fold's runs at positions of its range [2^k, 2^(k+1)). How well a state is predicted changes with the context
    before it, so samples of other lengths have other means: on the H200 the MoE shape's 16 clean samples of 512 tokens
    beside 16 of 2,048 (random tokens: a 512-token prompt's states are the first 512 of any) scored 0.27-0.29 against
    their fold's median of 0.254, and 5 of them failed at z 11.8-17.3 > 6.9. Per fold, as the samples are judged
    (`whole_sample_z`): centred on both folds' medians, every 2,048-token sample of the 8B shape failed (z 42-45), its
    long positions moved by the other fold's level. A range with fewer than EARLY_MIN_ROWS judged rows in the fold is
    left as it is."""
    logs = [s.shares.double().clamp_min(1e-30).log() for s in scores]
    ranges = [torch.from_numpy(np.floor(np.log2(np.maximum(s.positions, 1))).astype(np.int64)) for s in scores]
    top = max(int(r.max()) for r in ranges) + 1
    offsets = {}
    for fold in set(folds):
        members = [i for i, f in enumerate(folds) if f == fold]
        every, where = torch.cat([logs[i] for i in members]), torch.cat([ranges[i] for i in members])
        overall = every.median(0).values
        offsets[fold] = torch.zeros(top, every.shape[1], dtype=torch.float64)
        for r in where.unique().tolist():
            rows = where == r
            if int(rows.sum()) >= EARLY_MIN_ROWS:
                offsets[fold][r] = every[rows].median(0).values - overall
    return torch.stack([(lg - offsets[f][r]).mean(0) for lg, r, f in zip(logs, ranges, folds, strict=True)])


def whole_sample_z(whole: torch.Tensor, folds: list[int], least_sigma: torch.Tensor | None = None) -> torch.Tensor | None:
    """[N, K] samples' mean log scores -> robust z against the samples scored by the same predictors (the same fold):
    the two folds' maps differ in how well they predict, so samples scored by different maps are not one population
    (the seed's width on the H200, 33k fit rows per fold for 28,673 inputs: the 79 clean samples of fold 0, every one
    of them, failed the raw-share tests judged against all 160, shares 0.161-0.166 against a median of 0.155, z up
    to 10.1). A fold of fewer than FOLD_MIN_SAMPLES samples is judged against all samples; None: fewer than
    WHOLE_MIN_SAMPLES in all (the test is not run). `least_sigma` [N, K] (fp8: `rounding_sigmas`): the sigma is never
    below the median of the judged samples' own."""
    if whole.shape[0] < WHOLE_MIN_SAMPLES:
        return None
    z = torch.empty_like(whole)
    fold_of = torch.tensor(folds)
    for fold in fold_of.unique().tolist():
        rows = fold_of == fold
        median, sigma = robust(whole[rows] if int(rows.sum()) >= FOLD_MIN_SAMPLES else whole)
        if least_sigma is not None:
            sigma = torch.maximum(sigma, least_sigma[rows].median(0).values)
        z[rows] = (whole[rows] - median) / sigma
    return z


def tail_threshold(z: torch.Tensor, tests: int, false_alarm: float) -> torch.Tensor:
    """[N, K] scores -> [K]: per test, the z at which a normal upper tail with the location and scale of the
    run's own quantiles q1, q2 of that test's scores (`TAIL_QUANTILES`) reaches false_alarm / tests
    (Bonferroni): the normal law's z*, with the sigma the tail shows instead of the MAD's."""
    q1, q2 = TAIL_QUANTILES
    z1, z2 = torch.from_numpy(np.quantile(z.double().numpy(), [q1, q2], axis=0))
    normal = NormalDist()
    scale = (z2 - z1).clamp_min(1e-6) / (normal.inv_cdf(q2) - normal.inv_cdf(q1))
    return z1 + scale * (-normal.inv_cdf(false_alarm / tests) - normal.inv_cdf(q1))


def calibrated(z: torch.Tensor, sample_of: torch.Tensor, tests: int, false_alarm: float, z_star: float) -> tuple[torch.Tensor, str]:
    """[N, K] scores (row i of sample `sample_of[i]`) -> per-test thresholds, never below z*, and the rule that set
    them. Per test, the tail is fitted without the samples that have a score above z* in it: a faulty sample's
    windows can be more than the top 1 % of a small run's (48 shifted positions of one of 20 samples: 1.8 %)
    and would lift the threshold over its own scores; a clean run loses one sample or a few."""
    out = torch.full((z.shape[1],), z_star, dtype=torch.float64)
    fitted = False
    for k in range(z.shape[1]):
        over = torch.unique(sample_of[z[:, k] > z_star])
        clean = z[~torch.isin(sample_of, over), k : k + 1]
        if clean.shape[0] >= TAIL_MIN_SCORES:
            out[k] = max(float(tail_threshold(clean, tests, false_alarm)[0]), z_star)
            fitted = True
    return out, "tail" if fitted else "normal"


def tail_kind(against: str, rule: str, factor: torch.Tensor, threshold: torch.Tensor, z: torch.Tensor) -> str:
    """What a z was measured against, for the report; says so where it was divided for the run's tail."""
    k = int(z.max(0).values.argmax())
    if rule != "tail" or float(factor[k]) == 1.0:
        return against
    return (f"{against}, divided by {float(factor[k]):.2f} for the tail of the run's scores of this test (fails at "
            f"{float(threshold[k]):.1f} robust sigmas)")
