"""The seed-shape writer at a tiny width, same code path and format as the H200 run: its INT4
experts dequantize to the bf16 weights they were quantized from (within half a quantization step),
the streamed reference reads the checkpoint (every tensor once, experts in chunks under a small
budget) and equals the whole model of its dequantized weights, and bad input is refused before any
weight is made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline import int4
from pipeline.embedded.seed_shape import check_reference_budget, seed_config, write_seed_shape
from pipeline.errors import PipelineError
from pipeline.target import check_model_dir, fingerprint_model_dir
from pipeline.verification.reference.cost import GIB, stream_plan
from pipeline.verification.reference.model import load_references
from pipeline.verification.reference.streamed import Checkpoint, choose_reference, stream_references
from tests.test_streamed_reference import SEQUENCES, assert_equal_references, rel_rms

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 256,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 1100,
        "max_position_embeddings": 4096}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out |= {n: f.get_tensor(n) for n in f.keys()}
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path, dict]:
    base = tmp_path_factory.mktemp("seed")
    # small shards and expert chunks: the same multi-shard, chunked path the 34 GB build takes
    kw = {"depth": 4, "width": TINY, "device": "cpu", "seed": 3, "expert_chunk": 3, "shard_bytes": 200_000}
    done = write_seed_shape(base / "int4", **kw)
    write_seed_shape(base / "bf16", experts="bfloat16", **kw)
    return base / "int4", base / "bf16", done


def test_checkpoint_is_the_kimi_config_at_depth_with_int4_experts(written):
    int4_dir, _, done = written
    check_model_dir(int4_dir)
    config = json.loads((int4_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["first_k_dense_replace"] == 1 and config["n_routed_experts"] == 8
    q = config["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert int4.scheme_of(config).weights.num_bits == 4
    stored = tensors(int4_dir)
    # 3 MoE layers x 8 experts x gate/up/down, each a packed triple; nothing else packed
    packed = sorted(n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed"))
    assert len(packed) == done["quantized_linears"] == 3 * 8 * 3
    assert all(int4.ROUTED_EXPERT.search(p) for p in packed)
    assert not any(int4.ROUTED_EXPERT.search(p) for p in q["ignore"]) and "lm_head" in q["ignore"]
    assert stored["model.layers.1.mlp.experts.0.down_proj.weight_packed"].shape == (64, 32 // 8)
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].shape == (32, 64 // 32)
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert {t.dtype for n, t in stored.items() if not int4.is_packed(n) and "correction_bias" not in n} == {torch.bfloat16}
    index = json.loads((int4_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored) and done["shards"] == len(set(index["weight_map"].values())) > 1
    # the tokenizer: the embedded default's, widened to the config's vocabulary, with its chat template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(int4_dir)
    assert len(tok) == config["vocab_size"] == 1100 and tok.chat_template
    assert max(tok("hello world, 123")["input_ids"]) < 1024  # fillers are never produced from text
    assert fingerprint_model_dir(int4_dir)["sha256"] == fingerprint_model_dir(int4_dir)["sha256"]


def test_int4_experts_dequantize_to_the_bf16_weights_they_quantize(written):
    int4_dir, bf16_dir, _ = written
    q, f = tensors(int4_dir), tensors(bf16_dir)
    scheme = int4.scheme_of(json.loads((int4_dir / "config.json").read_text()))
    experts = sorted(n.removesuffix(".weight_packed") for n in q if n.endswith(".weight_packed"))
    worst = 0.0
    for prefix in experts:
        weight = f[f"{prefix}.weight"].float()
        back = int4.dequantize(prefix, q, scheme).float()
        step = q[f"{prefix}.weight_scale"].float().repeat_interleave(32, dim=1)
        assert back.shape == weight.shape
        worst = max(worst, float(((back - weight).abs() / step).max()))
        assert rel_rms(back, weight) < 0.2  # 4 bits: ~10% RMS error, not another tensor
    # symmetric rounding: half a step per element, plus bf16 roundings (relative 2^-9 each, on values of
    # up to 8 steps: 1/64 step) of the scale, of w / scale before it is rounded, and of q * scale after
    assert 0.4 < worst <= 0.5 + 4 / 64, worst
    # every other tensor is the same, bit for bit: one random stream, only the experts' storage differs
    for name, t in q.items():
        if not int4.is_packed(name):
            assert torch.equal(t, f[name]), name


def test_streamed_reference_reads_it_and_equals_the_dequantized_model(written, tmp_path: Path):
    int4_dir, _, _ = written
    dequantized = tmp_path / "dequantized"
    int4.dequantize_checkpoint(int4_dir, dequantized)
    longest = max(len(s) for s in SEQUENCES)
    whole = choose_reference(int4_dir, "bfloat16", 100.0, longest)
    assert whole.streamed and "INT4" in whole.why
    refs = stream_references(int4_dir, "bfloat16", SEQUENCES, whole)
    assert_equal_references(refs, load_references(dequantized, "bfloat16"))
    assert f"{sum(Checkpoint(int4_dir).nbytes.values()) / GIB:.3g} GiB read once" in refs.how, refs.how
    # a budget below the checkpoint's size: the experts go in chunks, same states within rounding
    with pytest.raises(PipelineError) as err:
        choose_reference(int4_dir, "bfloat16", 1e-7, longest)
    smallest = float(str(err.value).split("at least ")[1].split(" GiB")[0])
    assert "verify.reference_memory_gib" in str(err.value)
    small = choose_reference(int4_dir, "bfloat16", smallest * 1.05, longest)
    chunked = stream_references(int4_dir, "bfloat16", SEQUENCES, small)
    assert 0 < max(stream_plan(small.cost, small.budget_bytes, longest, "bfloat16").experts_per_chunk) < 8, chunked.how
    for ids in SEQUENCES:
        assert rel_rms(chunked.fp32.states(ids), refs.fp32.states(ids)) < 1e-5


@pytest.mark.parametrize(("kw", "param"), [
    ({"depth": 1}, "seed.depth"),
    ({"depth": 62}, "seed.depth"),
    ({"depth": 4, "layer_ids": [2, 3, 5]}, "extract.layer_ids"),
    ({"depth": 4, "width": {"num_experts_per_tok": 9, "n_routed_experts": 8}}, "seed.width.num_experts_per_tok"),
    ({"depth": 4, "width": {"n_routed_experts": 0}}, "seed.width.n_routed_experts"),
    ({"depth": 4, "width": {"moe_intermediate_size": 40}}, "seed.width.moe_intermediate_size"),
    ({"depth": 4, "width": {"num_hidden_layers": 8}}, "seed.width"),
    ({"depth": 4, "width": {"vocab_size": 500}}, "seed.width.vocab_size"),
])
def test_bad_input_is_refused_naming_the_param(kw: dict, param: str, tmp_path: Path):
    with pytest.raises(PipelineError) as err:
        seed_config(**kw)
    assert str(err.value).startswith(param + ":"), str(err.value)
    with pytest.raises(PipelineError):  # the writer refuses it before making anything
        write_seed_shape(tmp_path / "out", device="cpu", **kw)
    assert not (tmp_path / "out").exists()


def test_full_seed_shape_config_is_kimi_k25():
    cfg = seed_config()
    assert (cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["vocab_size"], cfg["num_hidden_layers"]) == (7168, 384, 8, 2048, 163840, 4)
    assert seed_config(4, layer_ids=[2, 3, 4])["num_hidden_layers"] == 4


def test_reference_budget_below_the_smallest_unit_is_refused_at_full_width():
    """The H200 run's budget check, from the config alone (no weights): names the param and the smallest budget."""
    cfg = seed_config()
    with pytest.raises(PipelineError) as err:
        check_reference_budget(cfg, 1.0, 2048)
    message = str(err.value)
    assert message.startswith("verify.reference_memory_gib: 1.0 GiB is below") and "set it to at least" in message
    smallest = float(message.split("at least ")[1].split(" GiB")[0])
    plan = check_reference_budget(cfg, 16.0, 2048)  # the bench's budget, below the 4-layer model's size
    assert smallest < 16.0 and plan.peak_bytes <= 16 * GIB
    assert 1 <= max(plan.experts_per_chunk) < 384  # the experts go in chunks
    # on a GPU the checkpoint's bytes as read stay in host memory: a smaller smallest budget, bigger chunks
    with pytest.raises(PipelineError) as err:
        check_reference_budget(cfg, 1.0, 2048, on_gpu=True)
    on_gpu_smallest = float(str(err.value).split("at least ")[1].split(" GiB")[0])
    on_gpu = check_reference_budget(cfg, 16.0, 2048, on_gpu=True)
    assert on_gpu_smallest < smallest and max(plan.experts_per_chunk) < max(on_gpu.experts_per_chunk) < 384


@pytest.mark.parametrize(("args", "param", "hint"), [
    (["--seed-depth", "1"], "seed.depth", "at least 2"),
    (["--seed-depth", "3"], "extract.layer_ids", "[4] out of range"),  # the job's layers [2, 3, 4] at depth 3
    (["--seed-reference-gib", "1e-5"], "verify.reference_memory_gib", "set it to at least"),
])
def test_bench_seed_job_refuses_bad_params_before_any_step(args: list[str], param: str, hint: str, tmp_path: Path):
    """The GPU bench's seed job (bench/gpu_extract_bench.py, the real process, smoke width): a depth, layer id or
    reference budget the shape cannot hold stops it before its first step (no child, no model built)."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_extract_bench.py"), "--smoke", "--jobs", "seed",
                           "--out", str(out), "--work", str(work), *args],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert f"error: {param}:" in proc.stderr and hint in proc.stderr, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["jobs"] == {} and not (work / "models").exists() and "START" not in proc.stdout
