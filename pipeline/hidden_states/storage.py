"""What each extract.dtype stores (no torch: the planner and the params read it): the engine's dtype, the format
version, and the bytes per token (docs/FORMAT.md)."""

from __future__ import annotations

FP8 = "float8_e4m3"  # the extract.dtype stored as e4m3 + a per-token, per-layer fp32 scale (fp8.py)
FP8_ENGINE_DTYPE = "bfloat16"  # vLLM computes in it; fp8 is only how its output is stored
# bytes per stored value; fp8 adds a 4-byte scale per token and layer (`state_bytes_per_token`)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, FP8: 1}


def engine_dtype(dtype: str) -> str:
    """The dtype vLLM computes in for this extract.dtype: fp8 is only a storage format (the engine runs bf16)."""
    return FP8_ENGINE_DTYPE if dtype == FP8 else dtype


def format_version(dtype: str) -> int:
    """The format version shards of this extract.dtype are written in: 2 for fp8, else 1 (unchanged bytes)."""
    return 2 if dtype == FP8 else 1


def state_bytes_per_token(num_layers: int, hidden: int, dtype: str) -> int:
    """Hidden-state bytes per token: L x H x dtype size, plus L x 4 for fp8's scales."""
    return num_layers * hidden * DTYPE_BYTES[dtype] + (4 * num_layers if dtype == FP8 else 0)
