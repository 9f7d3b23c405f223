"""Numbers that say whether captured hidden states mean what they claim to mean.

Pure tensor functions (no I/O): closeness of a captured layer to a reference layer, which
reference layer a captured layer is closest to (layer identity), and whether it is closest to
the reference at the same position (token alignment).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Closeness:
    max_abs_error: float
    ref_abs_max: float
    rel_rms_error: float  # ||c - r|| / ||r|| over all positions
    cosine_mean: float
    cosine_min: float

    def to_dict(self) -> dict:
        return asdict(self)


def closeness(captured: torch.Tensor, reference: torch.Tensor) -> Closeness:
    """Compare [T, H] captured states with [T, H] reference states (computed in fp32)."""
    c, r = captured.float(), reference.float()
    diff = c - r
    cos = torch.nn.functional.cosine_similarity(c, r, dim=-1, eps=1e-12)
    return Closeness(
        max_abs_error=diff.abs().max().item(),
        ref_abs_max=r.abs().max().item(),
        rel_rms_error=(diff.norm() / r.norm().clamp_min(1e-12)).item(),
        cosine_mean=cos.mean().item(),
        cosine_min=cos.min().item(),
    )


class PooledError:
    """Relative error of one layer pooled over every reference token of every sample.

    ||c - r|| / ||r|| over all tokens together, plus the per-token relative errors. Pooling is
    what makes a low-precision comparison robust to MoE routing flips: a token whose top-k
    experts change under bf16 rounding is off by 10x its neighbours (measured: 5-12% against a
    median of 0.6% on the tiny DeepSeek-V3 target), which is legitimate and rare; in a per-sample
    statistic one such token in a 20-token sample could dominate, pooled it weighs 1/(all tokens),
    as it does in the independent reference it is compared with. A systematic fault (wrong
    kernel, wrong layer) raises every token's error, so the pooled figure and the median move.

    It also keeps sum <c, r>: the projection ratio (`scale_ratio`) says how much of the reference the
    captured states hold along the reference itself. Rounding and routing flips point every which way
    and leave it near 1; a scale of the whole layer (a misapplied scale factor, a skipped norm weight)
    moves it by that scale, in every token alike, even where the scale hides inside the relative error.
    """

    def __init__(self) -> None:
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.dot = 0.0
        self.per_token: list[torch.Tensor] = []

    def add(self, captured: torch.Tensor, reference: torch.Tensor) -> None:
        c, r = captured.float(), reference.float()
        d = (c - r).norm(dim=-1)
        n = r.norm(dim=-1)
        self.diff_sq += d.pow(2).sum().item()
        self.ref_sq += n.pow(2).sum().item()
        self.dot += (c * r).sum().item()
        self.per_token.append((d / n.clamp_min(1e-12)).cpu())

    @property
    def rel_rms(self) -> float:
        return (self.diff_sq / max(self.ref_sq, 1e-24)) ** 0.5

    @property
    def scale_ratio(self) -> float:
        """sum <c, r> / sum ||r||^2 over every token: 1 + s for captured states r (1 + s) plus unbiased error."""
        return self.dot / max(self.ref_sq, 1e-24)

    def quantile(self, q: float) -> float:
        if not self.per_token:
            return 0.0
        return torch.cat(self.per_token).quantile(q).item()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def identity_matrix(captured: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[L, J] relative error of captured layer i ([L, T, H]) against candidate state j ([J, T, H])."""
    c = captured.float()[:, None]
    r = candidates.float()[None]
    return (c - r).flatten(2).norm(dim=-1) / r.flatten(2).norm(dim=-1).clamp_min(1e-12)


def shift_errors(captured: torch.Tensor, reference: torch.Tensor) -> dict[int, float]:
    """Relative error of captured[t] against reference[t + s] for s in -1, 0, +1 ([T, H] each).

    Only interior positions are compared so that all three shifts see the same positions.
    """
    if captured.shape[0] < 3:
        return {0: rel_error(captured, reference)}
    c = captured[1:-1]
    return {-1: rel_error(c, reference[:-2]), 0: rel_error(c, reference[1:-1]), 1: rel_error(c, reference[2:])}
