"""What fp8 rounding adds to every residual energy the per-sample tests score (pipeline/verification/samples/scores.py): the
quantization adds ~7e-4 of a state's energy to every position, a floor that narrows the spread the tests judge by, so
fp8 states are scored by the energy beyond its expectation."""

from __future__ import annotations

import torch

from pipeline.hidden_states import fp8

GAIN_CHUNK_ELEMENTS = 1 << 24  # float32 elements of one chunk of `_noise_gains`' [rows, L, H] temporaries: 64 MiB


class RoundingFloor:
    """The expected rounding energy of fp8 states in each residual, from the fitted predictors (`Coherence`'s
    `weights`, `whiteners`, `layer_ids`, `embedding` and its cache of what a fit derives)."""

    def _noise_gains(self, fold: int, half: int | None = None) -> torch.Tensor:
        """[LH, L]: how much of an input element's rounding variance each layer's residual energy takes in expectation
        (the error model in `_rounding_noise`). Layer j's residual is h_j - (layers) @ W[:LH, j]: an element's rounding
        error e enters it as e (k = j) minus e W[kH + h, j] (the prediction of j from layer k), so its gain on layer j is
        ||E_j[kH + h] - W[kH + h, j]||^2 (E_j: layer j's own rows of the identity); the whitened test projects the
        residual onto U diag(weights) first (half given), ||(E_j - W[:, j]) U_j diag(w_j)||^2. Each input row's gains
        are its own, so they are made GAIN_CHUNK_ELEMENTS of [rows, L, H] at a time: the temporaries stay near 4 such
        chunks (256 MiB) whatever L x H (whole, [LH, L, H] in fp32 was 1 GiB a copy at 4 layers of H 4096)."""
        weights = self.weights[fold]
        key = ("noise", fold, half)
        cached = self._compute_cache.get(key)
        if cached is None or cached[0] is not weights:
            L, H = len(self.layer_ids), self.embedding.shape[1]
            LH = L * H
            basis = None
            if half is not None:
                vectors, w = self.whiteners[(fold, half)]
                basis = (vectors * w[:, None, :]).float()
            gains = torch.empty(LH, L, dtype=torch.float32, device=weights.device)
            rows = max(1, GAIN_CHUNK_ELEMENTS // LH)
            for a in range(0, LH, rows):
                b = min(a + rows, LH)
                blocks = -weights[a:b, :LH].float()  # a copy: negated
                blocks.diagonal(offset=a).add_(1)  # input row a + i is element (a + i) of the identity
                blocks = blocks.view(b - a, L, H)  # [rows, j, H]
                if basis is not None:
                    blocks = torch.einsum("kjh,jhc->kjc", blocks, basis)
                gains[a:b] = blocks.square().sum(-1)
            cached = self._compute_cache[key] = (weights, gains)
        return cached[1]

    def _rounding_noise(self, h: torch.Tensor, fold: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp8 states [n, L, H] (dequantized) -> the expected rounding energy in each layer's residual [n, L] (its own
        and its predictors'), in its own state alone [n, L], and the per-element variances flattened [n, LH]: rounding
        errors are independent and of mean 0, so a residual's expected energy is the clean residual's plus the sum of
        the variances times their gains (`fp8.rounding_variance`, `_noise_gains`)."""
        variance = fp8.rounding_variance(h.float()).flatten(1)
        return variance @ self._noise_gains(fold), variance.view(h.shape).sum(-1), variance

    def _beyond_rounding(self, energy: torch.Tensor, noise: torch.Tensor, variance: torch.Tensor,
                         gains: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual's energy [n, K] less its expected rounding energy `noise`, and no less than that energy's own
        spread: an error spread evenly over a step has E e^4 = 9/5 (E e^2)^2, so e^2 has variance 4/5 (E e^2)^2, and an
        element of variance v entering with gain g adds 4/5 (g v)^2 (`variance` [n, LH], `gains` [LH, K]; the products
        of two elements' errors add spread but no energy, and are left out). Below that spread the residual beyond the
        rounding is not measured; a floor of 0 scores its logarithm at -69 (the tiny project's layer 8, whose clean
        residual is about 0.4 of its rounding energy: whole-sample robust sigmas of 3.6 and 5.8 where bf16 has 0.44
        and 0.62, a test blunted, not sharpened). Returns that energy and the spread, whose ratio is how uncertain the
        rounding leaves its logarithm (`rounding_uncertainty`)."""
        spread = (0.8 * variance.square() @ gains.square()).sqrt()
        return torch.maximum(energy - noise, spread), spread


def rounding_uncertainty(beyond: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """The standard deviation the rounding leaves in the logarithm of an energy beyond it (`_beyond_rounding`'s pair):
    its spread over the energy, 1 where the floor binds. Where a target's clean residual is far below fp8's rounding
    (the DeepSeek-V3 trained 20 steps: shares of 7e-5 against a rounding energy of 7e-4), most positions sit on the
    floor, the run's robust sigma of a test collapses (0.01-0.04 in log) and clean windows a little above the floor
    scored z 14-83; judged with this uncertainty as the least sigma they pass (pipeline/verification/samples/judge.py)."""
    return spread / beyond.clamp_min(1e-30)
