"""regenerate stage: on-policy data. The target rewrites every assistant turn of the chat data.

EAGLE-3 trains the draft on responses the target itself generated (the paper regenerated ShareGPT
and UltraChat), so the draft learns the target's distribution rather than the dataset authors'.
With `data.regenerate.enabled` the conversations of `data.path` (read and checked exactly as
prepare reads them) go through the target in vLLM turn by turn: assistant turn k is generated
from the conversation so far, earlier turns already regenerated; user and system turns are kept.
prepare then reads `artifacts/regenerated/conversations.jsonl` instead of `data.path`.

Work is checkpointed every `conversations_per_chunk` conversations (chunk files under the
resumable output, pipeline/workflow/launcher.py), so a killed run resumes after its last complete chunk.
With regeneration off the stage only writes `regenerate.json` saying so (instant).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from pipeline.atomic import atomic_write_text, remove_stale_temps
from pipeline.chat_data import Conversation, DataError, load_tokenizer, read_chat, tokenize_chats
from pipeline.console import say
from pipeline.layout import METRICS, REGENERATED_CONVERSATIONS, REGENERATED_DIR, REGENERATED_META
from pipeline.params import DataParams, RegenerateParams
from pipeline.progress import progress
from pipeline.target import load_target, sha256_file, sha256_json
from pipeline.watchdog import watch
from pipeline.workflow.invalidation import regenerated_params

METRICS_JSON = METRICS / "regenerate.json"
RUN_JSON = REGENERATED_DIR / "run.json"


def chunk_path(k: int) -> Path:
    return REGENERATED_DIR / f"chunk-{k:05d}.jsonl"


def provenance(params: DataParams, source_sha256: str) -> dict:
    """What prepare checks before it trusts the regenerated data (see prepare.regenerated_source)."""
    return {"enabled": True, "source_sha256": source_sha256, "regenerate": regenerated_params(params),
            "seq_len": params.seq_len, "on_error": params.on_error}


def run(params: DataParams) -> None:
    path = Path(params.path)
    if not path.is_file():  # before loading anything
        raise DataError(f"data.path: {path} not found; point data.path at a chat JSONL file")
    REGENERATED_DIR.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(REGENERATED_DIR)
    if not params.regenerate.enabled:
        for p in REGENERATED_DIR.iterdir():  # chunks of an earlier enabled run
            p.unlink()
        atomic_write_text(REGENERATED_META, json.dumps({"enabled": False}, indent=1) + "\n")
        atomic_write_text(METRICS_JSON, json.dumps({"enabled": False}, indent=2) + "\n")
        say("[regenerate] data.regenerate.enabled is false: prepare reads data.path as it is")
        return

    started = time.perf_counter()
    cfg = params.regenerate
    counts = Counter()
    chats = read_chat(path, params.on_error, counts)  # bad lines fail here, before the target loads
    target = load_target()
    tok = load_tokenizer(target)
    convs = tokenize_chats(path, chats, tok, params.on_error, counts)
    meta = provenance(params, sha256_file(path))
    # chunk k's conversations depend on the chunk size: a resume needs it, the output does not
    run_key = sha256_json({**meta, "target": target.fingerprint, "conversations_per_chunk": cfg.conversations_per_chunk})
    chunks = [convs[i : i + cfg.conversations_per_chunk] for i in range(0, len(convs), cfg.conversations_per_chunk)]
    done = resume_chunks(run_key, len(chunks))

    stats = Counter()
    todo = [k for k in range(len(chunks)) if k not in done]
    if todo:
        with watch("regenerate") as dog:
            kept = "Complete chunks are kept: the re-run resumes after the last one."
            dog.engine_starting(cfg.engine_start_timeout_s, "data.regenerate.engine_start_timeout_s", kept)
            engine = GenerationEngine(target, cfg, params.seq_len)
            dog.engine_running("regeneration (no request finished)", cfg.engine_stall_timeout_s,
                               "data.regenerate.engine_stall_timeout_s", kept)
            bar = progress(total=sum(len(chunks[k]) for k in todo), desc="regenerate", unit="conv")
            t0 = time.perf_counter()
            for k in todo:
                records, chunk_stats = engine.regenerate(chunks[k], tok, seed_base=k * cfg.conversations_per_chunk,
                                                         use_tqdm=dog.progress_bar())
                atomic_write_text(chunk_path(k), "".join(json.dumps(r) + "\n" for r in records))
                stats.update(chunk_stats)
                bar.update(len(chunks[k]))
                bar.set_postfix(tok_s=f"{stats['generated_tokens'] / (time.perf_counter() - t0):.0f}")
            bar.close()
            stats["generate_s"] = round(time.perf_counter() - t0, 2)

    # all chunks present: one file for prepare, then the chunks go
    text = "".join(chunk_path(k).read_text() for k in range(len(chunks)))
    atomic_write_text(REGENERATED_CONVERSATIONS, text)
    atomic_write_text(REGENERATED_META, json.dumps({**meta, "counts": dict(counts), "target": target.fingerprint},
                                                   indent=1, sort_keys=True) + "\n")
    for k in range(len(chunks)):
        chunk_path(k).unlink()
    RUN_JSON.unlink()
    gen_s = stats.get("generate_s")
    metrics = {"enabled": True, "conversations": len(convs), **{k: v for k, v in stats.items() if k != "generate_s"},
               "chunks_resumed": len(done), "generate_s": gen_s,
               "tokens_per_s": round(stats["generated_tokens"] / gen_s, 1) if gen_s else None,
               "wall_s": round(time.perf_counter() - started, 2)}
    atomic_write_text(METRICS_JSON, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    say("[regenerate] " + ", ".join(f"{k}={v}" for k, v in metrics.items()))


def resume_chunks(run_key: str, num_chunks: int) -> set[int]:
    """Complete chunks of an interrupted run with the same inputs; anything else is cleared."""
    old = json.loads(RUN_JSON.read_text()).get("run_key") if RUN_JSON.is_file() else None
    if old != run_key:
        for p in REGENERATED_DIR.iterdir():
            p.unlink()
        atomic_write_text(RUN_JSON, json.dumps({"run_key": run_key}) + "\n")
        return set()
    done = {k for k in range(num_chunks) if chunk_path(k).is_file()}
    if done:
        say(f"[regenerate] resuming: {len(done)} of {num_chunks} chunks already done")
    return done


class GenerationEngine:
    """The target in vLLM for plain generation (token ids in, token ids out)."""

    def __init__(self, target, cfg: RegenerateParams, seq_len: int) -> None:
        from pipeline.extraction import vllm_compat

        self.cfg, self.seq_len, self.model_path = cfg, seq_len, target.path
        vllm_compat.configure_process_env(cfg.cpu_kvcache_gib, target.path, seq_len)
        self.llm = vllm_compat.start_llm("data.regenerate", cfg.model_dump(), **vllm_compat.generation_kwargs(
            model=target.path, dtype=cfg.dtype, max_model_len=seq_len, max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            trust_remote_code=target.trust_remote_code, seed=cfg.seed))

    def regenerate(self, convs: list[Conversation], tok, seed_base: int, use_tqdm=False) -> tuple[list[dict], Counter]:
        """Rewrite every assistant turn of `convs`, one engine call per turn depth (`use_tqdm`: vLLM's, per request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stats = Counter()
        # the engine runs without a tokenizer (token ids in and out), so it does not know the
        # end-of-turn token: without these ids every turn would run on to max_tokens
        stop_ids = end_of_turn_ids(tok, self.model_path)
        messages = [[dict(m) for m in c.messages] for c in convs]
        turn = {i: first_assistant(m, 0) for i, m in enumerate(messages)}
        regenerated_any = set()
        while turn:
            prompts, sampling, order = [], [], []
            for i, t in turn.items():
                ids = tok(tok.apply_chat_template(messages[i][:t], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
                room = self.seq_len - len(ids)
                if room <= 0:  # this turn and any later one would be cut by prepare anyway
                    if i in regenerated_any:
                        del messages[i][t:]
                        while messages[i][-1]["role"] != "assistant":  # no dangling user turn
                            messages[i].pop()
                        stats["turns_dropped_over_seq_len"] += 1
                    else:
                        stats["conversations_kept_original"] += 1  # no room even for the first turn
                    continue
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                sampling.append(SamplingParams(
                    temperature=self.cfg.temperature, top_p=self.cfg.top_p, max_tokens=min(self.cfg.max_tokens, room),
                    seed=self.cfg.seed + 1_000_003 * (seed_base + i) + t, stop_token_ids=stop_ids, detokenize=False))
                order.append((i, t))
            outputs = self.llm.generate(prompts, sampling, use_tqdm=use_tqdm) if prompts else []
            next_turn = {}
            for (i, t), out in zip(order, outputs, strict=True):
                gen = out.outputs[0]
                messages[i][t] = {"role": "assistant", "content": tok.decode(gen.token_ids, skip_special_tokens=True)}
                regenerated_any.add(i)
                stats["turns_regenerated"] += 1
                stats["generated_tokens"] += len(gen.token_ids)
                stats["turns_cut_at_max_tokens"] += gen.finish_reason == "length"
                if (nxt := first_assistant(messages[i], t + 1)) is not None:
                    next_turn[i] = nxt
            turn = next_turn
        records = [{"source_line": c.line, "messages": m} for c, m in zip(convs, messages, strict=True)]
        return records, stats


def end_of_turn_ids(tok, model_path: Path) -> list[int]:
    """The tokenizer's eos plus generation_config.json's eos ids (a chat model's end-of-turn)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids:
        raise DataError(f"{model_path}: neither the tokenizer nor generation_config.json names an eos token; "
                        "the regenerated turns would never end")
    return sorted(ids)


def first_assistant(messages: list[dict], start: int) -> int | None:
    return next((j for j in range(start, len(messages)) if messages[j]["role"] == "assistant"), None)
