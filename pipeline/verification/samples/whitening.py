"""The whitened test's pieces (scores.Coherence): each captured layer's clean residual covariance,
in its eigenbasis, and what noise on one layer adds to the other layers' whitened scores."""

from __future__ import annotations

import torch

# ridge on the clean residual's covariance, as a share of its mean eigenvalue (its smallest eigenvalues are 0.2-0.3
# of the median on the tiny Llama: the ridge keeps an estimate's noise in them from ruling)
WHITEN_RIDGE = 1e-2
WHITEN_POWER = 2  # score r^T S^-power r: 2 = the score test for added isotropic noise, 1 = Mahalanobis


def residual_covariances(chunks, weights: list[torch.Tensor], wanted: set, half_of, layers: int, hidden: int) -> dict:
    """Per wanted (map fold f, rows (fold, half)): each captured layer's clean residual r = h_j - predict(...) under
    fold f's map, summed as r^T r over those rows, [L, H, H] in fp64. A second pass over the fit's rows: summing the
    residuals themselves needs L H^2 per entry where the Gram matrix of each half's inputs needs ((L + 1) H)^2 (at the
    8B shape 0.5 GB against 3.4 GB, four of them)."""
    L, H = layers, hidden
    sums: dict = {}
    for f in sorted({m for m, _ in wanted}):
        w = weights[f][:, : L * H].double()
        for fold, sid, x in chunks:
            key = (fold, half_of(sid))
            if (f, key) not in wanted:
                continue
            x = x.double()
            r = (x[:, : L * H] - x @ w).reshape(-1, L, H).transpose(0, 1)  # [L, n, H]
            part = torch.bmm(r.transpose(1, 2), r)
            sums[(f, key)] = part if (f, key) not in sums else sums[(f, key)].add_(part)
        del w
    return sums


def residual_whitener(covariance_sum: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per captured layer j, from the sum of r r^T over n clean rows [L, H, H] (residual_covariances), the covariance
    S_j. The whitened test scores ||S_j^-1 r||^2 (the score test for added isotropic noise: it weighs each direction by
    1 / variance^2, so noise counts most where clean residuals barely go), scaled to equal ||r||^2 for an isotropic
    S_j; returned as the eigenvectors U [L, H, H] of S_j and the weights [L, H] sqrt(c) / (eigenvalue + ridge):
    score = ||(r U) * weights||^2."""
    H = covariance_sum.shape[-1]
    vectors, scales = [], []
    for j in range(covariance_sum.shape[0]):
        values, u = torch.linalg.eigh(covariance_sum[j] / n)
        values = values.clamp_min(0)
        values = values + WHITEN_RIDGE * values.mean().clamp_min(1e-30)
        inverse = values.pow(-WHITEN_POWER / 2)
        vectors.append(u)
        scales.append(inverse * (H / inverse.pow(2).sum()).sqrt())
    return torch.stack(vectors).float(), torch.stack(scales).float()


def noise_leak(weights: torch.Tensor, vectors: torch.Tensor, scales: torch.Tensor, gram_diagonal: torch.Tensor, layers: int,
               hidden: int) -> torch.Tensor:
    """[L, L]: the whitened share that isotropic noise of relative RMS 1 on layer j adds to layer k's test (1 on the
    diagonal), from the fit's weights and the diagonal of its inputs' Gram matrix. Noise n (E||n||^2 = ||h_j||^2) on layer j adds -W_jk^T n to layer k's residual: a whitened share of
    ||W_jk U_k diag(scales_k)||_F^2 / H x (mean ||h_j||^2 / mean ||h_k||^2)."""
    H = hidden
    energy = gram_diagonal[: layers * H].reshape(layers, H).sum(1).float()
    leak = torch.eye(layers)
    for j in range(layers):
        for k in range(layers):
            if j != k:
                block = weights[j * H : (j + 1) * H, k * H : (k + 1) * H].float() @ vectors[k] * scales[k]
                leak[j, k] = float(block.pow(2).sum() / H * energy[j] / energy[k].clamp_min(1e-30))
    return leak
