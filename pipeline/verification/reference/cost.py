"""What verify's reference forward costs in memory (whole model or streamed unit by unit), and the
streamed reference's plan: how many routed experts it holds at once under a memory budget.

A unit is what the streamed reference holds at one time: the embedding, a decoder layer's dense part
(attention, norms, router, shared experts), a chunk of its routed experts, the final norm + lm_head.
A layer's dense part is held in each run's dtype at once (fp32, and the capture's dtype for a
low-precision capture: 4 + 2 bytes per weight: both runs' modules wait for the layer's expert
chunks); the embedding and an expert chunk are built for one run at a time (4 bytes per weight, the
fp32 run's). On a CPU the checkpoint's bytes as read and the prefetched next unit share that memory;
on a GPU they stay in host memory (measured at Kimi-K2.5's width, depth 4, 36 experts a chunk: the
reference's own GPU peak 9.17 GB, where counting them and both runs' experts estimated 17.16 GB).
The working set (one sample's activations in both runs) comes on top. These are estimates of the
largest allocations, not a measurement; docs/ARCHITECTURE.md says what the budget does and does not bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import PipelineError

GIB = 2**30
BUDGET_PARAM = "verify.reference_memory_gib"


@dataclass
class Unit:
    elements: int  # weights once materialized (dequantized)
    read_bytes: int  # as stored in the checkpoint


@dataclass
class LayerCost:
    dense: Unit
    experts: int = 0  # routed experts (0: a dense layer)
    expert: Unit = field(default_factory=lambda: Unit(0, 0))  # one routed expert


@dataclass
class ModelCost:
    embed: Unit
    head: Unit
    layers: list[LayerCost]
    hidden_size: int
    intermediate_size: int
    num_heads: int

    @property
    def read_bytes(self) -> int:
        return self.embed.read_bytes + self.head.read_bytes + sum(
            lc.dense.read_bytes + lc.experts * lc.expert.read_bytes for lc in self.layers)

    @property
    def elements(self) -> int:
        return self.embed.elements + self.head.elements + sum(lc.dense.elements + lc.experts * lc.expert.elements for lc in self.layers)


def run_bytes_per_element(captured_dtype: str) -> int:
    """fp32 run, plus a run in the capture's dtype unless the capture is fp32."""
    return 4 if captured_dtype == "float32" else 4 + 2


def working_bytes(cost: ModelCost, max_tokens: int, captured_dtype: str) -> int:
    """One sample's activations through one layer, in both runs: residual stream, MLP intermediate
    and attention scores (sdpa may materialize heads x T x T on CPU)."""
    per_token = 8 * cost.hidden_size + 4 * cost.intermediate_size + cost.num_heads * max_tokens
    return run_bytes_per_element(captured_dtype) * max_tokens * per_token


def resident(unit: Unit, bpe: int, with_read: bool = True) -> int:
    """A unit's weights materialized at `bpe` bytes each, plus its bytes as read where they share the memory."""
    return (unit.read_bytes if with_read else 0) + unit.elements * bpe


def whole_model_bytes(cost: ModelCost, max_tokens: int, captured_dtype: str) -> int:
    """reference.load_references: the model in the capture's dtype and its fp32 copy (or fp32 alone)."""
    return cost.elements * run_bytes_per_element(captured_dtype) + working_bytes(cost, max_tokens, captured_dtype)


@dataclass
class StreamPlan:
    experts_per_chunk: list[int]  # per layer: routed experts held at once (all of them: no chunking)
    peak_bytes: int
    min_budget_bytes: int
    budget_bytes: int


