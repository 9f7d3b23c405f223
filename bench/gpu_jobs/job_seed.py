"""bench job seed: the seed's shape (Kimi-K2.5 width, INT4 routed experts, a short depth) end to end.

Steps (parent.Bench.run_seed): build:seed (pipeline.embedded.seed_shape on the GPU, written shard by shard)
-> plan:seed (`make plan`'s projection for the same params, made before anything is measured) ->
stage:seed (our extract stage, bf16 states) -> plain:seed (plain prefill, same engine settings) ->
plan:seed_after (the plan again, at plain prefill's measured rate) -> verify:seed (the verify stage
on every shard, its streamed reference reading the INT4 layers under a budget below the model's
size; GPU peaks by torch.cuda.max_memory_allocated: the reference alone, the per-sample fit, the
scan, the whole process) -> the figures the issue asks for (seed_figures).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from gpu_jobs.common import SEED_DEPTH, SMOKE_SEED_WIDTH, device, layer_ids_of, log


def job_seed_build(state: dict, name: str) -> dict:
    """The seed-shape checkpoint, made on the GPU (CPU in smoke mode) and written shard by shard."""
    import shutil

    from pipeline.embedded.seed_shape import write_seed_shape
    from pipeline.target import fingerprint_model_dir

    out = Path(state["models"]) / name
    shutil.rmtree(out, ignore_errors=True)
    done = write_seed_shape(out, depth=state.get("seed_depth", SEED_DEPTH), width=SMOKE_SEED_WIDTH if state["smoke"] else None,
                            layer_ids=layer_ids_of(state, name), device=device(), experts=state.get("seed_experts", "w4a16"))
    import resource

    done["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    done["fingerprint_sha256"] = fingerprint_model_dir(out)["sha256"]
    done["bytes_on_disk"] = sum(p.stat().st_size for p in out.iterdir())
    done["path"] = str(out)
    log(f"built {name}: {done['bytes'] / 2**30:.1f} GiB in {done['seconds']:.1f} s, {done['shards']} shards, "
        f"host peak RSS {done['host_peak_rss_bytes'] / 2**30:.1f} GiB")
    return {"summary": done, "config": json.loads((out / "config.json").read_text())}


def job_seed_plan(state: dict, name: str) -> dict:
    """`make plan` for the seed project's params (pipeline.planning.plan.build_plan in the project, no calibration)."""
    from gpu_jobs.engine_runs import _engine_params
    from pipeline.params import DataParams, Params, VerifyParams
    from pipeline.planning.plan import build_plan

    workload = name.removesuffix("_after")
    proj = Path(state[f"project_{workload}"])
    spec = state[f"spec_{workload}"]
    params = Params(extract=_engine_params(state, workload), data=DataParams(seq_len=max(spec["len_a"], spec["len_b"])),
                    verify=VerifyParams(reference_memory_gib=state.get("reference_gib_seed")))
    # plan:seed runs before anything is measured (bytes, memory, reference); plan:seed_after is `make plan
    # --tok-per-s` with plain prefill's measured rate, projecting a fresh run (an output dir with no shards)
    after = name.endswith("_after")
    kw = {"tok_per_s": state.get(f"plain_tok_s_{workload}"), "out": proj / "plan-fresh-out"} if after else {}
    with contextlib.chdir(proj):
        plan = build_plan(params, do_calibrate=False, **kw)
    d = plan.to_json()
    summary = {
        "predicted_bytes": d["projection"]["bytes"],
        "predicted_bytes_per_token": d["projection"]["bytes_per_token"],
        "predicted_extract_s": d["seconds"],
        "predicted_time": d["time"],
        "largest_shard_bytes": d["largest_shard_bytes"],
        "write_gb_per_s": d["write_gb_per_s"],
        "throughput": d["throughput"],
        "reference": {k: d["reference"][k] for k in ("reference", "peak_bytes", "budget_bytes", "min_budget_bytes",
                                                     "read_bytes", "seconds", "experts_per_chunk", "how_seconds")},
        "memory": d["memory"],
    }
    log(f"plan {name}: {json.dumps(summary, default=str)[:600]}")
    return {"summary": summary, "plan": d}


