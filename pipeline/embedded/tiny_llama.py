"""A tiny Llama target, trained briefly on the generated corpus (on CPU, or on the GPU when there is one), saved as an HF dir.

Training is plain next-token prediction on the chat-templated corpus, with the loss on assistant
tokens only (what a chat model is tuned on). Batches are windows of the concatenated corpus that
each start at a conversation's `<|bos|>`, so no compute goes to padding and the first
conversation of every window has its full context.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from pipeline.embedded import corpus
from pipeline.embedded.tokenizer import save_tokenizer
from pipeline.params import EmbeddedModelParams
from pipeline.progress import progress
from pipeline.training import cpu_determinism

# conversations (another seed of the corpus generator) the trained target's accuracy is measured on
UNSEEN_CONVERSATIONS = 64
SAVED_DTYPE = torch.bfloat16  # the checkpoint's dtype (trained in fp32): see `build`


def build_model(p: EmbeddedModelParams, tok: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(p.seed)
    return LlamaForCausalLM(config).to(torch.float32)


def encode(tok: PreTrainedTokenizerBase, conversations: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The corpus as one token stream, its assistant mask, and where each conversation starts."""
    ids, mask, starts = [], [], []
    for conv in conversations:
        out = tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        starts.append(len(ids))
        ids += out["input_ids"]
        mask += out["assistant_masks"]
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool), torch.tensor(starts)


def lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def training_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def train(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor,
          p: EmbeddedModelParams, threads: int = cpu_determinism.TRAINING_THREADS,
          device: torch.device | None = None) -> list[float]:
    device = training_device() if device is None else device
    if device.type == "cuda":
        # Mixed precision: fp32 master weights and AdamW state, matmuls under bf16 autocast (the
        # H200's bf16 rate; a bf16 optimizer state would lose the small late updates). Not bit
        # reproducible across runs, and the CPU thread pin does not apply.
        model.to(device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        opt_kwargs = {"fused": True}
    else:
        # a constant on every machine, not the cores: the weights depend on it (pipeline/training/cpu_determinism.py)
        torch.set_num_threads(threads)
        autocast, opt_kwargs = contextlib.nullcontext(), {}
    T = p.train_seq_len
    # wrap around so a window may start at any conversation
    ids, mask = torch.cat([ids, ids[: T + 1]]), torch.cat([mask, mask[: T + 1]])
    gen = torch.Generator().manual_seed(p.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.1, **opt_kwargs)
    offsets = torch.arange(T + 1)
    losses = []
    model.train()
    bar = progress(range(p.train_steps), desc="train target", mininterval=2)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, p.train_steps, p.lr)
        rows = starts[torch.randint(len(starts), (p.train_batch_size,), generator=gen)][:, None] + offsets
        x, y = ids[rows[:, :-1]], ids[rows[:, 1:]]
        y = y.masked_fill(~mask[rows[:, 1:]], -100)
        x, y = x.to(device), y.to(device)
        with autocast:
            logits = model(input_ids=x).logits
        # a window may hold no assistant token (tiny train_seq_len): sum / count, never 0 / 0
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (y != -100).sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


@torch.no_grad()
def assistant_accuracy(model: PreTrainedModel, tok: PreTrainedTokenizerBase, conversations: list[dict],
                       device: torch.device) -> float:
    """Greedy next-token accuracy on the assistant tokens of `conversations`, one at a time."""
    ids, mask, starts = encode(tok, conversations)
    bounds = [*starts.tolist(), len(ids)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    hits = total = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        x, m = ids[a:b].to(device), mask[a + 1 : b].to(device)
        with autocast:
            predicted = model(input_ids=x[None]).logits[0, :-1].argmax(-1)
        hits += int((predicted == x[1:])[m].sum())
        total += int(m.sum())
    return hits / max(1, total)


def build(p: EmbeddedModelParams, tok: PreTrainedTokenizerBase, conversations: list[dict], out: Path,
          make_model: Callable[[EmbeddedModelParams, PreTrainedTokenizerBase], PreTrainedModel] = build_model,
          extra_config: dict | None = None) -> dict:
    """Train the tiny target and save it (weights, config, generation config, tokenizer) into `out`.

    `make_model` builds the untrained model (this module's Llama by default; tiny_deepseek_v3 passes
    its own); `extra_config` adds keys to the saved config.json that transformers does not write.
    """
    t0 = time.time()
    model = make_model(p, tok)
    ids, mask, starts = encode(tok, conversations)
    device = training_device()
    t_loop = time.time()
    losses = train(model, ids, mask, starts, p, device=device)  # loss.item() every step: synchronised
    loop_s = time.time() - t_loop
    train_s = time.time() - t0
    # Trained in fp32, shipped in the dtype it is served in, as the targets it stands for are: vLLM
    # serves a float32 checkpoint in bfloat16 on CPU ("auto") and would narrow every tensor as it
    # loads it; fp32 readers (extract.dtype float32, verify's reference) widen bf16 exactly.
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    # the skill the draft will copy, on conversations of the same generator it never trained on
    # (the weights as saved, computed in fp32)
    unseen = corpus.generate(UNSEEN_CONVERSATIONS, seed=corpus.SEED + 1)
    unseen_accuracy = assistant_accuracy(model, tok, unseen, device)
    model.to("cpu", dtype=SAVED_DTYPE)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    # transformers 5 writes `dtype`; older readers (and most hub configs) use `torch_dtype`
    config = json.loads((out / "config.json").read_text())
    config = {**config, "dtype": "bfloat16", "torch_dtype": "bfloat16", **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tail = losses[-10:]
    return {
        "parameters": sum(t.numel() for t in model.parameters()),
        "steps": len(losses),
        "corpus_tokens": len(ids),
        "corpus_assistant_tokens": int(mask.sum()),
        "tokens_per_step": p.train_batch_size * p.train_seq_len,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "unseen_assistant_accuracy": round(unseen_accuracy, 4),
        "loss_curve": {str(s): round(losses[s], 4) for s in range(0, len(losses), max(1, len(losses) // 20))},
        "train_seconds": round(train_s, 1),
        "train_tokens_per_second": round(len(losses) * p.train_batch_size * p.train_seq_len / loop_s) if loop_s else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "bf16 autocast, fp32 weights and AdamW" if device.type == "cuda" else "float32",
        "saved_dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        # the CPU arithmetic it trained with: the same on every x86-64 machine when "pinned"; on a GPU
        # the arithmetic is the GPU's, not reproducible bit for bit, so there is none to report
        "cpu_arithmetic": cpu_determinism.in_force() if device.type == "cpu" else None,
    }
