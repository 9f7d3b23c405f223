"""The per-sample tests' cross-layer predictors (scores.Coherence), fitted by least squares per fold: each
captured layer from the other captured layers and the token's embedding, the first from the embedding alone; and,
under the map that scores each fold, the whitened test's basis and the noise leak (pipeline/verification/samples/whitening.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.verification.samples.whitening import noise_leak, residual_covariances, residual_whitener

RIDGE = 1e-2  # of each standardised input's variance: best out-of-fold fit on the test targets (1e-4: overfits)


@dataclass
class FoldFit:
    weights: list[torch.Tensor]  # per fold, the predictors that score it: [(L + 1) H + 1, (L + 1) H]
    # per (fold, half), the whitened test's basis of each layer's clean residual: (eigenvectors [L, H, H], weights [L, H])
    whiteners: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    leak: torch.Tensor  # [L, L] (whitening.noise_leak)
    rows: int  # the rows fitted on


def fit_folds(chunks: list, half_of: Callable[[int], int], layers: int, hidden: int) -> FoldFit | None:
    """Per fold, least squares on its (fold, sample id, inputs [P, (L + 1) H + 1]) chunks, standardised per block, ridge
    `RIDGE`; a fold is scored by the other fold's map (a fold with no rows: by its own). None: no rows at all."""
    L, H = layers, hidden
    # per fold the Gram matrix of its inputs, [(L + 1) H + 1]^2 in fp64 (3.4 GB at the 8B shape, 10 GB at hidden
    # 7168): one at a time, solved in place; the first fold's diagonal is kept for the leak pattern
    fitted: list = [None, None]
    counts, diagonal = [0, 0], None
    sizes: dict[tuple[int, int], int] = {}  # rows per (fold, half)
    for fold in range(2):
        gram = None
        for f, sid, x in chunks:
            if f == fold:
                x = x.double()
                gram = x.T @ x if gram is None else gram.addmm_(x.T, x)
                counts[fold] += x.shape[0]
                sizes[(fold, half_of(sid))] = sizes.get((fold, half_of(sid)), 0) + x.shape[0]
        if gram is not None:
            diagonal = gram.diagonal().clone() if diagonal is None else diagonal
            fitted[fold] = solve(gram, counts[fold], L, H)  # scales `gram` in place
            del gram
    if fitted[0] is None and fitted[1] is None:
        return None
    # scored by the other fold's predictors; a fold with no data falls back to its own
    weights = [fitted[1] if fitted[1] is not None else fitted[0], fitted[0] if fitted[0] is not None else fitted[1]]
    # the residual covariance under the map that scores a fold, from the rows of the fold's other half: out of
    # fold for the map and out of sample for the covariance (a half with no data: any other that has)
    rows_of = {(f, k): next(c for c in ((f, 1 - k), (f, k), (1 - f, 1 - k), (1 - f, k)) if c in sizes)
               for f in range(2) for k in range(2)}
    covariances = residual_covariances(chunks, weights, {(f, rows) for (f, _), rows in rows_of.items()}, half_of, L, H)
    whiteners = {(f, k): residual_whitener(covariances[(f, rows_of[(f, k)])], sizes[rows_of[(f, k)]]) for f, k in rows_of}
    return FoldFit(weights, whiteners, noise_leak(weights[0], *whiteners[(0, 0)], diagonal, L, H), sum(counts))


def solve(gram: torch.Tensor, n: int, layers: int, hidden: int) -> torch.Tensor:
    """The predictors [(L + 1) H + 1, (L + 1) H] from the inputs' Gram matrix over n rows (scaled in place)."""
    L, H = layers, hidden
    blocks = L + 1
    # block RMS from the diagonal (the last column is the constant 1)
    rms = (gram.diagonal()[:-1].reshape(blocks, H).sum(1) / (n * H)).sqrt().clamp_min(1e-30)
    scale = torch.cat([rms.repeat_interleave(H), torch.ones(1, device=gram.device, dtype=gram.dtype)])
    g = gram.div_(scale[:, None]).div_(scale[None, :]).div_(n)  # in place: the caller's sum, no second copy
    weights = torch.zeros(blocks * H + 1, blocks * H, dtype=torch.float64, device=gram.device)
    every = torch.arange(blocks * H + 1, device=gram.device)
    for j in range(L + 1):  # j = L: the first captured layer from the embedding alone
        if j < L:
            inputs = every[(every < j * H) | (every >= (j + 1) * H)]
            target = slice(j * H, (j + 1) * H)
        else:
            inputs = every[every >= L * H]
            target = slice(0, H)
        rows = g.index_select(0, inputs)
        a, b = rows.index_select(1, inputs), rows[:, target].clone()
        del rows  # ~(L / (L + 1)) of the Gram matrix: gone before the solve's own copy of `a`
        a.diagonal()[:-1] += RIDGE
        w = torch.linalg.solve(a, b)
        # back from the standardised space: w_raw = diag(1/scale_in) w scale_out
        weights[inputs, j * H : (j + 1) * H] = w / scale[inputs][:, None] * scale[target][None, :]
    return weights.float()
