"""The one helper for engine runs: the extract stage run once in a bench project, timed from outside its code."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from gpu_jobs.common import ENGINE, SMOKE_ENGINE, _lengths, layer_ids_of, log, model_of
from gpu_jobs.gpu_busy import Utilisation


def _engine_params(state: dict, name: str):
    from pipeline.params import ExtractParams

    spec = state[f"spec_{name}"]
    eng = SMOKE_ENGINE if state["smoke"] else ENGINE
    return ExtractParams(**{
        "layer_ids": layer_ids_of(state, name),
        "dtype": "bfloat16",
        "samples_per_shard": spec["samples_per_shard"],
        "max_num_seqs": eng["max_num_seqs"],
        "max_num_batched_tokens": eng["max_num_batched_tokens"],
        "gpu_memory_utilization": eng["gpu_memory_utilization"],
        **state.get(f"extract_{name}", {}),  # a run's own params (RUNS: multi-GPU, fp8)
    })


def _patch_eager_for_moe(state: dict, name: str) -> None:
    """The MoE run proves the architecture, it is not timed: eager mode skips minutes of compile. The
    seed runs eager too, extraction and plain prefill alike (same settings: the ratio holds),
    so that both engines start within one 600 s call.
    `--eager` puts the dense runs in eager mode too (start-up ~1 min shorter; tok/s not the compiled one)."""
    from pipeline.extraction import vllm_compat

    # the verifyall job's "dense" stage is verify's budget's denominator: always compiled
    if model_of(state, name) not in ("moe", "seed") and (not state.get("eager") or name == "dense"):
        return
    orig = vllm_compat.engine_kwargs

    def engine_kwargs(**kw):
        out = orig(**kw)
        out["enforce_eager"] = True
        return out

    vllm_compat.engine_kwargs = engine_kwargs


def _load_extract(state: dict, baseline: bool):
    import importlib.util

    if not baseline:
        from pipeline.stages import extract

        return extract
    spec = importlib.util.spec_from_file_location("extract_baseline", state["baseline"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TL: dict = {}


def _instrument() -> None:
    """Timeline of the stage from outside its code: engine ready, requests added/finished, shard writes."""
    from pipeline.extraction import vllm_compat
    from pipeline.hidden_states import format as shards

    E = vllm_compat.HiddenStatesEngine
    orig_init, orig_add, orig_step, orig_generate = E.__init__, E.add, E.step, E.generate
    orig_write = shards.write_shard

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        TL["ready"] = time.monotonic()

    def add(self, request_id, prompt):
        TL["added"].setdefault(request_id, time.monotonic())
        return orig_add(self, request_id, prompt)

    def step(self):
        done = orig_step(self)
        now = time.monotonic()
        for rid, _ in done:
            TL["finished"][rid] = now
        return done

    def generate(self, prompts):
        t = time.monotonic()
        paths = orig_generate(self, prompts)
        TL["generate"].append((t, time.monotonic(), len(prompts), sum(len(p) for p in prompts)))
        return paths

    def write_shard(directory, index, samples, extra):
        t = time.monotonic()
        m = orig_write(directory, index, samples, extra)
        TL["shards"].append((t, time.monotonic(), index, m["bytes"], sum(m["num_tokens"]), m["sample_ids"]))
        return m

    E.__init__, E.add, E.step, E.generate = init, add, step, generate
    shards.write_shard = write_shard


def _stage_once(state: dict, name: str, extract) -> dict:
    """One run of `extract.run` in the project (fresh output dir); its numbers from metrics + timeline."""
    from pipeline import layout

    TL.clear()
    TL.update({"ready": None, "added": {}, "finished": {}, "shards": [], "generate": []})
    blocks = state[f"blocks_{name}"]
    params = _engine_params(state, name)
    proj = Path(state[f"project_{name}"])
    shutil.rmtree(proj / layout.HIDDEN_STATES_DIR, ignore_errors=True)  # a fresh run, never a resume
    (proj / layout.METRICS / "extract.json").unlink(missing_ok=True)
    t_start = time.monotonic()
    with contextlib.chdir(proj), Utilisation() as busy:
        extract.run(params)
    t_end = time.monotonic()
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    hs_dir = proj / layout.HIDDEN_STATES_DIR
    data_bytes = sum(p.stat().st_size for p in hs_dir.glob("shard-*.safetensors"))
    t = time.monotonic()
    os.sync()
    sync_s = time.monotonic() - t

    summary = {
        "stage_tok_s": metrics["tok_per_s"],
        "stage_metrics": metrics,
        "tokens": metrics["tokens"],
        "data_bytes": data_bytes,
        "bytes_per_token": round(data_bytes / metrics["tokens"], 1),
        "writer_gb_s_needed": round(data_bytes / metrics["tokens"] * metrics["tok_per_s"] / 1e9, 3),
        "sync_after_s": round(sync_s, 2),
        "run_s": round(t_end - t_start, 2),
        "engine_load_s": metrics["engine_load_s"],
    }
    ready = TL["ready"]
    last_shard = max(s[1] for s in TL["shards"])
    summary["extraction_s_ready_to_last_shard"] = round(last_shard - ready, 3)
    summary["tok_s_ready_to_last_shard"] = round(metrics["tokens"] / (last_shard - ready), 1)
    summary["gpu_busy_ready_to_last_shard"] = busy.mean(ready, last_shard)
    ds_lens = _lengths(proj)
    if TL["finished"]:
        # engine-side rate inside each big block of one prompt length (the small head blocks and
        # the start-up of the first requests excluded)
        for label, lo, hi in blocks:
            fin = sorted((TL["finished"][f"s{i}"], ds_lens[i]) for i in range(lo, hi) if f"s{i}" in TL["finished"])
            if hi - lo > 2 * params.samples_per_shard and len(fin) > 2:
                toks = sum(n for _, n in fin[1:])
                summary[f"engine_tok_s_{label}"] = round(toks / (fin[-1][0] - fin[0][0]), 1)
        last_fin = max(TL["finished"].values())
        summary["engine_tok_s_ready_to_last_finish"] = round(sum(ds_lens) / (last_fin - ready), 1)
        summary["tail_last_finish_to_last_shard_s"] = round(last_shard - last_fin, 3)
        summary["first_add_after_ready_s"] = round(min(TL["added"].values()) - ready, 3)
    if TL["generate"]:
        summary["generate_calls"] = [(round(a - ready, 2), round(b - a, 3), n, tok) for a, b, n, tok in TL["generate"]]
        last_gen = max(b for _, b, _, _ in TL["generate"])
        summary["engine_tok_s_ready_to_last_generate"] = round(sum(ds_lens) / (last_gen - ready), 1)
        busy = sum(b - a for a, b, _, _ in TL["generate"])
        summary["generate_busy_share"] = round(busy / (last_shard - ready), 4)
        summary["tail_last_generate_to_last_shard_s"] = round(last_shard - last_gen, 3)
    summary["shard_writes"] = [
        (round(a - ready, 3), round(b - a, 3), i, nb) for a, b, i, nb, _, _ in sorted(TL["shards"])
    ]
    ws = TL["shards"]
    summary["shard_write_gb_s_per_thread"] = round(sum(s[3] for s in ws) / sum(s[1] - s[0] for s in ws) / 1e9, 3)
    # the stage's write rate: its bytes over the time at least one shard write was in flight (what the disk's own
    # rate, measured by bench/shard_write_bench.py in the same call, bounds)
    busy_s, end = 0.0, float("-inf")
    for a, b in sorted((s[0], s[1]) for s in ws):
        busy_s += max(0.0, b - max(a, end))
        end = max(end, b)
    summary["shard_write_busy_s"] = round(busy_s, 3)
    summary["shard_write_gb_s"] = round(sum(s[3] for s in ws) / busy_s / 1e9, 3)
    log(f"stage {name}: {json.dumps({k: v for k, v in summary.items() if k not in ('shard_writes', 'stage_metrics')})}")
    return summary
