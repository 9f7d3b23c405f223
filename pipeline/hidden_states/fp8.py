"""fp8 storage of hidden states: float8_e4m3 values with one fp32 scale per token and layer (docs/FORMAT.md).

    scale[t, l] = max_h |x[t, l, h]| / 448          (448: the largest finite e4m3 value; 1 for an all-zero row)
    q[t, l, h]  = e4m3(x[t, l, h] / scale[t, l])    round to nearest even, the row's largest value maps to +-448
    x'[t, l, h] = float32(q[t, l, h]) * scale[t, l] the dequantized value every reader returns

The error bound (what verify's tolerances are derived from): e4m3 keeps 3 mantissa bits, so a normal value
rounds with relative error <= 2^-4, and a value below the smallest normal (2^-6 of the scaled range) with
absolute error <= 2^-10 (half the subnormal step 2^-9), that is

    |x' - x| <= max(2^-4 |x|, 2^-10 scale)   per element  (`error_bound`, from the stored bytes alone)

plus the fp32 product's rounding (2^-24 relative). A non-finite value is never hidden: a NaN is stored as NaN (its
row too where the device's amax propagates NaN), an Inf makes its row's scale Inf and the whole row NaN after
dequantization (e4m3fn has no Inf).

Both functions are torch operations on whatever device the tensor is on: the extract stage calls `quantize` on the
host today (in its shard threads, on the tensor read from vLLM's file); a GPU path can call it on the device tensor.
"""

from __future__ import annotations

import torch

STORAGE_DTYPE = "float8_e4m3"  # the extract.dtype value
TORCH_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
REL_ERROR = 2.0**-4  # round to nearest, 3 mantissa bits
SUBNORMAL_ABS_ERROR = 2.0**-10  # half the subnormal step, in units of the scale
# the engine computes in this dtype; fp8 is only how its output is stored
ENGINE_DTYPE = "bfloat16"


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] floating states -> (q [..., H] float8_e4m3fn, scale [...] float32), on x's device."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # NaN/Inf amax stays non-finite
    q = (xf / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(TORCH_DTYPE)  # clamp keeps NaN
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [..., H] float8_e4m3fn, scale [...] float32) -> [..., H] float32 values (the product in fp32)."""
    out = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return out if dtype == torch.float32 else out.to(dtype)


def error_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most the dequantized `values` [..., H] can be from what was quantized (see the module's
    docstring): max(2^-4 |x|, 2^-10 scale) with |x| <= |x'| / (1 - 2^-4), from the stored values alone."""
    return torch.maximum(values.abs() * (REL_ERROR / (1 - REL_ERROR)), (SUBNORMAL_ABS_ERROR * scale).unsqueeze(-1))
