"""bench steps stage, baseline and tune: the project's extract stage (or the old one) on the GPU."""

from __future__ import annotations

import contextlib
import time

from gpu_jobs.common import log, model_of
from gpu_jobs.engine_runs import TL, _instrument, _load_extract, _patch_eager_for_moe, _stage_once


def job_stage(state: dict, name: str, baseline: bool = False) -> dict:
    """The project's extract stage, instrumented from outside (no change to its code)."""
    extract = _load_extract(state, baseline)
    _patch_eager_for_moe(state, name)
    _instrument()
    summary = _stage_once(state, name, extract)
    summary["extract_params"] = state.get(f"extract_{name}")
    summary["eager"] = model_of(state, name) in ("moe", "seed") or bool(state.get("eager"))
    if note := state.get(f"smoke_note_{name}"):
        summary["note"] = note
    return {"summary": summary}


def job_tune(state: dict, name: str) -> dict:
    """Several runs of the extract stage on ONE engine (its start-up costs ~2 minutes on the H200).

    The first run is an ordinary `extract.run` (it starts the engine, with the default number of
    shard threads); later runs get the same engine back from `HiddenStatesEngine(...)` and only
    change what is named: the shard-thread count, or an older extract stage file (`--baseline`).
    """
    from pipeline.extraction import vllm_compat

    _instrument()
    E = vllm_compat.HiddenStatesEngine
    orig_close = E.close
    cache: dict = {}

    def engine_factory(*a, **kw):
        if "engine" not in cache:
            cache["engine"] = E(*a, **kw)
        else:
            TL["ready"] = time.monotonic()
        return cache["engine"]

    vllm_compat.HiddenStatesEngine = engine_factory
    E.close = lambda self: None
    from pipeline.extraction import engine as extraction_engine

    new = _load_extract(state, baseline=False)
    default_workers = extraction_engine.shard_workers()
    variants = [
        ("new-default", None),
        ("new-w16", 16),
        ("baseline", "baseline"),
        ("new-w4", 4),
        ("new-default-2", None),
    ]
    if not state.get("baseline"):
        variants = [v for v in variants if v[1] != "baseline"]
    runs: dict = {}
    deadline = state["child_deadline_unix"]
    for label, how in variants:
        est = 120 if how == "baseline" else 60
        if runs and time.time() + est > deadline:
            log(f"tune: no time left for {label}")
            break
        if how == "baseline":
            module = _load_extract(state, baseline=True)
        else:
            module = new
            workers = how or default_workers
            extraction_engine.shard_workers = lambda w=workers: w  # what extract_shards calls
        try:
            runs[label] = _stage_once(state, name, module)
            runs[label]["shard_workers"] = None if how == "baseline" else (how or default_workers)
        except Exception as e:  # keep the other variants
            import traceback

            traceback.print_exc()
            runs[label] = {"error": repr(e)}
    with contextlib.suppress(Exception):
        orig_close(cache["engine"])
    first = runs.get("new-default", {})
    summary = {
        k: first.get(k)
        for k in (
            "stage_tok_s",
            "tok_s_ready_to_last_shard",
            "engine_tok_s_ready_to_last_finish",
            "tail_last_finish_to_last_shard_s",
            "engine_load_s",
            "tokens",
        )
    }
    summary["runs"] = {label: {k: v for k, v in r.items() if k not in ("shard_writes",)} for label, r in runs.items()}
    summary["default_shard_workers"] = default_workers
    return {"summary": summary, "shard_writes": {label: r.get("shard_writes") for label, r in runs.items()}}
