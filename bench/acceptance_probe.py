"""Where a training-vs-serving acceptance gap comes from: the trained draft, teacher-forced, on the training data and on the target's own text.

Usage, in a project after `train` (and `eval`, to compare):

    python bench/acceptance_probe.py --out probe.json [--prompts 64] [--max-tokens 64] [--draft DIR]

Runs speculators' own EAGLE-3 forward (the trainer's metrics, `full_acc_k`) on
  (a) the train stage's validation split, read from the shards: reproduces training's figures;
  (b) the target's greedy continuations of the held-out prompts (transformers, fp32; the states
      from `pipeline.verification.reference.model`, verify's yardstick), masked to the generated tokens: the text
      vLLM's draft sees when serving;
and walks (b) the way vLLM's draft/verify loop does (k = 3: draft at a position, accept the
leading correct tokens, skip past them and the target's own token), which is the serving
acceptance per position if vLLM feeds the draft as training did. (a) >> (b) ~ walk ~ vLLM:
the gap is in the data (the draft learned text the target does not write); (b) ~ walk >> vLLM:
the serving path feeds the draft differently. The continuations and their states are cached in
greedy_<prompts>_<max-tokens>.pt in the project. docs/BENCHMARKS.md ("The
DeepSeek-V3-shaped embedded target on CPU") has a run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from speculators.losses import resolve_loss_config
from speculators.model import SpeculatorModel
from speculators.models.eagle3.data import shift_batch

from pipeline.hidden_states import format as shards
from pipeline.layout import HIDDEN_STATES_DIR
from pipeline.params import load_params
from pipeline.stages.eval import load_prompts
from pipeline.target import load_target
from pipeline.training.data import ShardDataset, index_shards, split_refs
from pipeline.training.draft import final_draft
from pipeline.verification.reference.model import ReferenceModel


def load_draft(draft_dir: Path, target_path: Path) -> torch.nn.Module:
    """A checkpoint as speculators builds it for training (sdpa attention on CPU), in fp32."""
    cls = SpeculatorModel.registry["eagle3"]
    config = cls.config_class.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"
    draft = cls.from_pretrained(draft_dir, config=config, verifier=str(target_path))
    draft.load_verifier_weights()  # embed_tokens, verifier norm and lm_head: not in the checkpoint
    return draft.float().eval()


@torch.no_grad()
def teacher_forced(draft, ids: torch.Tensor, states: torch.Tensor, mask: torch.Tensor, k: int):
    """ids [T]; states [T, L, H] (extract's layer order, the last the final pre-norm state); mask [T].

    Returns the trainer's full_acc sums/totals, and per step s a [T-1] bool: steps 0..s all match
    the target's argmax at shifted position i (speculators' alignment: i sees state i and token i+1)."""
    n = len(ids) - 1
    b = shift_batch({"input_ids": ids.long(), "hidden_states": states[:, :-1].flatten(1).float(),
                     "verifier_last_hidden_states": states[:, -1].float(), "loss_mask": mask.bool(),
                     "lengths": torch.tensor([len(ids)]), "position_ids": torch.arange(len(ids))})
    tokens, _, metrics = draft(
        hidden_states=b["hidden_states"][None], input_ids=b["input_ids"][None],
        document_ids=torch.zeros(1, n, dtype=torch.long), loss_mask=b["loss_mask"][None],
        position_ids=b["position_ids"][None], verifier_last_hidden_states=b["verifier_last_hidden_states"][None],
        ttt_steps=k, loss_config=resolve_loss_config("kl_div", "eager"))
    target = draft.verifier_lm_head(draft.verifier_norm(b["verifier_last_hidden_states"])).argmax(-1)
    ok, correct = torch.ones(n, dtype=torch.bool), []
    for s in range(k):
        hit = torch.zeros(n, dtype=torch.bool)
        hit[: n - s] = tokens[s][0][: n - s] == target[s:]
        ok = ok & hit
        correct.append(ok.clone())
    return {key: float(v) for key, v in metrics.items() if key.startswith("full_acc_")}, correct


def walk(correct: list[torch.Tensor], prompt_len: int, seq_len: int, k: int) -> tuple[int, list[int]]:
    """vLLM's loop over one greedy sequence: the first draft follows the prefill's token (shifted
    position prompt_len - 1); each draft accepts its leading correct tokens, and the next draft
    starts after them and the target's own token."""
    drafts, accepted = 0, [0] * k
    i, last = prompt_len - 1, seq_len - 1  # shifted position i, step s predicts token i + 2 + s
    while i + 2 <= last:
        drafts += 1
        a = 0
        while a < k and i + 2 + a <= last and correct[a][i]:
            a += 1
        for s in range(a):
            accepted[s] += 1
        i += a + 1
    return drafts, accepted


