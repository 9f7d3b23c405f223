"""Prepare stage: chat JSONL -> tokenized samples with an assistant loss mask, plus held-out eval prompts.

Accepts OpenAI `{"messages": [{"role", "content"}]}` and ShareGPT
`{"conversations": [{"from", "value"}]}` lines. Conversations are rendered with the target's own
chat template, so the draft trains on exactly the tokens the target sees when serving.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from datasets import Dataset, Features, List, Value

from pipeline.atomic import atomic_dir, atomic_write_text
from pipeline.chat_data import Conversation, DataError, load_tokenizer, read_chat, tokenize_chats
from pipeline.console import say
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
from pipeline.workflow import invalidation

METRICS_JSON = METRICS / "prepare.json"
FEATURES = Features({
    "sample_id": Value("int64"),
    "source_line": Value("int64"),
    "input_ids": List(Value("int64")),
    "loss_mask": List(Value("int64")),
    "seq_len": Value("int64"),
})


def heldout_record(sample_id: int, conv: Conversation) -> dict:
    first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return {"sample_id": sample_id, "source_line": conv.line, "messages": conv.messages[:first],
            "reference": conv.messages[first]["content"]}


def regenerated_source(path: Path, params: DataParams) -> dict:
    """The regenerate stage's provenance, checked against these params and data.path's content."""
    if not REGENERATED_META.is_file():
        raise DataError(f"data.regenerate.enabled is true but {REGENERATED_META} is missing; "
                        "run the regenerate stage first (`dvc repro` or `make prepare` runs it)")
    meta = json.loads(REGENERATED_META.read_text())
    expected = {"enabled": True, "source_sha256": sha256_file(path), "regenerate": invalidation.regenerated_params(params),
                "seq_len": params.seq_len, "on_error": params.on_error}
    stale = [k for k, v in expected.items() if meta.get(k) != v]
    if stale:
        raise DataError(f"{REGENERATED_META} was made from other inputs (differs in {', '.join(stale)}); "
                        "re-run the regenerate stage (`dvc repro regenerate`)")
    return meta


def run(params: DataParams) -> None:
    path = Path(params.path)
    counts = Counter({k: 0 for k in ("conversations_read", "skipped_malformed", "skipped_no_assistant",
                                     "truncated", "skipped_overlong", "capped")})
    # every line checked before the target loads (pipeline/chat_data.py)
    if params.regenerate.enabled:
        if not path.is_file():
            raise DataError(f"data.path: {path} not found; point data.path at a chat JSONL file")
        source = regenerated_source(path, params)
        chats = read_chat(REGENERATED_CONVERSATIONS, "fail", counts, line_key="source_line")
        counts.update({k: v for k, v in source["counts"].items() if k.startswith("skipped_")})
        tokens_of = (REGENERATED_CONVERSATIONS, "fail")
    else:
        chats = read_chat(path, params.on_error, counts)
        tokens_of = (path, params.on_error)
    target = load_target()
    tok = load_tokenizer(target)
    convs = tokenize_chats(tokens_of[0], chats, tok, tokens_of[1], counts)

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
    dropped = {k: v for k, v in counts.items() if k != "conversations_read" and v}
    say(f"[prepare] {counts.get('conversations_read')} conversations read: {len(samples)} to train on "
        f"({metrics['tokens']:,} tokens, {metrics['masked_tokens']:,} of them assistant turns), {len(heldout)} held out "
        "for eval" + ("; " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in dropped.items()) if dropped else "")
        + f" ({METRICS_JSON})")
