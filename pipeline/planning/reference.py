"""`make plan`'s projection of verify's reference forward at the planned scale: which reference runs
(whole model or streamed, and why), the bytes it reads, the memory it holds, and a time estimate.

Sizes come from the config alone (pipeline/verification/reference/cost.py, from_config), so a model that is not here (the
Kimi-K2.5-shaped example) projects too. The time is an estimate at assumed rates, stated with it:
reading the checkpoint once (the whole model at READ_BYTES_PER_S, assumed; streamed at STREAMED_BYTES_PER_S,
measured on the H200 host) overlaps the forward (the next unit is prefetched), so the longer of the two is taken.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.errors import PipelineError
from pipeline.extraction.capacity import human_bytes, human_seconds
from pipeline.verification.reference.cost import BUDGET_PARAM, GIB, from_config, stream_plan, whole_model_bytes

READ_BYTES_PER_S = 2e9  # one local NVMe-class disk, read sequentially (assumed): the whole-model load
# the streamed reference, unit by unit: read on the host, copied up, INT4 dequantized, one unit ahead (measured: the
# seed's shape on the H200 host, 35.1 GB in 31.9 s and 33.1 s, two runs at 36 experts a chunk; docs/SCALING.md,
# "Verify's cost")
STREAMED_BYTES_PER_S = 1.07e9
FLOPS = {"gpu": {"float32": 50e12, "bfloat16": 400e12}, "cpu": {"float32": 2e11, "bfloat16": 1e11}}  # assumed sustained


@dataclass
class ReferenceProjection:
    reference: str  # "whole model" | "streamed" | "impossible"
    why: str
    read_bytes: int
    peak_bytes: int
    whole_bytes: int
    min_budget_bytes: int
    budget_bytes: int
    experts_per_chunk: list[int]
    host_states_bytes: int
    seconds: float
    how_seconds: str

    def to_json(self) -> dict:
        return asdict(self)


def stored_bytes(cfg: dict) -> tuple[float, float, bool]:
    """Bytes per weight as stored (dense, routed experts) and whether the checkpoint is INT4."""
    cfg = cfg.get("text_config", cfg)
    dense = 4.0 if (cfg.get("dtype") or cfg.get("torch_dtype")) == "float32" else 2.0
    q = cfg.get("quantization_config") or {}
    groups = q.get("config_groups") or {}
    if q.get("format") == "pack-quantized" and groups:
        w = next(iter(groups.values()))["weights"]
        return dense, w["num_bits"] / 8 + dense / (w.get("group_size") or 1), True
    return dense, dense, False


def project_reference(cfg: dict, verify, captured_dtype: str, max_tokens: int, gpus: list[int]) -> ReferenceProjection:
    dense_b, expert_b, quantized = stored_bytes(cfg)
    cost = from_config(cfg, dense_b, expert_b)
    device = "gpu" if gpus else "cpu"
    if verify.reference_memory_gib is not None:
        budget, said = int(verify.reference_memory_gib * GIB), f"{BUDGET_PARAM} {verify.reference_memory_gib} GiB"
    elif gpus:
        budget, said = int(0.9 * gpus[0]), f"90% of one GPU's {gpus[0] / GIB:.0f} GiB ({BUDGET_PARAM} null)"
    else:
        import os

        budget = int(0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        said = f"90% of this machine's {budget / 0.9 / GIB:.0f} GiB ({BUDGET_PARAM} null)"
    whole = whole_model_bytes(cost, max_tokens, captured_dtype)
    try:
        plan = stream_plan(cost, budget, max_tokens, captured_dtype, on_gpu=bool(gpus))
    except PipelineError as e:
        plan, reason = None, str(e)
    if plan is None:
        reference, why, chunks, peak, smallest = "impossible", reason, [], 0, 0
    else:
        chunks, peak, smallest = plan.experts_per_chunk, plan.peak_bytes, plan.min_budget_bytes
        if quantized:
            reference, why = "streamed", "the checkpoint is INT4: dequantized unit by unit"
        elif whole > budget:
            reference, why = "streamed", f"the whole model (~{whole / GIB:,.0f} GiB) is over the budget, {said}"
        else:
            reference, why = "whole model", f"it fits the budget, {said}"
    samples, n = verify.reference_samples, len(cost.layers)
    tokens = samples * max_tokens
    host = samples * (n + 1) * max_tokens * cost.hidden_size * (4 + (0 if captured_dtype == "float32" else 2))
    active = cost.head.elements + sum(  # weights each token goes through (the embedding is a lookup)
        lc.dense.elements + min(lc.experts, cfg.get("num_experts_per_tok", 0) or 0) * lc.expert.elements for lc in cost.layers)
    rates = FLOPS[device]
    compute = 2 * active * tokens / rates["float32"] + (0 if captured_dtype == "float32" else 2 * active * tokens / rates["bfloat16"])
    rate, rate_is = (STREAMED_BYTES_PER_S, "measured, streamed") if reference == "streamed" else (READ_BYTES_PER_S, "assumed")
    read = cost.read_bytes / rate
    how = (f"max(read {cost.read_bytes / 1e9:,.0f} GB at {rate / 1e9:g} GB/s ({rate_is}) = {read:,.0f} s, forward "
           f"{samples} x {max_tokens} tokens x 2 x {active / 1e9:,.1f}e9 active weights in fp32"
           f"{'' if captured_dtype == 'float32' else ' + ' + captured_dtype} on the {device} at assumed "
           f"{rates['float32'] / 1e12:g}/{rates['bfloat16'] / 1e12:g} TFLOP/s = {compute:,.0f} s)")
    return ReferenceProjection(reference, why, cost.read_bytes, peak, whole, smallest, budget, sorted(set(chunks)),
                               host, max(read, compute), how)


def add_rows(table, ref: ReferenceProjection | None) -> None:
    """verify's reference rows in `make plan`'s table."""
    if ref is None:
        return
    table.add_row("[bold]verify reference", f"[bold]{ref.reference}", ref.why)
    table.add_row("reference reads", human_bytes(ref.read_bytes), "the checkpoint, once (streamed: a unit at a time, one prefetched)")
    if ref.reference == "streamed":
        table.add_row("reference memory", human_bytes(ref.peak_bytes),
                      f"peak estimate within {human_bytes(ref.budget_bytes)}; smallest workable {human_bytes(ref.min_budget_bytes)}; "
                      f"routed experts held at once {ref.experts_per_chunk} (whole model would need {human_bytes(ref.whole_bytes)})")
    else:
        table.add_row("reference memory", human_bytes(ref.whole_bytes), "whole model in fp32 + the capture's dtype (estimate)")
    table.add_row("reference states (host)", human_bytes(ref.host_states_bytes), "every state of every reference sample, both runs")
    table.add_row("reference time", f"~{human_seconds(ref.seconds)}", ref.how_seconds)