def full_acc(sums: dict, k: int) -> list[float]:
    return [sums[f"full_acc_{s}_sum"] / max(sums[f"full_acc_{s}_total"], 1) for s in range(k)]


def add(sums: dict, metrics: dict) -> None:
    for key, v in metrics.items():
        sums[key] = sums.get(key, 0.0) + v


def greedy_continuations(target, prompts: list[list[int]], layer_ids: list[int], max_tokens: int, cache: Path):
    if cache.is_file():
        return torch.load(cache)
    ref = ReferenceModel.load(target.path, "float32", device="cpu")
    eos = ref.model.generation_config.eos_token_id
    out = []
    for p in prompts:
        with torch.no_grad():
            seq = ref.model.generate(torch.tensor(p)[None], max_new_tokens=max_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=0)[0]
        out.append((seq, ref.states(seq).permute(1, 0, 2)[:, layer_ids].clone()))
    torch.save(out, cache)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", type=Path, help="a checkpoint directory (default: the train stage's final one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = load_params(Path("params.yaml"))
    k = params.train.ttt_steps
    target = load_target()
    layer_ids = shards.read_meta(HIDDEN_STATES_DIR)["layer_ids"]
    draft_dir = args.draft or final_draft()
    draft = load_draft(draft_dir, target.path)
    result: dict = {"draft": str(draft_dir), "layer_ids": layer_ids}

    t0 = time.time()
    _, val_refs = split_refs(index_shards(HIDDEN_STATES_DIR), params.train.val_fraction, params.train.seed)
    val = ShardDataset(val_refs, params.train.max_len)
    sums: dict = {}
    agree = [0, 0]  # the target's argmax against the data's next token, on the masked positions
    for i in range(len(val)):
        raw = val._get_raw_data(i)
        hidden = raw["verifier_last_hidden_states"].shape[-1]
        states = torch.cat([raw["hidden_states"].view(len(raw["input_ids"]), -1, hidden),
                            raw["verifier_last_hidden_states"][:, None]], 1)
        metrics, _ = teacher_forced(draft, raw["input_ids"], states, raw["loss_mask"], k)
        add(sums, metrics)
        target_next = draft.verifier_lm_head(draft.verifier_norm(raw["verifier_last_hidden_states"].float())).argmax(-1)
        sel = raw["loss_mask"][1:].bool()
        agree[0] += int((target_next[:-1] == raw["input_ids"][1:])[sel].sum())
        agree[1] += int(sel.sum())
    result["val_split_full_acc"] = full_acc(sums, k)
    result["val_split_target_next_token_acc"] = agree[0] / max(agree[1], 1)
    print(f"(a) training's val split: full_acc {[round(x, 3) for x in result['val_split_full_acc']]}; the target's "
          f"argmax is the data's next token at {result['val_split_target_next_token_acc']:.3f} ({time.time() - t0:.0f} s)")

    t0 = time.time()
    prompts = load_prompts(target, args.prompts)
    cache = Path(f"greedy_{args.prompts}_{args.max_tokens}.pt")
    sums, drafts, accepted, generated = {}, 0, [0] * k, 0
    for p, (seq, states) in zip(prompts, greedy_continuations(target, prompts, layer_ids, args.max_tokens, cache),
                                strict=True):
        mask = torch.zeros(len(seq), dtype=torch.bool)
        mask[len(p):] = True
        metrics, correct = teacher_forced(draft, seq, states, mask, k)
        add(sums, metrics)
        d, a = walk(correct, len(p), len(seq), k)
        drafts, accepted = drafts + d, [x + y for x, y in zip(accepted, a, strict=True)]
        generated += len(seq) - len(p)
    result["greedy_full_acc"] = full_acc(sums, k)
    result["walk_acceptance_per_position"] = [a / max(drafts, 1) for a in accepted]
    result["walk_tau"] = 1 + sum(accepted) / max(drafts, 1)
    result["walk_drafts"] = drafts
    result["generated_tokens"] = generated
    print(f"(b) the target's greedy text ({len(prompts)} prompts, {generated} tokens): full_acc "
          f"{[round(x, 3) for x in result['greedy_full_acc']]}; vLLM's loop over it: acceptance "
          f"{[round(x, 3) for x in result['walk_acceptance_per_position']]}, tau {result['walk_tau']:.3f} "
          f"({time.time() - t0:.0f} s)")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
