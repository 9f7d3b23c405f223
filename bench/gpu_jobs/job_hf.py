"""bench step hf: a batched transformers forward with output_hidden_states, for comparison."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_jobs.common import HF_BATCH_TOKENS, HF_TIMED_BATCHES, _prompts, device, layer_ids_of, log


def job_hf(state: dict, name: str) -> dict:
    """Batched transformers forward with output_hidden_states: GPU only, and + 4 layers to host."""
    import torch
    from transformers import AutoModelForCausalLM

    proj = Path(state[f"project_{name}"])
    prompts = _prompts(proj)
    phases = state[f"phases_{name}"]
    layer_ids = layer_ids_of(state, name)
    dev = device()
    model_dir = json.loads((proj / "artifacts/model/target.json").read_text())["path"]
    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", **({"device_map": dev} if dev == "cuda" else {})
    ).eval()
    load_s = time.monotonic() - t
    base = model.model
    n_layers = len(base.layers)
    captured = {}
    base.layers[-1].register_forward_hook(
        lambda _m, _i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def forward(batch, to_host):
        x = torch.tensor(batch, device=dev)
        hs = base(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        if to_host:
            states = [captured["last"] if k == n_layers else hs[k] for k in layer_ids]
            torch.stack(states, dim=2).cpu()  # [B, T, L, H] in host memory
        sync()

    summary = {"load_s": round(load_s, 2)}
    timed_batches = HF_TIMED_BATCHES if not state["smoke"] else 2
    total = {False: [0, 0.0], True: [0, 0.0]}
    for ph in ("A", "B"):
        ps = [p for p, x in zip(prompts, phases, strict=True) if x == ph]
        bs = max(1, HF_BATCH_TOKENS // len(ps[0])) if not state["smoke"] else 4
        batches = [ps[i : i + bs] for i in range(0, len(ps) - bs + 1, bs)]
        while len(batches) < timed_batches + 1:
            batches = batches + batches
        for to_host in (False, True):
            forward(batches[0], to_host)  # warm-up
            t = time.monotonic()
            for b in batches[1 : timed_batches + 1]:
                forward(b, to_host)
            sec = time.monotonic() - t
            tokens = sum(len(p) for b in batches[1 : timed_batches + 1] for p in b)
            key = "to_host" if to_host else "gpu_only"
            summary[f"{key}_tok_s_{ph}"] = round(tokens / sec, 1)
            summary[f"batch_{ph}"] = bs
            total[to_host][0] += tokens
            total[to_host][1] += sec
    summary["gpu_only_tok_s_all"] = round(total[False][0] / total[False][1], 1)
    summary["to_host_tok_s_all"] = round(total[True][0] / total[True][1], 1)
    if dev == "cuda":
        summary["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    log(f"hf {name}: {summary}")
    return {"summary": summary}
