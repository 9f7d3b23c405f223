#!/usr/bin/env python3
"""verify's reference forward on a GPU: the whole model (reference.load_references) against the
streamed one (pipeline/verification/reference/streamed.py) under a budget below the model's size, same samples (issue 24).

Needs only torch + transformers (the H200 image has both; no vLLM), from the repo root:

    PYTHONPATH=. python3 bench/streamed_reference_bench.py --out $OUT --shape llama8b --budget-gib 8
    PYTHONPATH=. python3 bench/streamed_reference_bench.py --out $OUT --shape moe --budget-gib 3

Builds a random-weight bf16 model on the GPU (llama8b: the Llama-3.1-8B shape; moe: a small
DeepSeek-V3 / Kimi-K2 shape, MLA + 64 routed experts), saves it to /dev/shm, then runs both
references over the same `--samples` x `--tokens` random sequences: time (load + forward of every
state, fp32 and bf16 runs), peak GPU memory (torch.cuda.max_memory_allocated), and how far the
streamed states are from the whole model's (bit-equal where a layer's experts fit at once).
Results: $OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(shape: str, out: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if shape in ("llama8b", "tiny"):
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
        if shape == "tiny":  # a CPU smoke test of this script
            config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
        cls = LlamaForCausalLM
    else:
        config = DeepseekV3Config(hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024, num_hidden_layers=8,
                                  num_attention_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1,
                                  first_k_dense_replace=1, q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64,
                                  qk_nope_head_dim=128, v_head_dim=128, vocab_size=32000, n_group=1, topk_group=1,
                                  max_position_embeddings=8192)
        cls = DeepseekV3ForCausalLM
    with torch.device(DEVICE):
        model = cls(config).to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() >= 2:
            p.data.normal_(0, 0.02)
    model.save_pretrained(out)
    del model
    empty_cache()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None


def run_states(refs, sequences) -> tuple[list, list]:
    fp32 = [refs.fp32.states(s).cpu() for s in sequences]
    low = [refs.low.states(s).cpu() for s in sequences] if refs.low is not None else []
    return fp32, low


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=["llama8b", "moe", "tiny"], default="llama8b")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from pipeline.verification.reference.model import load_references
    from pipeline.verification.reference.streamed import choose_reference, stream_references

    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30  # a container's /dev/shm may be tiny
    model_dir = (shm if room else Path.cwd() / ".bench-model") / f"ref-{args.shape}"
    shutil.rmtree(model_dir, ignore_errors=True)
    t = time.perf_counter()
    build(args.shape, model_dir)
    results = {"shape": args.shape, "build_s": round(time.perf_counter() - t, 1), "samples": args.samples, "tokens": args.tokens,
               "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
               "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 32000, (args.tokens,), generator=g) for _ in range(args.samples)]

    reset_peak()
    t = time.perf_counter()
    whole = load_references(model_dir, "bfloat16")
    loaded = time.perf_counter() - t
    w32, wlow = run_states(whole, sequences)
    results["whole"] = {"load_s": round(loaded, 2), "total_s": round(time.perf_counter() - t, 2), "how": whole.how,
                        "peak_gpu_gib": peak_gib()}
    del whole
    empty_cache()
    print(json.dumps(results["whole"]), flush=True)

    reset_peak()
    t = time.perf_counter()
    choice = choose_reference(model_dir, "bfloat16", args.budget_gib, args.tokens)
    streamed = stream_references(model_dir, "bfloat16", sequences, choice)
    streamed_s = time.perf_counter() - t
    s32, slow = run_states(streamed, sequences)
    results["streamed"] = {"budget_gib": args.budget_gib, "streamed": choice.streamed, "why": choice.why,
                           "stream_s": round(streamed_s, 2), "total_s": round(time.perf_counter() - t, 2), "how": streamed.how,
                           "peak_gpu_gib": peak_gib()}

    def compare(a, b):
        equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        rel = max(float((x.float() - y.float()).norm() / y.float().norm()) for x, y in zip(a, b, strict=True))
        return {"bit_equal": equal, "max_rel_error": rel}

    results["streamed_vs_whole"] = {"fp32": compare(s32, w32), "bfloat16": compare(slow, wlow),
                                    "bf16_vs_fp32_whole": compare(wlow, w32)["max_rel_error"]}
    print(json.dumps(results, indent=1), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
