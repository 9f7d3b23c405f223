"""bench step build: random-weight bf16 models of the bench shapes, built with transformers and saved."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from gpu_jobs.common import device, log, shape_of


def job_build(state: dict, name: str) -> dict:
    if name == "seed":  # its own writer (pipeline/embedded/seed_shape.py): INT4 experts, written shard by shard
        from gpu_jobs.job_seed import job_seed_build

        return job_seed_build(state, name)
    import torch
    from tokenizers import Tokenizer, models

    shape = dict(shape_of(state, name))
    kind = shape.pop("kind")
    out = Path(state["models"]) / name
    shutil.rmtree(out, ignore_errors=True)
    dev = device()
    torch.manual_seed(0)
    common = {"bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config, cls = LlamaConfig(**shape, **common), LlamaForCausalLM
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config, cls = DeepseekV3Config(**shape, **common), DeepseekV3ForCausalLM
    t = time.monotonic()
    # Built directly in bf16: .to(bf16) would round RoPE's float32 buffers too.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = cls(config).eval()
    torch.set_default_dtype(torch.float32)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_init = time.monotonic() - t
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    t = time.monotonic()
    model.save_pretrained(out)
    t_save = time.monotonic() - t
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if kind == "deepseek_v3":  # real V3 / K2 configs carry these; vLLM needs them (pipeline/embedded/tiny_deepseek_v3.py)
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_path.write_text(json.dumps(cfg, indent=2))
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    size = sum(p.stat().st_size for p in out.iterdir())
    # FLOPs a prefill token really costs in the linear layers: every weight except the input
    # embedding (a lookup) and the lm_head (vLLM runs it on the last token of a prompt only).
    flop_no_embed = 2 * (params - embed - head)
    if kind == "deepseek_v3":  # only top-k of the routed experts run per token
        n_moe = shape["num_hidden_layers"] - shape["first_k_dense_replace"]
        per_expert = 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
        idle = n_moe * (shape["n_routed_experts"] - shape["num_experts_per_tok"]) * per_expert
        flop_no_embed -= 2 * idle
    summary = {
        "params": params,
        "embed_params": embed,
        "lm_head_params": head,
        "flop_per_token_no_embed": flop_no_embed,
        "bytes_on_disk": size,
        "init_s": round(t_init, 2),
        "save_s": round(t_save, 2),
        "path": str(out),
        "config": cfg,
    }
    log(f"built {name}: {params / 1e9:.3f} B params, {size / 2**30:.1f} GiB in {t_init + t_save:.1f} s")
    return {"summary": summary}
