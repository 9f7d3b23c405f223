"""bench step plain: the same engine settings with extraction off (plain prefill, max_tokens=1)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_jobs.common import _prompts, log
from gpu_jobs.engine_runs import _engine_params, _patch_eager_for_moe


def job_plain(state: dict, name: str) -> dict:
    """Plain prefill on the same engine settings, extraction off."""
    from pipeline.extraction import vllm_compat

    _patch_eager_for_moe(state, name)  # the stage's engine settings, eager where the stage's is
    proj = Path(state[f"project_{name}"])
    prompts = _prompts(proj)
    phases = state[f"phases_{name}"]
    params = _engine_params(state, name)
    model = Path(json.loads((proj / "artifacts/model/target.json").read_text())["path"])
    max_model_len = max(len(p) for p in prompts) + 1
    vllm_compat.configure_process_env(1, model, max_model_len)
    kw = vllm_compat.engine_kwargs(
        model=model,
        layer_ids=params.layer_ids,
        scratch_dir=Path(state["work"]) / "unused",
        dtype=params.dtype,
        max_model_len=max_model_len,
        max_num_seqs=params.max_num_seqs,
        max_num_batched_tokens=params.max_num_batched_tokens,
        gpu_memory_utilization=params.gpu_memory_utilization,
    )
    summary_eager = bool(kw.get("enforce_eager"))
    kw.pop("speculative_config")
    kw.pop("kv_transfer_config")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.monotonic()
    llm = LLM(**kw)
    load_s = time.monotonic() - t
    sp = SamplingParams(max_tokens=1, detokenize=False)

    def run(ps):
        t = time.monotonic()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
        return time.monotonic() - t

    run(prompts[:8])  # warm-up
    a = [p for p, ph in zip(prompts, phases, strict=True) if ph == "A"]
    b = [p for p, ph in zip(prompts, phases, strict=True) if ph == "B"]
    sec_a, sec_b = run(a), run(b)
    sec_all = run(prompts)
    tok_a, tok_b = sum(map(len, a)), sum(map(len, b))
    summary = {
        "engine_load_s": round(load_s, 2),
        "tok_s_A": round(tok_a / sec_a, 1),
        "tok_s_B": round(tok_b / sec_b, 1),
        "tok_s_all": round((tok_a + tok_b) / sec_all, 1),
        "sec_A": round(sec_a, 3),
        "sec_B": round(sec_b, 3),
        "sec_all": round(sec_all, 3),
        "tokens_A": tok_a,
        "tokens_B": tok_b,
        "eager": summary_eager,
    }
    log(f"plain {name}: {summary}")
    return {"summary": summary}
