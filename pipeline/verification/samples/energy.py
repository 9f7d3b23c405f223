"""Residual energies as the per-sample tests score them: squared norms, and shares of a state's own energy."""

from __future__ import annotations

import torch

ZERO_ROW_SHARE = 1e6  # the residual share of an all-zero row (its norm is 0: nothing is left to predict)


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """||x||^2 over the last dimension in fp32, in one reduction (x.pow(2).sum(-1) writes and reads x's size once more;
    a bf16 x is read as it is, not copied to fp32 first)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).square()


def share_scale(energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How squared residual norms become shares of the states' energy, in one multiply-add (squared x scale + floor):
    1 / energy, the scale (1 / energy; 0 for an all-zero state) and the floor (0; ZERO_ROW_SHARE for an all-zero
    state). Made once a batch: each call into torch costs a scoring thread ~0.25 ms waiting its turn on the host the
    scan's threads share, mostly outside the GIL (H100, 2026-12-06: docs/ARCHITECTURE.md, "Per-sample tests: what is
    caught, what cannot be"; the 0.2-0.3 ms a call: `git show 61b87c6:docs/BENCHMARKS.md`)."""
    inverse, nonzero = energy.clamp_min(1e-30).reciprocal(), energy > 0
    return inverse, inverse * nonzero, torch.where(nonzero, 0.0, ZERO_ROW_SHARE)
