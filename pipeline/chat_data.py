"""The one reader of chat JSONL data: every line checked, any bad one named by file and line, before work.

Used by every stage that reads conversations (regenerate, prepare). Accepts OpenAI
`{"messages": [{"role", "content"}]}` and ShareGPT `{"conversations": [{"from", "value"}]}` lines.
A line that is not UTF-8, not JSON, not a conversation, or has no assistant turn is refused with
`file:line` and the fix (`on_error: fail`), or counted and left out (`on_error: skip`); a missing
or empty file is always refused. Reading is cheap and comes first (`read_chat`); rendering with
the target's chat template (`tokenize_chats`) needs the tokenizer and comes second.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from pipeline.errors import PipelineError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
COUNTS = ("conversations_read", "skipped_malformed", "skipped_no_assistant")
BOM = "\ufeff"


class DataError(PipelineError):
    pass


class Malformed(ValueError):
    """A line that cannot be a conversation; the message says why."""


class NoAssistant(ValueError):
    pass


@dataclass
class Chat:
    line: int  # in the original data file
    messages: list[dict]


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


def _decode(raw: bytes, first: bool) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as "
                        "UTF-8") from None
    return text.removeprefix(BOM) if first else text


def _refuse_or_count(path: Path, line_no: int, e: ValueError, on_error: str, counts: Counter) -> None:
    if on_error == "fail":
        raise DataError(f"{path}:{line_no}: {e}; fix the line or set data.on_error: skip") from None
    counts["skipped_no_assistant" if isinstance(e, NoAssistant) else "skipped_malformed"] += 1


def read_chat(path: Path, on_error: str, counts: Counter, line_key: str | None = None) -> list[Chat]:
    """The conversations of a chat JSONL file, checked line by line; `line_key` names a field that
    holds the line number in the original data file (the regenerate stage's output keeps it)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path: {path} not found; point data.path at a chat JSONL file")
    chats = []
    for k in COUNTS:
        counts.setdefault(k, 0)
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named, not a UnicodeDecodeError
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            counts["conversations_read"] += 1
            try:
                text = _decode(raw, line_no == 1)
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise Malformed(f"not valid JSON ({e.msg} at column {e.colno})") from None
                messages = parse_record(record)
                if line_key is not None:
                    line_no = record[line_key]
            except (Malformed, NoAssistant) as e:
                _refuse_or_count(path, line_no, e, on_error, counts)
                continue
            chats.append(Chat(line_no, messages))
    if counts["conversations_read"] == 0:
        raise DataError(f"data.path: {path} is empty: it holds no usable conversation; point data.path at a chat "
                        "JSONL file with one conversation per line")
    if not chats:
        raise DataError(f"data.path: {path} holds no usable conversation ({counts['conversations_read']} read, "
                        f"{counts['skipped_malformed']} malformed, {counts['skipped_no_assistant']} without an "
                        "assistant turn)")
    return chats


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


def tokenize_chats(path: Path, chats: list[Chat], tok, on_error: str, counts: Counter) -> list[Conversation]:
    """`chats` rendered with the target's template; one the template rejects is refused or counted."""
    convs = []
    for c in chats:
        try:
            ids, mask = tokenize(tok, c.messages)
        except DataError:
            raise
        except Exception as e:  # the template refusing a conversation (e.g. raise_exception)
            _refuse_or_count(path, c.line, Malformed(f"the chat template rejects it: {e}"), on_error, counts)
            continue
        convs.append(Conversation(c.line, c.messages, ids, mask))
    if not convs:
        raise DataError(f"data.path: {path} holds no usable conversation ({counts['conversations_read']} read, "
                        f"{counts['skipped_malformed']} malformed, {counts['skipped_no_assistant']} without an "
                        "assistant turn)")
    return convs
