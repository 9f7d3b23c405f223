"""A tiny, self-made project for the train/eval tests: a random Llama target with a word-level
tokenizer and chat template, hidden-state shards computed with transformers in vLLM's layer
convention, token frequencies and held-out prompts. Stand-in until the shared conftest fixtures
(tiny_target / prepared / extracted) exist.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline import layout
from pipeline.hidden_states import format as shards
from pipeline.target import Target, fingerprint_model_dir, write_target

NUM_LAYERS = 8
HIDDEN = 64
VOCAB = 256
CYCLE = 16
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
# Plain concatenation: the prompt is a cycle the target continues, so served drafts see what
# they were trained on and training accuracy and serving acceptance can be compared.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_target(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    _learn_successor(model, seed)
    model.save_pretrained(path)
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def _chains(g: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """Sequences cycling through a few words (w5, w6, ..., w20, w5, ...): something a draft learns fast."""
    start = torch.randint(0, CYCLE, (batch, 1), generator=g)
    return len(SPECIAL) + (start + torch.arange(seq_len)) % CYCLE


def _learn_successor(model: LlamaForCausalLM, seed: int, steps: int = 300) -> None:
    """Optimizer steps until the target predicts the next word (a random target's near-uniform
    next-token choice leaves a draft nothing to learn, tau ~ 1), checked on chains it never saw.

    60 steps, as before, stopped mid-way through the fit (0.56-0.9 next-word accuracy depending on
    the CPU's arithmetic: 0.60 on an AVX2-only EPYC, where the eval test's draft then trained on
    text the target does not write and serving fell 0.4 short of training). At a constant rate the
    fit then wanders: 0.946 after 200 steps on an AVX-512 EPYC (0.935-0.96 from step 120 to 440).
    The rate decays to 0 over the steps, so it settles: 0.978-1.0 after 300 on AVX-512 and AVX2
    arithmetic, seeds 0-2."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=steps)
    for _ in range(steps):
        ids = _chains(g, 16, 32)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    model.eval()
    unseen = _chains(torch.Generator().manual_seed(seed + 12345), 64, 48)
    with torch.no_grad():
        accuracy = (model(unseen).logits.argmax(-1)[:, :-1] == unseen[:, 1:]).float().mean().item()
    assert accuracy >= 0.95, f"the tiny target learnt the cycle to {accuracy:.3f} next-word accuracy only"


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in _chains(g, 1, n)[0])


@torch.no_grad()
def make_shards(out: Path, target_dir: Path, n_samples: int, layer_ids: list[int], seq_len: int = 48,
                samples_per_shard: int = 8, seed: int = 0, dtype: str = "float32") -> None:
    """Shards in vLLM's id convention: id k < N = HF hidden_states[k]; id N = input of the final norm (computed in
    fp32; `dtype` float8_e4m3: stored as the extract stage stores them, format version 2)."""
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pre_norm: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    g = torch.Generator().manual_seed(seed)
    samples = []
    for sid in range(n_samples):
        ids = _chains(g, 1, seq_len)[0]
        out_hf = model(ids[None], output_hidden_states=True)
        layers = [pre_norm.pop() if k == NUM_LAYERS else out_hf.hidden_states[k] for k in layer_ids]
        hs = torch.stack([h[0] for h in layers], dim=1)  # [T, L, H]
        mask = torch.ones(seq_len, dtype=torch.uint8)
        mask[: seq_len // 4] = 0  # a "prompt" part without loss
        samples.append(shards.stored(shards.Sample(sid, ids, mask, hs), dtype))
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, n_samples, samples_per_shard):
        shards.write_shard(out, i // samples_per_shard, samples[i : i + samples_per_shard], {})
    meta = {"format": shards.FORMAT_NAME, "format_version": shards.format_version(dtype), "run_key": f"tiny-{seed}-{layer_ids}-{dtype}",
            "complete": True, "layer_ids": layer_ids, "hidden_size": HIDDEN, "num_layers": NUM_LAYERS, "dtype": dtype}
    shards.write_meta(out, meta)


def write_verdict(root: Path) -> None:
    """What a passing verify run leaves for train (pipeline/stages/verify.py)."""
    meta = shards.read_meta(root / layout.HIDDEN_STATES_DIR)
    (root / layout.VERIFY_VERDICT).parent.mkdir(parents=True, exist_ok=True)
    (root / layout.VERIFY_VERDICT).write_text(json.dumps({"passed": True, "run_key": meta["run_key"]}))


def make_project(root: Path, n_samples: int = 24, layer_ids: list[int] | None = None, n_heldout: int = 6,
                 train: dict | None = None, eval_: dict | None = None, dtype: str = "float32",
                 target: Path | None = None) -> Path:
    """Everything the train and eval stages read, under `root` (the stages use cwd-relative paths). `target`: a
    make_target() directory (seed 0) to copy rather than train again (tests/conftest.py `cycle_target`)."""
    target_dir = make_target(root / "target") if target is None else Path(shutil.copytree(target, root / "target"))
    write_target(Target(path=target_dir.resolve(), embedded=False, fingerprint=fingerprint_model_dir(target_dir)),
                 root / layout.TARGET_JSON)
    make_shards(root / layout.HIDDEN_STATES_DIR, target_dir, n_samples, layer_ids or [2, 4, 5, NUM_LAYERS], dtype=dtype)
    write_verdict(root)
    prepared = root / layout.PREPARED_DIR
    prepared.mkdir(parents=True, exist_ok=True)
    freq = [0] * VOCAB
    for p in shards.complete_shards(root / layout.HIDDEN_STATES_DIR):
        for s in shards.iter_samples(p):
            for t in s.input_ids[s.loss_mask.bool()].tolist():
                freq[t] += 1
    (root / layout.TOKEN_FREQ).write_text(json.dumps(freq))
    g = torch.Generator().manual_seed(1)
    with open(root / layout.HELDOUT_PROMPTS, "w") as f:
        for i in range(n_heldout):
            msgs = [{"role": "user", "content": _words(g, 12)}]
            f.write(json.dumps({"sample_id": 1000 + i, "messages": msgs, "reference": _words(g, 8)}) + "\n")
    params = {"train": {"epochs": 2, "ttt_steps": 2, "max_len": 256, "val_fraction": 0.25, "lr": 1e-3, **(train or {})},
              "eval": {"num_speculative_tokens": 2, "num_prompts": n_heldout, "max_tokens": 16, **(eval_ or {})}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root