def stream_plan(cost: ModelCost, budget_bytes: int, max_tokens: int, captured_dtype: str, budget_label: str | None = None,
                on_gpu: bool = False) -> StreamPlan:
    """The largest expert chunk per layer that keeps the estimate within the budget (of the GPU's memory when
    `on_gpu`, where the bytes as read stay on the host); a budget below the smallest unit of work (the largest
    dense unit, or a layer's dense part + one expert) is an error naming the param and the smallest budget that would do."""
    bpe = run_bytes_per_element(captured_dtype)
    one_run = 4  # the embedding and an expert chunk: one run's copy at a time, fp32 the largest
    work = working_bytes(cost, max_tokens, captured_dtype)
    singles = [cost.embed, cost.head] + [lc.dense for lc in cost.layers]
    with_read = not on_gpu  # on a GPU the bytes as read (and the prefetched unit) stay in host memory
    prefetch = max(u.read_bytes for u in singles) if with_read else 0

    def need(lc: LayerCost, chunk: int) -> int:
        chunk_read = chunk * lc.expert.read_bytes if with_read else 0
        return (resident(lc.dense, bpe, with_read) + chunk * resident(lc.expert, one_run, with_read)
                + max(prefetch, chunk_read) + work)

    fixed = max(resident(u, one_run, with_read) for u in (cost.embed, cost.head)) + prefetch + work
    smallest = max([fixed] + [need(lc, min(1, lc.experts)) for lc in cost.layers])
    if budget_bytes < smallest:
        raise PipelineError(
            f"{BUDGET_PARAM}: {budget_label or f'{budget_bytes / GIB:.3g} GiB'} is below the smallest unit of work of the streamed reference "
            f"(a layer's dense part + one routed expert, or the embedding / lm_head, with its prefetch and one sample's "
            f"activations): set it to at least {smallest / GIB:.3g} GiB (null = the device's free memory)"
        )
    chunks, peak = [], fixed
    for lc in cost.layers:
        chunk = lc.experts
        while chunk > 1 and need(lc, chunk) > budget_bytes:
            chunk -= 1
        chunks.append(chunk)
        peak = max(peak, need(lc, chunk))
    return StreamPlan(chunks, peak, smallest, budget_bytes)


def from_config(cfg: dict, weight_bytes: float, expert_bytes: float | None = None) -> ModelCost:
    """Analytic sizes of a Llama- or DeepSeek-V3-shaped (MLA + MoE) model from config fields alone
    (for `make plan` on a model that is not here); bytes per weight as stored, routed experts apart
    (INT4 grouped by 32 with bf16 scales: 0.5 + 2/32)."""
    cfg = cfg.get("text_config", cfg)
    expert_bytes = weight_bytes if expert_bytes is None else expert_bytes
    h, n, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg.get("num_attention_heads", 1)
    inter = cfg.get("intermediate_size", 4 * h)
    if "kv_lora_rank" in cfg:  # MLA
        rope, nope = cfg.get("qk_rope_head_dim", 64), cfg.get("qk_nope_head_dim", 128)
        v, kv_rank, q_rank = cfg.get("v_head_dim", 128), cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        q = h * heads * (rope + nope) if not q_rank else h * q_rank + q_rank * heads * (rope + nope)
        attn = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h
    else:
        head_dim = cfg.get("head_dim", h // heads)
        kv = cfg.get("num_key_value_heads", heads)
        attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    routed = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    first_dense = cfg.get("first_k_dense_replace", 0) if routed else n
    moe_inter = cfg.get("moe_intermediate_size", inter)
    layers = []
    for i in range(n):
        if i < first_dense:
            dense = attn + 3 * h * inter
            layers.append(LayerCost(Unit(dense, int(dense * weight_bytes))))
        else:
            dense = attn + 3 * h * moe_inter * cfg.get("n_shared_experts", 0) + routed * h
            expert = 3 * h * moe_inter
            layers.append(LayerCost(Unit(dense, int(dense * weight_bytes)), routed, Unit(expert, int(expert * expert_bytes))))
    embed = Unit(vocab * h, int(vocab * h * weight_bytes))
    head = Unit(vocab * h, 0 if cfg.get("tie_word_embeddings") else int(vocab * h * weight_bytes))
    return ModelCost(embed, head, layers, h, max(inter, moe_inter), heads)
