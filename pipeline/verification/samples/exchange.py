"""The exchange test's scores: does a sample fit better with two adjacent captured layers exchanged (judged by
pipeline/verification/samples/judge.py: a gain over 1.5x fails)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.verification.samples.energy import squared_norm
from pipeline.verification.samples.positions import row_spans

EXCHANGE_POSITIONS = 64  # judged positions per sample scored again with adjacent layers exchanged


class ExchangeTest:
    """Per tried row, how much better the captured layers explain each other with a pair exchanged, from the fitted
    predictors (`Coherence`'s weights as scored, `_compute_weights`) and their residuals."""

    def _exchanged_orders(self, layers: int) -> torch.Tensor:
        """[L - 1, L] on the device: the captured layers' order with pair (i, i + 1) exchanged, in row i (made once:
        an index from a Python list is a host tensor, and its upload would wait for the stream's work)."""
        orders = self._compute_cache.get("exchanged")
        if orders is None:
            orders = torch.arange(layers).repeat(max(layers - 1, 0), 1)
            for i in range(layers - 1):
                orders[i, [i, i + 1]] = torch.tensor([i + 1, i])
            orders = self._compute_cache["exchanged"] = orders.to(self.device)
        return orders

    def _exchange_gain(self, held: torch.Tensor, residual: torch.Tensor, inverse: torch.Tensor, share: torch.Tensor,
                       folds: list, kept: np.ndarray) -> torch.Tensor:
        """[k, L - 1] per tried row (states as stored, residuals, 1 / energies [k, >= L] and shares [k, L]) and adjacent
        pair (i, i + 1):
        log(share as written / share with the two exchanged). Exchanged, layer j's prediction moves by
        (h_{i+1} - h_i) @ (W_i - W_{i+1}) (its j-th block), and layers i and i + 1 trade states, so the exchanged
        residual is the residual minus that correction, plus the step on layer i and minus it on layer i + 1; the
        exchanged energies are the energies permuted."""
        L, H = held.shape[1], held.shape[2]
        k = held.shape[0]
        by_pair = torch.diff(held.float(), dim=1).transpose(0, 1)  # [L - 1, k, H]: h_{i+1} - h_i
        tried_at = np.concatenate([[0], np.cumsum(kept)])  # sample i's tried rows: tried_at[i] .. tried_at[i + 1]
        swapped = torch.empty(L - 1, k, L * H, device=self.device)
        steps_in = by_pair.to(self.compute_dtype)
        for fold, (a, b) in row_spans(folds, tried_at[:-1], tried_at[1:]).items():
            differences = self._compute_weights(fold)[1][:, :, : L * H]
            correction = torch.bmm(steps_in[:, a:b], differences)
            torch.sub(residual[a:b].flatten(1)[None], correction, out=swapped[:, a:b])
        swapped = swapped.view(L - 1, k, L, H)
        # pair i's step onto layer i and off layer i + 1: the diagonals (i, i) and (i, i + 1) of (pair, layer), [k, H, L - 1]
        steps = by_pair.permute(1, 2, 0)
        swapped.diagonal(0, 0, 2).add_(steps)
        swapped.diagonal(1, 0, 2).sub_(steps)
        exchanged_inverse = inverse[:, self._exchanged_orders(L)].transpose(0, 1)  # [L - 1, k, L]
        ratios = (squared_norm(swapped) * exchanged_inverse).sum(-1)
        given = share.sum(1).clamp_min(1e-30).log()
        return (given - ratios.clamp_min(1e-30).log()).T