def seed_figures(jobs: dict) -> dict:
    """The issue's figures from the seed steps' results; each plan figure against its measurement."""
    def s(job: str) -> dict:
        return jobs.get(job, {}).get("summary", {})

    build, plan, stage, plain, verify = (s(f"{k}:seed") for k in ("build", "plan", "stage", "plain", "verify"))
    after = s("plan:seed_after")
    out: dict = {"model_bytes": build.get("bytes"), "build_s": build.get("seconds")}

    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    out["extract_tok_s"] = stage.get("stage_tok_s")
    out["extract_engine_tok_s"] = stage.get("engine_tok_s_ready_to_last_finish")
    out["plain_tok_s"] = plain.get("tok_s_all")
    out["extract_over_plain"] = ratio(stage.get("engine_tok_s_ready_to_last_finish"), plain.get("tok_s_all"))
    out["stage_over_plain"] = ratio(stage.get("stage_tok_s"), plain.get("tok_s_all"))
    out["bytes_per_token"] = stage.get("bytes_per_token")
    metrics = verify.get("metrics_summary") or {}
    out["verify_s"] = verify.get("verify_s")
    out["verify_reference_s"] = metrics.get("reference_load_seconds")
    extraction_s = stage.get("extraction_s_ready_to_last_shard")
    out["verify_over_extraction"] = ratio(verify.get("verify_s"), extraction_s)
    out["verify_over_extract_stage_wall"] = metrics.get("verify_over_extract_time")
    out["verify_passed"] = verify.get("passed")
    out["verify_shards"] = verify.get("subset_shards")
    out["verify_bytes"] = verify.get("subset_bytes")
    # GPU memory: the streamed reference alone (its own allocations, what it found held aside), the per-sample
    # fit, the whole verify process; each against the reference's budget
    parts = verify.get("gpu_peaks") or {}
    budget = verify.get("reference_budget_bytes")
    ref_mem, fit_mem = parts.get("reference") or {}, parts.get("per_sample_fit") or {}
    out["reference_budget_bytes"] = budget
    out["reference_own_peak_bytes"] = ref_mem.get("own_peak_bytes")
    out["reference_held_aside_bytes"] = ref_mem.get("held_at_entry_bytes")
    out["reference_own_peak_over_budget"] = ratio(ref_mem.get("own_peak_bytes"), budget)
    out["per_sample_fit_peak_bytes"] = fit_mem.get("own_peak_bytes")
    out["per_sample_fit_s"] = metrics.get("coherence_fit_seconds")
    out["per_sample_fit_inputs"] = verify.get("per_sample_fit_inputs")
    out["verify_process_peak_bytes"] = verify.get("gpu_peak_bytes")
    out["verify_host_peak_rss_bytes"] = verify.get("host_peak_rss_bytes")
    out["verify_process_peak_over_budget"] = ratio(verify.get("gpu_peak_bytes"), budget)
    extract_stage_s = stage["tokens"] / stage["stage_tok_s"] if stage.get("tokens") and stage.get("stage_tok_s") else None
    out["extract_stage_s"] = extract_stage_s
    out["extraction_s_ready_to_last_shard"] = extraction_s
    ref = plan.get("reference") or {}
    checks = {
        "bytes": (plan.get("predicted_bytes"), stage.get("data_bytes")),
        "bytes_per_token": (plan.get("predicted_bytes_per_token"), stage.get("bytes_per_token")),
        "reference_peak_bytes": (ref.get("peak_bytes"), ref_mem.get("own_peak_bytes")),
        "reference_s": (ref.get("seconds"), metrics.get("reference_load_seconds")),
        # `make plan --tok-per-s <plain prefill's rate>` (compute, the writes at plan.write_gb_per_s, the last
        # shard's drain) against the stage's own time: tokens / its tok/s, until its last shard was written
        "extract_s_at_plain_rate": (after.get("predicted_extract_s"), extract_stage_s),
    }
    out["plan_vs_measured"] = {
        k: {"plan": p, "measured": m, "plan_over_measured": ratio(p, m),
            "within_25pct": None if not (p and m) else abs(p / m - 1) <= 0.25}
        for k, (p, m) in checks.items()
    }
    return out


def smoke_budget_gib(model_dir: Path, max_tokens: int) -> float:
    """A budget just above the streamed reference's smallest unit for the built model (smoke: experts in chunks)."""
    from pipeline.verification.reference.cost import GIB, stream_plan
    from pipeline.verification.reference.streamed import Checkpoint, Skeleton

    cost = Skeleton(Checkpoint(model_dir), False).cost()
    return round(stream_plan(cost, 1 << 50, max_tokens, "bfloat16").min_budget_bytes * 1.1 / GIB, 6)
