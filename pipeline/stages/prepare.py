"""Prepare stage: chat JSONL -> tokenized samples with an assistant loss mask, plus held-out eval prompts.

Accepts OpenAI `{"messages": [{"role", "content"}]}` and ShareGPT
`{"conversations": [{"from", "value"}]}` lines. Conversations are rendered with the target's own
chat template, so the draft trains on exactly the tokens the target sees when serving.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, Features, List, Value
from transformers import AutoTokenizer

from pipeline import invalidation
from pipeline.atomic import atomic_dir, atomic_write_text
from pipeline.errors import PipelineError
from pipeline.layout import (
    HELDOUT_PROMPTS,
    METRICS,
    PREPARED_DATASET,
    PREPARED_DIR,
    REGENERATED_CONVERSATIONS,
    REGENERATED_META,
    TOKEN_FREQ,
)
from pipeline.params import DataParams
from pipeline.target import load_target, sha256_file, sha256_json

METRICS_JSON = METRICS / "prepare.json"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
FEATURES = Features({
    "sample_id": Value("int64"),
    "source_line": Value("int64"),
    "input_ids": List(Value("int64")),
    "loss_mask": List(Value("int64")),
    "seq_len": Value("int64"),
})


class DataError(PipelineError):
    pass


class Malformed(ValueError):
    """A line that cannot be a conversation; the message says why."""


class NoAssistant(ValueError):
    pass


@dataclass
class Conversation:
    line: int
    messages: list[dict]
    input_ids: list[int]
    loss_mask: list[int]


def parse_record(obj) -> list[dict]:
    """An OpenAI or ShareGPT record -> OpenAI messages; raises Malformed / NoAssistant."""
    if not isinstance(obj, dict):
        raise Malformed("not a JSON object")
    if "messages" in obj:
        turns, role_key, content_key, roles = obj["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in obj:
        turns, role_key, content_key, roles = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise Malformed("has neither 'messages' (OpenAI format) nor 'conversations' (ShareGPT format)")
    if not isinstance(turns, list) or not turns:
        raise Malformed("the conversation must be a non-empty list of turns")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get(content_key), str):
            raise Malformed(f"turn {i} must be an object with a string '{content_key}'")
        if t.get(role_key) not in roles:
            raise Malformed(f"turn {i} has {role_key}={t.get(role_key)!r}; expected one of {sorted(roles)}")
        messages.append({"role": roles[t[role_key]], "content": t[content_key]})
    roles_seen = [m["role"] for m in messages]
    if "assistant" not in roles_seen:
        raise NoAssistant("has no assistant turn, so nothing to train on")
    if "user" not in roles_seen[: roles_seen.index("assistant")]:
        raise Malformed("the first assistant turn has no user turn before it")
    return messages


def tokenize(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask of assistant content + end-of-turn tokens."""
    if GENERATION_TAG.search(tok.chat_template):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    return tokenize_by_prefix(tok, messages)


