"""Model stage: a local model dir is checked and fingerprinted; the embedded target builds end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.layout import MODEL_DIR, TARGET_JSON
from pipeline.params import EmbeddedModelParams, ModelParams
from pipeline.stages import model
from pipeline.target import TargetError, load_target


def fake_model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 500}))
    (path / "tokenizer.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (path / "model.safetensors").write_bytes(b"\0" * 100)
    return path


def resolve(path: Path) -> dict:
    model.run(ModelParams(path=str(path)))
    return json.loads(TARGET_JSON.read_text())


def test_local_model_is_fingerprinted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = fake_model_dir(tmp_path / "m")
    MODEL_DIR.mkdir(parents=True)
    (MODEL_DIR / "model.safetensors").write_bytes(b"stale embedded build")
    first = resolve(src)
    assert first["path"] == str(src) and first["embedded"] is False
    assert sorted(p.name for p in MODEL_DIR.iterdir()) == ["target.json"]
    assert load_target().fingerprint == first["fingerprint"]
    assert json.loads((tmp_path / "metrics" / "model.json").read_text())["embedded"] is False

    assert resolve(src)["fingerprint"] == first["fingerprint"]
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 9, "hidden_size": 64, "vocab_size": 500}))
    second = resolve(src)["fingerprint"]
    assert second["sha256"] != first["fingerprint"]["sha256"]
    (src / "model.safetensors").write_bytes(b"\0" * 101)
    assert resolve(src)["fingerprint"]["sha256"] != second["sha256"]


def test_model_changed_after_the_stage_is_caught(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = fake_model_dir(tmp_path / "m")
    resolve(src)
    (src / "model-00002.safetensors").write_bytes(b"\0")
    with pytest.raises(TargetError, match="changed since the model stage"):
        load_target()


@pytest.mark.parametrize("remove, why", [
    ("config.json", "lacks config.json"),
    ("model.safetensors", "no weight files"),
    ("tokenizer.json", "no tokenizer"),
    ("chat_template.jinja", "no chat template"),
])
def test_incomplete_model_dir_is_a_clear_error(tmp_path, monkeypatch, remove, why):
    monkeypatch.chdir(tmp_path)
    src = fake_model_dir(tmp_path / "m")
    (src / remove).unlink()
    with pytest.raises(TargetError, match=why):
        resolve(src)


def test_chat_template_in_tokenizer_config_counts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = fake_model_dir(tmp_path / "m")
    (src / "chat_template.jinja").unlink()
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert resolve(src)["fingerprint"]["files"]["tokenizer_config.json"]


def test_missing_dir_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TargetError, match="not a directory"):
        resolve(tmp_path / "nope")


def test_embedded_model_builds_and_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = EmbeddedModelParams(num_layers=4, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                               vocab_size=300, train_steps=5, train_batch_size=2, train_seq_len=32)
    model.run(ModelParams(embedded=tiny))

    target = load_target()
    assert target.embedded and str(target.path) == "artifacts/model" and target.num_layers == 4
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    # trained in fp32, saved in the dtype vLLM serves it in on CPU: no tensor narrowed as the engine loads it
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    tok_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == (MODEL_DIR / "chat_template.jinja").read_text()
    m = json.loads((tmp_path / "metrics" / "model.json").read_text())
    assert m["steps"] == 5 and m["parameters"] > 0 and m["final_loss"] > 0
    assert m["device"] == "cpu" and m["precision"] == "float32" and m["train_tokens_per_second"] > 0
    assert m["saved_dtype"] == "bfloat16"
    assert 0 <= m["unseen_assistant_accuracy"] <= 1

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    lm = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)  # widened exactly, as extract reads it
    assert lm.dtype == torch.float32 and lm.config.vocab_size == len(tok) == 300
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = lm.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 3 or out[0, -1] == tok.eos_token_id


def test_embedded_deepseek_v3_builds_with_the_keys_vllm_needs(tmp_path, monkeypatch):
    from pipeline.params import DeepseekV3Params

    monkeypatch.chdir(tmp_path)
    tiny = EmbeddedModelParams(architecture="deepseek_v3", num_layers=4, hidden_size=32, num_heads=2, intermediate_size=64,
                               vocab_size=300, train_steps=3, train_batch_size=2, train_seq_len=32,
                               deepseek_v3=DeepseekV3Params(n_routed_experts=4, moe_intermediate_size=16, q_lora_rank=16))
    model.run(ModelParams(embedded=tiny))

    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"  # else vLLM fails to load it
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["n_shared_experts"]) == (4, 2, 1)
    m = json.loads((tmp_path / "metrics" / "model.json").read_text())
    assert m["architecture"] == "deepseek_v3" and m["steps"] == 3
    lm = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert type(lm).__name__ == "DeepseekV3ForCausalLM" and load_target().num_layers == 4


def test_the_stage_trains_with_the_pinned_cpu_arithmetic_whatever_the_caller_set(tmp_path):
    """`python -m pipeline run model` as DVC runs it: ATEN_CPU_CAPABILITY / MKL_CBWR from the caller (or
    the machine's own choice) and the core count do not reach the training; the pins and the constant
    thread count do, and metrics/model.json says so (pipeline/training/cpu_determinism.py)."""
    import os
    import subprocess
    import sys

    import yaml

    from pipeline.training import cpu_determinism

    root = Path(__file__).resolve().parents[1]
    tiny = {"num_layers": 4, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
            "vocab_size": 300, "train_steps": 3, "train_batch_size": 2, "train_seq_len": 32}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"embedded": tiny}}))
    env = {**os.environ, "PYTHONPATH": str(root), "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
           "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "model"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ATEN_CPU_CAPABILITY=default overridden by avx2" in proc.stderr
    assert "MKL_CBWR=COMPATIBLE overridden by AVX2" in proc.stderr
    m = json.loads((tmp_path / "metrics" / "model.json").read_text())
    assert m["threads"] == cpu_determinism.TRAINING_THREADS == 1
    arithmetic = m["cpu_arithmetic"]
    assert arithmetic["pinned"] is True and arithmetic["cpu_capability"] == "AVX2"
    assert {k: arithmetic[k] for k in cpu_determinism.PINNED_ENV} == cpu_determinism.PINNED_ENV


def test_pins_set_after_torch_is_imported_are_refused():
    """ATen and MKL read their variables once: a pin set after torch is loaded would silently not apply."""
    from pipeline.training import cpu_determinism

    assert "torch" in sys.modules
    with pytest.raises(cpu_determinism.PinTooLate, match="set them before the stage's module is imported"):
        cpu_determinism.pin_environment({})
