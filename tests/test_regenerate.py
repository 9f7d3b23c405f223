"""regenerate stage: the target (in real vLLM) rewrites the assistant turns; prepare trains on them.

A tiny random Llama with the embedded chat tokenizer. The regenerated first turn of a conversation
must be exactly the target's greedy continuation computed independently with transformers; a
kill -9 between chunks resumes to the same output; prepare refuses stale regenerated data.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.chat_data import DataError
from pipeline.target import Target, fingerprint_model_dir, write_target
from tests.conftest import run_stage
from tests.kill_from_outside import kill_at_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
NUM_CONVERSATIONS = 9
REGEN = {"enabled": True, "max_tokens": 10, "conversations_per_chunk": 3, "max_num_seqs": 16}


def data_params(chat: Path, **regenerate) -> dict:
    return {"path": str(chat), "seq_len": 256, "heldout_fraction": 0.2, "regenerate": {**REGEN, **regenerate}}


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Target:
    """A random fp32 Llama whose tokenizer (and chat template) is the embedded one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.embedded.tokenizer import END, corpus_texts, save_tokenizer, train_tokenizer

    shipped = [json.loads(line) for line in (ROOT / "data" / "chat.jsonl").read_text().splitlines()]
    tok = train_tokenizer(corpus_texts(shipped), 512)
    model_dir = tmp_path_factory.mktemp("chat-llama")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids(END))
    model = LlamaForCausalLM(config).eval()
    # a strong end-of-turn row: greedy turns end after a few tokens, so stopping is tested too
    model.lm_head.weight.data[config.eos_token_id] *= 40
    model.save_pretrained(model_dir)
    save_tokenizer(tok, model_dir)
    return Target(path=model_dir, embedded=False, fingerprint=fingerprint_model_dir(model_dir))


@pytest.fixture(scope="module")
def project(chat_target: Target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("regen-project")
    write_target(chat_target, root / layout.TARGET_JSON)
    lines = (ROOT / "data" / "chat.jsonl").read_text().splitlines()[:NUM_CONVERSATIONS]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    (root / "params.yaml").write_text(yaml.safe_dump({"data": data_params(root / "chat.jsonl")}))
    return root


@pytest.fixture(scope="module")
def regenerated(project: Path) -> list[dict]:
    """One uninterrupted run through the CLI (the launcher, as dvc.yaml runs it)."""
    cli(project)
    return [json.loads(line) for line in (project / layout.REGENERATED_CONVERSATIONS).read_text().splitlines()]


def cli(project: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pipeline", "run", "regenerate"], cwd=project, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_assistant_turns_are_the_targets_greedy_responses(regenerated: list[dict], project: Path, chat_target: Target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = [json.loads(line) for line in (project / "chat.jsonl").read_text().splitlines()]
    assert [r["source_line"] for r in regenerated] == list(range(1, NUM_CONVERSATIONS + 1))
    metrics = json.loads((project / layout.METRICS / "regenerate.json").read_text())
    total_turns = sum(m["role"] == "assistant" for o in original for m in o["messages"])
    assert metrics["turns_regenerated"] == total_turns and metrics["conversations"] == NUM_CONVERSATIONS
    assert 0 < metrics["turns_cut_at_max_tokens"] < total_turns, "some turns must end at the end-of-turn token"
    for new, old in zip(regenerated, original, strict=True):
        # user/system turns kept verbatim, every assistant turn rewritten
        assert [m for m in new["messages"] if m["role"] != "assistant"] == [m for m in old["messages"] if m["role"] != "assistant"]
        assert all(a["content"] != b["content"] for a, b in zip(new["messages"], old["messages"], strict=True) if a["role"] == "assistant")

    tok = AutoTokenizer.from_pretrained(chat_target.path)
    model = AutoModelForCausalLM.from_pretrained(chat_target.path, torch_dtype=torch.float32).eval()
    for conv in regenerated:
        first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
        text = tok.apply_chat_template(conv["messages"][:first], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=REGEN["max_tokens"], do_sample=False, eos_token_id=model.config.eos_token_id)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert conv["messages"][first]["content"] == expected


def test_prepare_trains_on_the_regenerated_turns(regenerated: list[dict], project: Path, chat_target: Target):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    run_stage(project, "prepare", **data_params(project / "chat.jsonl"))
    ds = load_from_disk(str(project / layout.PREPARED_DATASET))
    tok = AutoTokenizer.from_pretrained(chat_target.path)
    by_line = {r["source_line"]: r for r in regenerated}
    for row in ds:
        conv = by_line[row["source_line"]]
        masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m], skip_special_tokens=True)
        assert masked == "".join(m["content"] for m in conv["messages"] if m["role"] == "assistant")


def test_prepare_refuses_regenerated_data_from_other_params(regenerated: list[dict], project: Path):
    with pytest.raises(DataError, match=r"differs in regenerate.*dvc repro regenerate"):
        run_stage(project, "prepare", **data_params(project / "chat.jsonl", max_tokens=11))


def test_kill9_between_chunks_then_resume(regenerated: list[dict], project: Path, tmp_path: Path):
    copy = tmp_path / "p"
    copy.mkdir()
    for name in ("params.yaml", "chat.jsonl"):
        (copy / name).write_text((project / name).read_text())
    (copy / layout.TARGET_JSON).parent.mkdir(parents=True)
    (copy / layout.TARGET_JSON).write_text((project / layout.TARGET_JSON).read_text())
    (copy / "params.yaml").write_text(yaml.safe_dump({"data": data_params(copy / "chat.jsonl")}))

    # SIGKILL from outside once the first chunk file is renamed into place (inotify); the next
    # chunk is a whole chunk of generation away, so the kill lands between chunks
    chunk = re.compile(r"chunk-\d{5}\.jsonl")
    r = kill_at_file(copy, "regenerate", copy / layout.REGENERATED_DIR, None,
                     lambda event, name: event == "moved_to" and bool(chunk.fullmatch(name)))
    assert r.killed and r.returncode == -signal.SIGKILL, f"rc {r.returncode}, saw {r.seen}\n{r.log[-3000:]}"
    left = sorted(p.name for p in (copy / layout.REGENERATED_DIR).iterdir() if chunk.fullmatch(p.name))
    assert left == ["chunk-00000.jsonl"], left
    assert not (copy / layout.REGENERATED_CONVERSATIONS).exists()
    cli(copy)
    metrics = json.loads((copy / layout.METRICS / "regenerate.json").read_text())
    assert metrics["chunks_resumed"] == 1
    assert (copy / layout.REGENERATED_CONVERSATIONS).read_text() == (project / layout.REGENERATED_CONVERSATIONS).read_text()
    assert sorted(p.name for p in (copy / layout.REGENERATED_DIR).iterdir()) == ["conversations.jsonl", "regenerate.json"]
