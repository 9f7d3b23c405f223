"""fp8 storage of hidden states: float8_e4m3 values with one fp32 scale per token and layer (docs/FORMAT.md).

    scale[t, l] = max_h |x[t, l, h]| / 448          (448: the largest finite e4m3 value; 1 for an all-zero row)
    q[t, l, h]  = e4m3(x[t, l, h] / scale[t, l])    round to nearest even, the row's largest value maps to +-448
    x'[t, l, h] = float32(q[t, l, h]) * scale[t, l] the dequantized value every reader returns

The error bound (what verify's tolerances are derived from): e4m3 keeps 3 mantissa bits, so a normal value
rounds with relative error <= 2^-4, and a value below the smallest normal (2^-6 of the scaled range) with
absolute error <= 2^-10 (half the subnormal step 2^-9), that is

    |x' - x| <= max(2^-4 |x|, 2^-10 scale)   per element; `error_bound` takes the exact half step at the stored
                                            value (2^-5 to 2^-4 of it), from the stored bytes alone

plus the fp32 product's rounding (2^-24 relative). A non-finite value is never hidden: a NaN is stored as NaN (its
row too where the device's amax propagates NaN), an Inf makes its row's scale Inf and the whole row NaN after
dequantization (e4m3fn has no Inf).

Both functions are torch operations on whatever device the tensor is on: the extract stage's connector calls
`quantize` on the GPU, before the states leave it (on the host rows on CPU: pipeline/extraction/hs_connector.py).
"""

from __future__ import annotations

import torch

from pipeline.hidden_states import storage

STORAGE_DTYPE = storage.FP8  # the extract.dtype value
TORCH_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
REL_ERROR = 2.0**-4  # round to nearest, 3 mantissa bits
SUBNORMAL_ABS_ERROR = 2.0**-10  # half the subnormal step, in units of the scale
ENGINE_DTYPE = storage.FP8_ENGINE_DTYPE  # the engine computes in it; fp8 is only how its output is stored
# the names fp8 states are stored under: bare in vLLM's request files, after "{sample_id}/" in shards
STATES_KEY, SCALE_KEY = "hidden_states_fp8", "hidden_states_scale"
STATS_KEY = "hidden_states_stats"  # in request files only: the statistics of the dequantized values, [L, 4]


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
    """Per element, the most the dequantized `values` [..., H] can be from what was quantized, from the stored
    values alone: half the e4m3 step at the stored value, 2^(e-4) x scale for a stored q in [2^e, 2^(e+1)) (so
    between 2^-5 and 2^-4 of |q|: at q = 2^e the neighbour below is nearer, and the step above is the larger),
    2^-10 x scale for a subnormal or zero q; plus 2^-20 |x'| for the fp32 division (a value a hair past a tie
    can round to it) and product."""
    s = scale.unsqueeze(-1)
    q = values.abs() / s  # exact at powers of two (q x scale is exact there), so the binade below is never taken
    _, exponent = torch.frexp(q)  # q = m 2^exponent, m in [0.5, 1): q's binade is 2^(exponent - 1)
    step = torch.where(q >= 2.0**-6, torch.ldexp(torch.ones_like(q), exponent - 5), torch.full_like(q, SUBNORMAL_ABS_ERROR))
    return step * s + values.abs() * 2.0**-20


def row_scale(values: torch.Tensor) -> torch.Tensor:
    """[..., H] dequantized values -> [...] the scale they were stored with: the row's largest value is stored as
    +-448, so max |x'| / 448 (to the fp32 product's rounding); 1 for an all-zero row, as `quantize` sets it."""
    amax = values.abs().amax(dim=-1)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def rounding_variance(values: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per element, the variance of the rounding error behind the dequantized `values` [..., H]: rounding to
    nearest with step d leaves an error spread evenly over [-d/2, d/2], of variance d^2 / 12. The step at a stored
    q in [2^e, 2^(e+1)) is 2^(e-3) x scale (3 mantissa bits; twice `error_bound`'s half step), 2^-9 x scale for a
    subnormal or zero q (d^2 / 16 at a normal power of two, below); 0 at +-448, the row's largest value, which the scale maps there exactly (a value that rounds
    up to it from below is taken as exact too: at most a few of a row's H). `scale` [...]: the rows' scales (None:
    recovered from the values, `row_scale`)."""
    s = (row_scale(values) if scale is None else scale).unsqueeze(-1)
    q = values.abs() / s
    mantissa, exponent = torch.frexp(q)  # q in [2^(exponent - 1), 2^exponent)
    normal = q >= 2.0**-6
    step = torch.where(normal, torch.ldexp(torch.ones_like(q), exponent - 4), torch.full_like(q, 2 * SUBNORMAL_ABS_ERROR))
    # at a normal power of two the values rounded to it span [-d/4, d/2] (the binade below has half the step): d^2 / 16
    spread = torch.where(normal & (mantissa == 0.5), 16.0, 12.0)
    return torch.where(q < E4M3_MAX * (1 - 2.0**-10), (step * s).square() / spread, torch.zeros_like(q))
