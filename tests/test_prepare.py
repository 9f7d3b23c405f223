"""Prepare stage and the embedded corpus/tokenizer: real tokenizer, real files, no mocks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import save_file

from pipeline import chat_data
from pipeline.chat_data import DataError
from pipeline.embedded import corpus
from pipeline.embedded.tokenizer import CHAT_TEMPLATE, corpus_texts, save_tokenizer, train_tokenizer
from pipeline.layout import HELDOUT_PROMPTS, PREPARED_DATASET, PREPARED_DIR, TOKEN_FREQ
from pipeline.params import DataParams
from pipeline.stages import prepare
from pipeline.target import Target, fingerprint_model_dir, write_target

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "data" / "chat.jsonl"
GOLDEN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome!"},
]


@pytest.fixture(scope="session")
def shipped() -> list[dict]:
    return [json.loads(line) for line in SHIPPED.read_text().splitlines()]


@pytest.fixture(scope="session")
def tok(shipped):
    return train_tokenizer(corpus_texts(shipped), 1024)


def make_target_dir(path: Path, tok, chat_template: bool = True) -> Path:
    """A tokenizer plus the config.json fields later stages read, and a stand-in weights file."""
    save_tokenizer(tok, path)
    if not chat_template:
        (path / "chat_template.jinja").unlink()
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 32, "vocab_size": len(tok)}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(1)}, path / "model.safetensors")
    return path


@pytest.fixture(scope="session")
def target_dir(tok, tmp_path_factory) -> Path:
    return make_target_dir(tmp_path_factory.mktemp("target"), tok)


@pytest.fixture
def workdir(tmp_path, monkeypatch, target_dir) -> Path:
    monkeypatch.chdir(tmp_path)
    write_target(Target(path=target_dir, embedded=False, fingerprint=fingerprint_model_dir(target_dir)))
    return tmp_path


def write_lines(path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                         {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]}


def metrics(workdir: Path) -> dict:
    return json.loads((workdir / "metrics" / "prepare.json").read_text())


# --- corpus and tokenizer ---------------------------------------------------------------------

def test_corpus_is_deterministic_and_matches_the_shipped_file():
    assert corpus.generate() == corpus.generate()
    assert corpus.to_jsonl(corpus.generate()) == SHIPPED.read_text()
    assert corpus.generate(seed=1) != corpus.generate()
    assert SHIPPED.stat().st_size < 1_000_000


def test_tokenizer_training_is_deterministic(shipped, tok):
    again = train_tokenizer(corpus_texts(shipped), 1024)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(tok) == 1024


def test_golden_token_ids_and_mask(tok):
    ids, mask = chat_data.tokenize(tok, GOLDEN)
    assert ids == [1, 3, 39, 74, 282, 319, 74, 75, 19, 2, 4, 362, 267, 226, 22, 23, 355, 226, 24, 21, 36, 2, 5, 22,
                   23, 355, 226, 24, 21, 294, 226, 25, 23, 19, 2, 4, 970, 6, 2, 5, 337, 323, 724, 6, 2]
    assert mask == [0] * 23 + [1] * 12 + [0] * 5 + [1] * 5
    # exactly the assistant contents, each closed by its end-of-turn token
    assert tok.decode([t for t, m in zip(ids, mask, strict=False) if m]) == "12 + 30 = 42.<|end|>You are welcome!<|end|>"


def test_mask_without_generation_tags_matches(tok, shipped):
    """The fallback for templates without {% generation %} finds the same tokens."""
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain_tok = train_tokenizer(corpus_texts(shipped[:50]), 300)
    plain_tok.chat_template = plain
    tagged_tok = train_tokenizer(corpus_texts(shipped[:50]), 300)
    for conv in shipped[:30] + [{"messages": GOLDEN}]:
        assert chat_data.tokenize(plain_tok, conv["messages"]) == chat_data.tokenize(tagged_tok, conv["messages"])


# --- the stage --------------------------------------------------------------------------------

def test_prepare_shipped_corpus(workdir, shipped, tok):
    prepare.run(DataParams(path=str(SHIPPED)))
    m = metrics(workdir)
    ds = load_from_disk(str(PREPARED_DATASET))
    heldout = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines()]
    assert m["conversations_read"] == len(shipped) == m["kept"] + m["heldout"]
    assert m["heldout"] == len(heldout) == round(0.1 * len(shipped))
    assert ds["sample_id"] == list(range(len(ds)))
    assert ds["source_line"] == sorted(ds["source_line"])
    assert not set(ds["source_line"]) & {h["source_line"] for h in heldout}
    row = ds[0]
    assert row["seq_len"] == len(row["input_ids"]) == len(row["loss_mask"])
    assert (row["input_ids"], row["loss_mask"]) == chat_data.tokenize(tok, shipped[row["source_line"] - 1]["messages"])
    freq = json.loads(TOKEN_FREQ.read_text())
    assert len(freq) == len(tok) and sum(freq) == m["masked_tokens"] == sum(sum(x) for x in ds["loss_mask"])
    h = heldout[0]
    source = shipped[h["source_line"] - 1]["messages"]
    assert h["messages"] == source[: len(h["messages"])] and h["messages"][-1]["role"] == "user"
    assert h["reference"] == source[len(h["messages"])]["content"]


def test_outputs_are_byte_identical_across_runs(workdir):
    data = write_lines(workdir / "d.jsonl", [chat(i) for i in range(40)])

    def digest() -> dict:
        prepare.run(DataParams(path=data))
        return {str(p.relative_to(PREPARED_DIR)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(PREPARED_DIR.rglob("*")) if p.is_file()}

    first = digest()
    assert any("arrow" in name for name in first)
    assert digest() == first


def test_sharegpt_records_match_openai(workdir):
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello there."}]}
    openai = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello there."}]}
    prepare.run(DataParams(path=write_lines(workdir / "d.jsonl", [sharegpt, openai]), heldout_fraction=0))
    ds = load_from_disk(str(PREPARED_DATASET))
    assert len(ds) == 2 and ds[0]["input_ids"] == ds[1]["input_ids"] and ds[0]["loss_mask"] == ds[1]["loss_mask"]


def test_malformed_line_names_file_and_line(workdir):
    data = write_lines(workdir / "d.jsonl", [chat(1), chat(2), '{"messages": [', chat(3)])
    with pytest.raises(DataError, match=r"d\.jsonl:3: not valid JSON.*on_error: skip"):
        prepare.run(DataParams(path=data))


@pytest.mark.parametrize("bad, why", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "role='robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "string 'content'"),
    ({"text": "hello"}, "neither 'messages'"),
    ({"messages": []}, "non-empty list"),
])
def test_invalid_records_are_rejected(workdir, bad, why):
    data = write_lines(workdir / "d.jsonl", [chat(1), bad])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: .*{why}"):
        prepare.run(DataParams(path=data))


def test_skip_mode_counts(workdir):
    no_assistant = {"messages": [{"role": "user", "content": "Hello?"}]}
    lines = [chat(1), "not json", chat(2), no_assistant, "", {"conversations": [{"from": "bot", "value": "x"}]}, chat(3)]
    prepare.run(DataParams(path=write_lines(workdir / "d.jsonl", lines), on_error="skip", heldout_fraction=0))
    m = metrics(workdir)
    assert (m["conversations_read"], m["skipped_malformed"], m["skipped_no_assistant"], m["kept"]) == (6, 2, 1, 3)
    assert load_from_disk(str(PREPARED_DATASET))["source_line"] == [1, 3, 7]


def test_no_assistant_turn_fails_naming_the_line(workdir):
    data = write_lines(workdir / "d.jsonl", [chat(1), {"messages": [{"role": "user", "content": "Hello?"}]}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: has no assistant turn"):
        prepare.run(DataParams(path=data))


def test_empty_dataset_fails(workdir):
    data = write_lines(workdir / "d.jsonl", [])
    with pytest.raises(DataError, match="no usable conversation"):
        prepare.run(DataParams(path=data))
    with pytest.raises(DataError, match="not found"):
        prepare.run(DataParams(path="missing.jsonl"))
    assert not PREPARED_DIR.exists()


def test_not_utf8_is_named_not_a_traceback(workdir):
    data = workdir / "d.jsonl"
    latin1 = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9?"}, {"role": "assistant", "content": "Oui."}]},
                        ensure_ascii=False).encode("latin-1")
    data.write_bytes((json.dumps(chat(1)) + "\n").encode() + latin1 + b"\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0xe9 at column \d+\).*UTF-8.*on_error: skip"):
        prepare.run(DataParams(path=str(data)))
    assert not PREPARED_DIR.exists()
    prepare.run(DataParams(path=str(data), on_error="skip", heldout_fraction=0))
    assert (metrics(workdir)["skipped_malformed"], metrics(workdir)["kept"]) == (1, 1)


def test_a_file_of_blank_lines_is_empty_and_a_bom_is_accepted(workdir):
    empty = workdir / "empty.jsonl"
    empty.write_text("\n\n  \n")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        prepare.run(DataParams(path=str(empty)))
    bom = workdir / "bom.jsonl"
    bom.write_text("\ufeff" + json.dumps(chat(1)) + "\n" + json.dumps(chat(2)) + "\n", encoding="utf-8")
    prepare.run(DataParams(path=str(bom), heldout_fraction=0))
    assert metrics(workdir)["kept"] == 2


def test_read_chat_needs_no_target(tmp_path):
    """read_chat needs no target: the stages call it before anything expensive."""
    from collections import Counter

    data = write_lines(tmp_path / "d.jsonl", [chat(1), '{"messages": ['])
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        chat_data.read_chat(Path(data), "fail", Counter())
    counts = Counter()
    assert [c.line for c in chat_data.read_chat(Path(data), "skip", counts)] == [1]
    assert (counts["conversations_read"], counts["skipped_malformed"]) == (2, 1)


def test_missing_chat_template_fails_early(tmp_path, monkeypatch, tok):
    bare = make_target_dir(tmp_path / "bare", tok, chat_template=False)
    monkeypatch.chdir(tmp_path)
    write_target(Target(path=bare, embedded=False, fingerprint=fingerprint_model_dir(bare)))
    data = write_lines(tmp_path / "d.jsonl", [chat(1)])
    with pytest.raises(DataError, match=r"bare/tokenizer_config\.json: .*no chat template"):
        prepare.run(DataParams(path=data))


def test_overlong_truncated_or_skipped(workdir):
    long = {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one " * 40}]}
    data = write_lines(workdir / "d.jsonl", [chat(1), long, chat(2)])
    prepare.run(DataParams(path=data, seq_len=24, heldout_fraction=0))
    m, ds = metrics(workdir), load_from_disk(str(PREPARED_DATASET))
    assert (m["truncated"], m["skipped_overlong"], m["kept"]) == (1, 0, 3)
    assert max(ds["seq_len"]) == 24
    prepare.run(DataParams(path=data, seq_len=24, heldout_fraction=0, on_overlong="skip"))
    assert (metrics(workdir)["skipped_overlong"], metrics(workdir)["kept"]) == (1, 2)


def test_max_samples_caps_training_set(workdir):
    prepare.run(DataParams(path=write_lines(workdir / "d.jsonl", [chat(i) for i in range(20)]),
                           max_samples=5, heldout_fraction=0.2))
    m = metrics(workdir)
    assert (m["kept"], m["heldout"], m["capped"]) == (5, 4, 11)
