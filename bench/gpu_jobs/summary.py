"""The GPU bench's summary: per-workload numbers from the steps' results, and the multi-GPU comparisons."""

from __future__ import annotations

from pathlib import Path

from gpu_jobs.common import RUNS


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


def summarize(results: dict) -> dict:
    """The table's numbers: tok/s, TFLOP/s, share of the roofline, ratios."""
    jobs = results["jobs"]
    out: dict = {}
    mm = jobs.get("matmul", {}).get("summary", {})
    peak = mm.get("tflops_8192")
    build = jobs.get("build:dense", {}).get("summary", {})
    params = build.get("params")
    decoder_flop = build.get("flop_per_token_no_embed")

    def row(tok_s):
        if not tok_s:
            return None
        r = {"tok_s": round(tok_s, 1)}
        if params:
            r["tflops_2xparams"] = round(2 * params * tok_s / 1e12, 1)
            if peak:
                r["roofline_share"] = round(2 * params * tok_s / 1e12 / peak, 4)
        if decoder_flop and peak:
            r["roofline_share_decoder_flop"] = round(decoder_flop * tok_s / 1e12 / peak, 4)
        return r

    tune = jobs.get("tune:dense", {}).get("summary", {}).get("runs", {})
    stage = jobs.get("stage:dense", {}).get("summary", {}) or tune.get("new-default", {})
    plain = jobs.get("plain:dense", {}).get("summary", {})
    hf = jobs.get("hf:dense", {}).get("summary", {})
    base = jobs.get("baseline:dense", {}).get("summary", {}) or tune.get("baseline", {})
    for label, r in tune.items():
        if (x := row(r.get("stage_tok_s"))) is not None:
            out[f"tune_{label}"] = x
    for name, val in {
        "stage_until_shards_written": stage.get("stage_tok_s"),
        "stage_engine_ready_to_last_finish": stage.get("engine_tok_s_ready_to_last_finish"),
        "stage_engine_A1": stage.get("engine_tok_s_A1"),
        "stage_engine_B1": stage.get("engine_tok_s_B1"),
        "plain_all": plain.get("tok_s_all"),
        "plain_A": plain.get("tok_s_A"),
        "plain_B": plain.get("tok_s_B"),
        "hf_gpu_A": hf.get("gpu_only_tok_s_A"),
        "hf_gpu_B": hf.get("gpu_only_tok_s_B"),
        "hf_to_host_A": hf.get("to_host_tok_s_A"),
        "hf_to_host_B": hf.get("to_host_tok_s_B"),
        "baseline_stage_until_shards_written": base.get("stage_tok_s"),
    }.items():
        if (r := row(val)) is not None:
            out[name] = r
    if stage.get("stage_tok_s") and plain.get("tok_s_all"):
        out["stage_over_plain"] = round(stage["stage_tok_s"] / plain["tok_s_all"], 4)
    if stage.get("stage_tok_s") and hf.get("gpu_only_tok_s_all"):
        out["stage_over_hf_gpu_only"] = round(stage["stage_tok_s"] / hf["gpu_only_tok_s_all"], 4)
    if stage.get("stage_tok_s") and base.get("stage_tok_s"):
        out["stage_over_baseline"] = round(stage["stage_tok_s"] / base["stage_tok_s"], 4)
    out["matmul_tflops"] = peak
    for job, r in jobs.items():  # DVC's own cost (job_dvc.py): the headline numbers
        if job.startswith("dvccost:") and (c := (r.get("summary") or {}).get("dvc_cost")):
            keys = ("cache_type", "bytes", "files", "stage_alone", "dvc_commit_s", "dvc_before_cmd_s", "dvc_after_cmd_s", "dvc_overhead_s", "repro_over_stage",
                    "repro_over_stage_measured", "repro_same_bytes", "dvc_push_s", "dvc_pull_s", "skipped")
            out[job.replace(":", "_")] = {k: c.get(k) for k in keys}
    if par := summarize_parallel(jobs):
        out["multi_gpu"] = par
    return out


def summarize_parallel(jobs: dict) -> dict:
    """Multi-GPU runs: per run tok/s, load and wall; scaling efficiency against the TP=1 run (tok/s over
    2 x TP=1's); per layer agreement with the base run (rel. RMS error, cosine mean/min); verify."""

    def run_row(run: str) -> dict | None:
        s = (jobs.get(f"stage:{run}") or jobs.get(f"ray:{run}") or {}).get("summary")
        if not s:
            return None
        if "skipped" in s:
            return {"skipped": s["skipped"]}
        row = {
            "extract": s.get("extract_params"),
            "tok_s": s.get("stage_tok_s"),
            "engine_tok_s": s.get("engine_tok_s_ready_to_last_finish"),
            "engine_load_s": s.get("engine_load_s"),
            "wall_s": (s.get("stage_metrics") or {}).get("wall_s"),
            "tokens": s.get("tokens"),
        }
        if s.get("eager"):
            row["eager"] = True
        if s.get("note"):
            row["note"] = s["note"]
        if s.get("shards_per_replica") is not None:
            row["shards_per_replica"] = s["shards_per_replica"]
        if v := jobs.get(f"verify:{run}", {}).get("summary"):
            keep = ("rel_rms_error", "calibration_rel_rms_error", "allowed", "cosine_mean", "cosine_min")
            row["verify"] = {
                "passed": v.get("passed"),
                "failure": v.get("failure"),
                "argmax_agreement": v.get("argmax_agreement"),
                "layers": {lid: {k: x[k] for k in keep if k in x} for lid, x in (v.get("layers") or {}).items()},
            }
        if c := jobs.get(f"compare:{run}", {}).get("summary"):
            row["vs_" + c["vs"]] = {
                "token_ids_equal": c["token_ids_equal"],
                "loss_masks_equal": c["loss_masks_equal"],
                "shards_byte_identical": f"{c['shards_byte_identical']}/{c['shards']}",
                "samples": c["samples"],
                "layers": {
                    lid: {k: round(x[k], 6) for k in ("rel_rms_error", "cos_mean", "cos_min", "max_abs_error")}
                    for lid, x in c["layers"].items()
                },
            }
        return row

    def efficiency(run: str, base: str, gpus: int, key: str) -> float | None:
        a, b = rows.get(run) or {}, rows.get(base) or {}
        if a.get(key) and b.get(key):
            return round(a[key] / (gpus * b[key]), 4)
        return None

    rows = {r: row for r in RUNS if (row := run_row(r)) is not None}
    out: dict = {}
    if "tp1" in rows or "tp2" in rows:
        out["tp"] = {
            "tp1": rows.get("tp1"),
            "tp2": rows.get("tp2"),
            "scaling_efficiency": efficiency("tp2", "tp1", 2, "tok_s"),
            "scaling_efficiency_engine": efficiency("tp2", "tp1", 2, "engine_tok_s"),
        }
    if "moetp2" in rows or "moeep2" in rows:
        out["moe_tp"] = {
            "moetp2": rows.get("moetp2"),
            "moeep2": rows.get("moeep2"),
            "ep_over_tp": efficiency("moeep2", "moetp2", 1, "tok_s"),
        }
    if "ray2" in rows:
        out["ray"] = {"ray2": rows["ray2"], "scaling_efficiency": efficiency("ray2", "tp1", 2, "tok_s")}
    return out
