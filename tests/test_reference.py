"""verify's references: one load of a bf16 checkpoint gives the bf16 reference and, upcast, an fp32
reference identical to loading the checkpoint in fp32 (parameters, buffers, every state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.verification.reference.model import (
    FinalHeadModel,
    ReferenceModel,
    checkpoint_float_elements,
    load_final_head,
    load_references,
)
from tests.conftest import build_tiny_deepseek_v3, build_tiny_llama


def save_bf16(fp32_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.bfloat16).save_pretrained(out)
    return out


def assert_same_model(a: ReferenceModel, b: ReferenceModel) -> None:
    for named in ("named_parameters", "named_buffers"):
        ta, tb = dict(getattr(a.model, named)()), dict(getattr(b.model, named)())
        assert ta.keys() == tb.keys()
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_deepseek_v3], ids=["llama", "deepseek_v3"])
def test_one_bf16_load_gives_the_fp32_reference(build, tmp_path: Path):
    bf16_dir = save_bf16(build(tmp_path / "fp32"), tmp_path / "bf16")
    stored = checkpoint_float_elements(bf16_dir)
    assert "bfloat16" in stored and set(stored) <= {"bfloat16", "float32"}  # DeepSeek-V3 keeps a bias in fp32

    refs = load_references(bf16_dir, "bfloat16")

    assert refs.how.startswith("one bfloat16 checkpoint load"), refs.how
    assert refs.fp32.dtype == torch.float32 and refs.low is not None
    assert_same_model(refs.fp32, ReferenceModel.load(bf16_dir, "float32"))
    assert_same_model(refs.low, ReferenceModel.load(bf16_dir, "bfloat16"))
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(refs.fp32.states(ids), ReferenceModel.load(bf16_dir, "float32").states(ids))
    # the low-precision reference is a model of its own, not the upcast one's weights
    assert refs.low.states(ids).dtype == torch.bfloat16


def test_fp32_checkpoint_is_loaded_twice_for_a_bf16_capture(tmp_path: Path):
    fp32_dir = build_tiny_llama(tmp_path / "fp32")

    refs = load_references(fp32_dir, "bfloat16")

    assert refs.how.startswith("two checkpoint loads") and "stored in fp32" in refs.how
    assert_same_model(refs.fp32, ReferenceModel.load(fp32_dir, "float32"))
    assert_same_model(refs.low, ReferenceModel.load(fp32_dir, "bfloat16"))
    assert load_references(fp32_dir, "float32").low is None


def build_tiny_tied_llama(model_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_tied_llama, build_tiny_deepseek_v3], ids=["llama", "tied", "deepseek_v3"])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_final_head_alone_predicts_as_the_full_reference(build, stored: str, tmp_path: Path):
    model_dir = build(tmp_path / "fp32")
    if stored == "bfloat16":
        model_dir = save_bf16(model_dir, tmp_path / "bf16")
    full = ReferenceModel.load(model_dir, "float32")

    head = load_final_head(model_dir)

    assert isinstance(head, FinalHeadModel), head
    states = torch.randn(50, full.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head.final_logits(states), full.final_logits(states))
    assert head.lm_head.weight.dtype == torch.float32


def test_final_head_alone_says_why_not(tmp_path: Path):
    model_dir = build_tiny_llama(tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "weights.bin.safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "weights.bin.safetensors")
    save_file({k.replace("lm_head", "output"): v for k, v in tensors.items()}, model_dir / "weights.bin.safetensors")

    why = load_final_head(model_dir)

    assert isinstance(why, str) and "lm_head.weight" in why