def tokenize_by_prefix(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Mask without `{% generation %}`: an assistant turn spans from the end of the rendered prompt
    (history + generation prompt) to the end of the history rendered with that turn, trailing
    whitespace excluded. Needs a template whose renderings of shorter histories are prefixes."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise DataError(
                "the target's chat template renders earlier turns differently once later turns follow, so the "
                "assistant tokens cannot be located; add {% generation %}...{% endgeneration %} around the "
                "assistant content in the template"
            )
        spans.append((len(before), len(through)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def load_tokenizer(target):
    tok = AutoTokenizer.from_pretrained(target.path, trust_remote_code=target.trust_remote_code)
    if not tok.is_fast:
        raise DataError(f"{target.path}: the tokenizer has no fast (tokenizer.json) version; the loss mask "
                        "needs token offsets, so add a tokenizer.json")
    if not tok.chat_template:
        raise DataError(
            f"{target.path}/tokenizer_config.json: the target's tokenizer has no chat template "
            f"(nor {target.path}/chat_template.jinja); add one, the data must be rendered as the target serves it"
        )
    return tok


def read_conversations(path: Path, tok, on_error: str, counts: Counter, line_key: str | None = None) -> list[Conversation]:
    """Usable conversations of a chat JSONL; `line_key` names a field that holds the line number in
    the original data file (the regenerate stage's output keeps it), else the line in `path`."""
    if not path.is_file():
        raise DataError(f"data.path: {path} not found")
    convs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            counts["conversations_read"] += 1
            try:
                try:
                    record = json.loads(line)
                    messages = parse_record(record)
                    if line_key is not None:
                        line_no = record[line_key]
                except json.JSONDecodeError as e:
                    raise Malformed(f"not valid JSON ({e.msg} at column {e.colno})") from None
                try:
                    ids, mask = tokenize(tok, messages)
                except DataError:
                    raise
                except Exception as e:  # the template refusing a conversation (e.g. raise_exception)
                    raise Malformed(f"the chat template rejects it: {e}") from None
            except (Malformed, NoAssistant) as e:
                if on_error == "fail":
                    raise DataError(f"{path}:{line_no}: {e}; fix the line or set data.on_error: skip") from None
                counts["skipped_no_assistant" if isinstance(e, NoAssistant) else "skipped_malformed"] += 1
                continue
            convs.append(Conversation(line_no, messages, ids, mask))
    return convs


def heldout_record(sample_id: int, conv: Conversation) -> dict:
    first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return {"sample_id": sample_id, "source_line": conv.line, "messages": conv.messages[:first],
            "reference": conv.messages[first]["content"]}


def regenerated_params(params: DataParams) -> dict:
    """data.regenerate's keys that define the regenerated data (pipeline/invalidation.py): not engine tuning or chunking."""
    flat = invalidation.output_params(params, "data", "regenerate")
    return {k.removeprefix("regenerate."): v for k, v in flat.items() if k.startswith("regenerate.")}


def regenerated_source(path: Path, params: DataParams) -> dict:
    """The regenerate stage's provenance, checked against these params and data.path's content."""
    if not REGENERATED_META.is_file():
        raise DataError(f"data.regenerate.enabled is true but {REGENERATED_META} is missing; "
                        "run the regenerate stage first (`dvc repro` or `make prepare` runs it)")
    meta = json.loads(REGENERATED_META.read_text())
    expected = {"enabled": True, "source_sha256": sha256_file(path), "regenerate": regenerated_params(params),
                "seq_len": params.seq_len, "on_error": params.on_error}
    stale = [k for k, v in expected.items() if meta.get(k) != v]
    if stale:
        raise DataError(f"{REGENERATED_META} was made from other inputs (differs in {', '.join(stale)}); "
                        "re-run the regenerate stage (`dvc repro regenerate`)")
    return meta


def run(params: DataParams) -> None:
    path = Path(params.path)
    if not path.is_file():  # before loading anything
        raise DataError(f"data.path: {path} not found; point data.path at a chat JSONL file")
    target = load_target()
    tok = load_tokenizer(target)
    counts = Counter({k: 0 for k in ("conversations_read", "skipped_malformed", "skipped_no_assistant",
                                     "truncated", "skipped_overlong", "capped")})
    if params.regenerate.enabled:
        source = regenerated_source(path, params)
        convs = read_conversations(REGENERATED_CONVERSATIONS, tok, "fail", counts, line_key="source_line")
        counts.update({k: v for k, v in source["counts"].items() if k.startswith("skipped_")})
    else:
        convs = read_conversations(path, tok, params.on_error, counts)
    if not convs:
        raise DataError(f"data.path: {path} holds no usable conversation "
                        f"({counts['conversations_read']} read, {counts['skipped_malformed']} malformed, "
                        f"{counts['skipped_no_assistant']} without an assistant turn)")

    order = list(range(len(convs)))
    random.Random(params.seed).shuffle(order)
    n_heldout = min(round(len(convs) * params.heldout_fraction), len(convs) - 1)
    heldout = sorted(order[:n_heldout])

    samples = []
    for i in order[n_heldout:]:
        c = convs[i]
        if params.max_samples is not None and len(samples) == params.max_samples:
            counts["capped"] += 1
            continue
        if len(c.input_ids) > params.seq_len:
            if params.on_overlong == "skip" or not any(c.loss_mask[: params.seq_len]):
                counts["skipped_overlong"] += 1
                continue
            c.input_ids, c.loss_mask = c.input_ids[: params.seq_len], c.loss_mask[: params.seq_len]
            counts["truncated"] += 1
        samples.append(c)
    if not samples:
        raise DataError(f"data.path: {path}: no training sample left after the held-out split and "
                        f"data.on_overlong ({counts['skipped_overlong']} over data.seq_len={params.seq_len})")
    samples.sort(key=lambda c: c.line)

    vocab = target.vocab_size
    freq = [0] * vocab
    for c in samples:
        for t, m in zip(c.input_ids, c.loss_mask, strict=True):
            if t >= vocab:
                raise DataError(f"{path}:{c.line}: token id {t} >= the target's vocab_size {vocab}; "
                                "the tokenizer does not match the model's config.json")
            freq[t] += m

    columns = {
        "sample_id": list(range(len(samples))),
        "source_line": [c.line for c in samples],
        "input_ids": [c.input_ids for c in samples],
        "loss_mask": [c.loss_mask for c in samples],
        "seq_len": [len(c.input_ids) for c in samples],
    }
    # a content fingerprint instead of datasets' random one: same input -> byte-identical files
    ds = Dataset.from_dict(columns, features=FEATURES)
    ds = Dataset(ds.data, info=ds.info, fingerprint=sha256_json(columns)[:16])
    with atomic_dir(PREPARED_DIR) as tmp:
        ds.save_to_disk(tmp / PREPARED_DATASET.name)
        (tmp / HELDOUT_PROMPTS.name).write_text(
            "".join(json.dumps(heldout_record(k, convs[i])) + "\n" for k, i in enumerate(heldout)))
        (tmp / TOKEN_FREQ.name).write_text(json.dumps(freq) + "\n")

    metrics = {**counts, "kept": len(samples), "heldout": len(heldout),
               "tokens": sum(columns["seq_len"]), "masked_tokens": sum(freq)}
    atomic_write_text(METRICS_JSON, json.dumps(metrics, indent=2) + "\n")
    print("[prepare] " + ", ".join(f"{k}={v}" for k, v in metrics.items()))
