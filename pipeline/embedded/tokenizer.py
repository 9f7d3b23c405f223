"""A byte-level BPE tokenizer trained on the corpus, with a chat template transformers and vLLM read.

Turns render as `<|role|>content<|end|>` after one `<|bos|>`; `<|end|>` is the end-of-turn and the
eos token, so generation stops after one assistant turn. The assistant content and its `<|end|>`
sit inside `{% generation %}` so `apply_chat_template(..., return_assistant_tokens_mask=True)`
marks exactly the tokens a model is trained on. Every turn starts right after a special token,
so no BPE token straddles the edge of that mask.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [PAD, BOS, END] + [f"<|{r}|>" for r in ROLES]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # single digits: numbers are copied and computed digit by digit, which a tiny model learns far
    # more easily than a zoo of multi-digit tokens
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def corpus_texts(conversations: list[dict]) -> list[str]:
    return [m["content"] for c in conversations for m in c["messages"]]


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    """save_pretrained, made readable beyond transformers 5: it writes the template only to
    chat_template.jinja and names its own class; older readers look in tokenizer_config.json."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=tok.chat_template)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
