"""The fp8 job's figures: bf16 against fp8 shards on one workload, each stage against plain prefill and the disk.

The parent (parent.py, `run_fp8`) runs, on one workload: the extract stage storing fp8, the same stage storing bf16,
plain prefill on the same engine settings, and verify on every fp8 shard. The disk's own rate comes from
`bench/shard_write_bench.py --json`, run before the bench in the same call on the same disk (its file is named by
--disk-json). The binding limit of a stage is the lower of plain prefill's rate and the disk's best rate divided by
the stage's bytes per token.
"""

from __future__ import annotations

import json
from pathlib import Path


def fp8_figures(jobs: dict, workload: str, disk_json: str | None) -> dict:
    def s(job: str) -> dict:
        return jobs.get(job, {}).get("summary", {})

    def ratio(a, b):
        return round(a / b, 4) if a and b else None

    disk = json.loads(Path(disk_json).read_text()) if disk_json and Path(disk_json).is_file() else {}
    disk_gb_s = disk.get("disk_best_gb_per_s")
    plain = s(f"plain:{workload}").get("tok_s_all")
    out: dict = {"plain_tok_s": plain, "disk_best_gb_s": disk_gb_s, "disk": disk.get("disk")}
    for dtype, run in (("bfloat16", workload), ("float8_e4m3", f"{workload}_fp8")):
        st = s(f"stage:{run}")
        if not st:
            out[dtype] = None
            continue
        bpt = st.get("bytes_per_token")
        write_bound = disk_gb_s * 1e9 / bpt if disk_gb_s and bpt else None
        limit = min(x for x in (plain, write_bound) if x) if (plain or write_bound) else None
        out[dtype] = {
            "bytes_per_token": bpt,
            "stage_tok_s_ready_to_last_shard": st.get("tok_s_ready_to_last_shard"),
            "engine_tok_s_ready_to_last_finish": st.get("engine_tok_s_ready_to_last_finish"),
            "tail_last_finish_to_last_shard_s": st.get("tail_last_finish_to_last_shard_s"),
            "gpu_busy": st.get("gpu_busy_ready_to_last_shard"),
            "stage_over_plain": ratio(st.get("tok_s_ready_to_last_shard"), plain),
            "shard_write_gb_s": st.get("shard_write_gb_s"),
            "shard_write_over_disk": ratio(st.get("shard_write_gb_s"), disk_gb_s),
            "write_bound_tok_s": round(write_bound, 1) if write_bound else None,
            "binding_limit_tok_s": round(limit, 1) if limit else None,
            "stage_over_binding_limit": ratio(st.get("tok_s_ready_to_last_shard"), limit),
            "engine_load_s": st.get("engine_load_s"),
            "data_bytes": st.get("data_bytes"),
        }
    bf, f8 = out.get("bfloat16") or {}, out.get("float8_e4m3") or {}
    out["fp8_bytes_over_bf16"] = ratio(f8.get("bytes_per_token"), bf.get("bytes_per_token"))
    verify = s(f"verify:{workload}_fp8")
    out["verify_fp8_passed"] = verify.get("passed")
    out["verify_fp8_shards"] = verify.get("subset_shards")
    out["verify_fp8_s"] = verify.get("verify_s")
    out["verify_fp8_gpu_peak_bytes"] = verify.get("gpu_peak_bytes")
    out["verify_fp8_gpu_peaks"] = verify.get("gpu_peaks")
    out["verify_fp8_host_peak_rss_bytes"] = verify.get("host_peak_rss_bytes")
    return out
