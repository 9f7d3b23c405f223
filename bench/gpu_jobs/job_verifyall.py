"""bench step verifyall: verify's cost in every mode, and the final-head micro-benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_jobs.common import log
from gpu_jobs.job_verify import _run_verify

# verify's modes on the same data: as a user runs it (defaults: values from the extractor's records, sha256 +
# statistics re-derived on the audit sample, check 4 on a seeded 2,048 masked positions per shard), and what the
# environment below adds (every shard read in full, every masked position, strides, threads, GPU slots, a profile)
VERIFY_MODES = {  # "default" first in this process: it pays the process's first CUDA calls, as `make verify` does
    "default": {},
    "default_again": {},
}
# a short call: no cold process and no second default run (the first mode then pays the process's first CUDA calls)
SHORT = os.environ.get("VERIFY_SHORT") == "1"
if SHORT:
    del VERIFY_MODES["default_again"]
if os.environ.get("VERIFY_EVERY_POSITION") == "1":  # check 4 on every masked position (the default: a seeded 2,048)
    VERIFY_MODES["every_position"] = {"final_state_positions_per_shard": None}
if os.environ.get("VERIFY_READ_ALL") == "1":  # every shard re-hashed and read in full
    VERIFY_MODES["read_all"] = {"hash_all_shards": True, "audit_fraction": 1.0, "final_state_positions_per_shard": None}
for stride in filter(None, os.environ.get("VERIFY_SAMPLE_STRIDES", "").split(",")):  # the per-sample tests' cost per judged byte
    VERIFY_MODES[f"sample_stride_{stride}"] = {"sample_stride": int(stride)}
for workers in filter(None, os.environ.get("VERIFY_WORKERS", "").split(",")):  # how the scan scales with its threads
    VERIFY_MODES[f"workers_{workers}"] = {"workers": int(workers)}
for slots in filter(None, os.environ.get("VERIFY_SCORING_SLOTS", "").split(",")):  # GPU streams the scoring threads share
    VERIFY_MODES[f"scoring_slots_{slots}"] = {"_scoring_slots": int(slots)}
if os.environ.get("VERIFY_SWITCH_INTERVAL"):  # the GIL's switch interval (s; Python's default 0.005) during the run
    VERIFY_MODES[f"switch_interval_{os.environ['VERIFY_SWITCH_INTERVAL']}"] = {"_switch_interval": float(os.environ["VERIFY_SWITCH_INTERVAL"])}
# the scan's CUDA kernels (their total and their union against its wall) and the host's CUDA API calls: "1" a run of
# its own after the others; or the modes to profile, e.g. "default,default_again" (the process's first scan and a warm one)
PROFILED = os.environ.get("VERIFY_TORCH_PROFILE", "")
if PROFILED == "1":
    VERIFY_MODES["kernel_profile"] = {"_kernel_profile": True}
if os.environ.get("VERIFY_TORCH_THREADS"):  # torch's intra-op threads (CPU ops of 16 scan threads may oversubscribe)
    VERIFY_MODES[f"torch_threads_{os.environ['VERIFY_TORCH_THREADS']}"] = {"_torch_threads": int(os.environ["VERIFY_TORCH_THREADS"])}
# any other modes, as JSON {"name": {verify param: value}}, e.g. '{"check4_256": {"final_state_positions_per_shard": 256}}'
VERIFY_MODES.update(json.loads(os.environ.get("VERIFY_EXTRA_MODES", "{}")))
if os.environ.get("VERIFY_STREAMED_GIB"):  # the streamed reference under a budget below the model's size
    VERIFY_MODES["streamed"] = {"reference_memory_gib": float(os.environ["VERIFY_STREAMED_GIB"])}


# verify's own run in a fresh interpreter: imports (torch, transformers, datasets) included
# (VERIFY_COLD_PARAMS in its environment: verify params as JSON, e.g. '{"workers": 4}'; a cold process variant's)
COLD_PROCESS = (
    "import json, os, time; t = time.monotonic(); from pipeline.params import VerifyParams; from pipeline.stages import verify; "
    "i = time.monotonic() - t; verify.run(VerifyParams(**json.loads(os.environ.get('VERIFY_COLD_PARAMS', '{}')))); "
    "print('COLD', i, time.monotonic() - t, verify.__file__)"
)


def gpu_memory_used_gib() -> float | None:
    """GPU memory in use on the machine (every process's), from nvidia-smi: a cold process is compared with another only
    where it had the GPU as free (a cold run that finds only ~29 GB free streams its reference, and is slower for
    it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return round(sum(float(x) for x in out.stdout.split()) / 1024, 2) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def release_gpu_memory() -> None:
    """What this process's allocator caches goes back to the GPU before a cold process starts."""
    import gc

    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.empty_cache()


def run_cold_process(proj: Path, code: str, code_dir: str | None = None, extra_env: dict | None = None) -> dict:
    """verify in a fresh interpreter (`code`), its wall, its imports' time, and its metrics' timings. `code_dir`: a
    directory whose `pipeline` package the process imports instead of this checkout's (an older commit's, for a
    before/after in one call); `extra_env`: variables set for it (VERIFY_COLD_VARIANTS)."""
    from pipeline import layout

    release_gpu_memory()
    used_before = gpu_memory_used_gib()
    env = {**os.environ, **(extra_env or {})}
    if code_dir:
        env["PYTHONPATH"] = f"{Path(code_dir).resolve()}:{env.get('PYTHONPATH', '')}".rstrip(":")
    t = time.monotonic()
    cold = subprocess.run([sys.executable, "-c", code], cwd=proj, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t
    line = next((x for x in cold.stdout.splitlines() if x.startswith("COLD")), None)
    metrics = json.loads((proj / layout.METRICS / "verify.json").read_text()) if cold.returncode == 0 else None
    return {
        "passed": cold.returncode == 0,
        "code": line.split()[3] if line else code_dir,  # the verify module the process ran
        "env": extra_env or {},
        "process_wall_s": round(wall, 2),
        "gpu_used_before_gib": used_before,
        "imports_s": round(float(line.split()[1]), 2) if line else None,
        "imports_and_run_s": round(float(line.split()[2]), 2) if line else None,
        "stderr_tail": cold.stderr[-1500:] if cold.returncode else None,
        "metrics": {k: v for k, v in metrics.items() if k.endswith("seconds") or k in
                    ("reference", "reference_load", "verify_workers", "staging_bytes", "final_state_head", "final_state_positions")}
        if metrics else None,
    }


def py_spy() -> str | None:
    """py-spy's binary: on PATH, or its manylinux wheel's contents unzipped into /tmp/site (the bundle does not carry it)."""
    import glob
    import shutil

    found = shutil.which("py-spy") or next(iter(glob.glob("/tmp/site/py_spy-*.data/scripts/py-spy")), None)
    if found:
        os.chmod(found, 0o755)
    return found


def profiled_cold_process(proj: Path, out: Path) -> dict:
    """The cold verify process once more, sampled by py-spy (every thread, idle ones too, or VERIFY_PYSPY=gil: only
    the one holding the GIL; 100 Hz): where the
    scan's threads spend the wall, as collapsed stacks (out/verify_pyspy.txt; `bench/pyspy_summary.py` reads it)."""
    binary = py_spy()
    if binary is None:
        return {"skipped": "no py-spy (unzip its manylinux wheel into /tmp/site)"}
    target = out / "verify_pyspy.txt"
    # VERIFY_PYSPY=gil: only samples of threads holding the GIL (how much of the wall one interpreter lock holds)
    which = ["--gil"] if os.environ.get("VERIFY_PYSPY") == "gil" else ["--idle"]
    rate = os.environ.get("VERIFY_PYSPY_RATE", "100")  # samples a second (bench/pyspy_summary.py's third argument)
    cmd = [binary, "record", *which, "--threads", "--rate", rate, "--format", "raw", "--output", str(target),
           "--", sys.executable, "-c", COLD_PROCESS]
    t = time.monotonic()
    run = subprocess.run(cmd, cwd=proj, capture_output=True, text=True)
    return {"rc": run.returncode, "wall_s": round(time.monotonic() - t, 2), "file": target.name if target.exists() else None,
            "stdout_tail": run.stdout[-600:], "stderr_tail": run.stderr[-1500:]}


def head_microbench(ref) -> dict:
    """The final-state pass's parts on one 8,192-position chunk (ms), and FinalHead on 96 chunks
    from 16 threads with 1-3 GPU slots (s)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pipeline.verification import final_head as verify_final_head

    dev, bf16 = ref.device, torch.bfloat16
    if dev.type != "cuda":
        return {"skipped": "no GPU"}
    weight = ref.lm_head.weight.detach().to(bf16)
    n, hidden = verify_final_head.FINAL_CHUNK_POSITIONS, weight.shape[1]
    x = torch.randn(n, hidden, device=dev, dtype=bf16)

    def ms(fn, reps=10):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t) / reps * 1e3, 2)

    out = {"mm_bf16_out_ms": ms(lambda: torch.mm(x, weight.t())),
           "mm_fp32_out_ms": ms(lambda: torch.mm(x, weight.t(), out_dtype=torch.float32))}
    logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
    out["argmax_fp32_ms"] = ms(lambda: logits.argmax(-1))
    out["norm_fp32_ms"] = ms(lambda: ref.final_norm(x.float()))
    logits = None  # 4 GiB
    host = torch.randn(n, hidden).to(bf16)
    pinned = host.pin_memory()
    out["h2d_pageable_ms"] = ms(lambda: host.to(dev))
    out["h2d_pinned_ms"] = ms(lambda: pinned.to(dev, non_blocking=True))
    t = time.perf_counter()
    for _ in range(10):
        host.pin_memory()
    out["pin_memory_copy_ms"] = round((time.perf_counter() - t) * 100, 2)
    chunks = 96
    states = torch.empty(chunks * n, hidden, dtype=bf16).normal_()
    slots_before = verify_final_head.FINAL_HEAD_SLOTS
    for slots in (1, 2, 3):
        verify_final_head.FINAL_HEAD_SLOTS = slots
        head = verify_final_head.FinalHead(ref)
        head.argmax(states[:n])
        torch.cuda.synchronize()
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i, head=head: head.argmax(states[i * n : (i + 1) * n]), range(chunks)))
        out[f"final_head_{chunks}_chunks_{slots}_slots_s"] = round(time.perf_counter() - t, 3)
    verify_final_head.FINAL_HEAD_SLOTS = slots_before
    return out


def kernel_profile(prof) -> dict:
    """The profiled scan's CUDA work: kernel and copy time summed over streams, the union of their intervals (the
    time the GPU had any of it running), and the kernels that took most."""
    from torch.autograd import DeviceType

    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    union, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            union += b - max(a, end)
            end = b
    # the GPU's busy share in each tenth of [first op, last op]: a slow start, a tail or gaps all through
    tenths = [0.0] * 10
    if spans:
        begin, width = spans[0][0], max((spans[-1][1] - spans[0][0]) / 10, 1e-9)
        merged, (a0, b0) = [], spans[0]
        for a, b in spans[1:]:
            if a > b0:
                merged.append((a0, b0))
                a0, b0 = a, b
            else:
                b0 = max(b0, b)
        merged.append((a0, b0))
        for a, b in merged:
            for k in range(int((a - begin) // width), min(int((b - begin) // width), 9) + 1):
                lo, hi = begin + k * width, begin + (k + 1) * width
                tenths[k] += max(0.0, min(b, hi) - max(a, lo)) / width
    by_name: dict[str, list] = {}
    api: dict[str, list] = {}  # the host's CUDA runtime and driver calls (launches, allocations, synchronisations, loads)
    for e in events:
        table = by_name if e.device_type == DeviceType.CUDA else api
        row = table.setdefault(e.name[:80], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += e.time_range.end - e.time_range.start
        row[2] = max(row[2], e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    calls = sorted(api.items(), key=lambda kv: -kv[1][1])[:15]
    return {"gpu_work_s": round(sum(b - a for a, b in spans) / 1e6, 3), "gpu_any_busy_s": round(union / 1e6, 3),
            "gpu_ops": len(spans), "busy_by_tenth": [round(x, 2) for x in tenths], "first_to_last_s": round((spans[-1][1] - spans[0][0]) / 1e6, 3) if spans else None,
            "top": [{"name": k, "count": v[0], "s": round(v[1] / 1e6, 4)} for k, v in top],
            "host_calls": [{"name": k, "count": v[0], "thread_s": round(v[1] / 1e6, 4), "longest_ms": round(v[2] / 1e3, 2)}
                           for k, v in calls]}


def profiling_scan(timings: dict) -> None:
    """Wrap the scan (verify_shards.scan_shards: every shard's pass, after the fit) in a CUDA-only torch profiler for
    one run."""
    import torch

    from pipeline.verification import shards as verify_shards

    scan = verify_shards.scan_shards

    def profiled(*a, **kw):
        verify_shards.scan_shards = scan
        if not torch.cuda.is_available():
            timings["kernels"] = {"skipped": "no GPU"}
            return scan(*a, **kw)
        t = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            r = scan(*a, **kw)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        try:
            timings["kernels"] = {"scan_wall_s": round(wall, 3), **kernel_profile(prof)}
        except Exception as e:  # a bench summary: the run's verdict and wall stand without it
            timings["kernels"] = {"error": repr(e)[:300]}
        return r

    verify_shards.scan_shards = profiled


def watch_fit_memory(timings: dict) -> None:
    """The coherence fit's GPU memory (its Gram matrices), into `timings`: allocated before it, its peak above that,
    and what it leaves allocated (the references may load beside it: their growth is in the peak too)."""
    import torch

    from pipeline.verification import shards as verify_shards

    if not torch.cuda.is_available() or getattr(verify_shards.fit_coherence, "watched", False):
        return
    orig = verify_shards.fit_coherence

    def fit(*a, **kw):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = orig(*a, **kw)
        timings["fit_before_gib"] = round(before / 2**30, 2)
        timings["fit_peak_above_gib"] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 2)
        timings["fit_left_gib"] = round((torch.cuda.memory_allocated() - before) / 2**30, 2)
        return r

    fit.watched = True
    verify_shards.fit_coherence = fit


def job_verify_all(state: dict, name: str) -> dict:
    """The verify stage on every shard of the stage's extraction, in a fresh interpreter and then
    in each of VERIFY_MODES, timed against that extraction (the budget: verify's data pass <= 5% of
    the extraction's data time)."""
    from pipeline import layout
    from pipeline.stages import verify

    proj = Path(state[f"project_{name}"])
    timings: dict = {}
    watch_fit_memory(timings)
    for fn in ("check_structure_and_values", "check_reference", "write_outputs"):
        orig = getattr(verify, fn)

        def timed(*a, _orig=orig, _fn=fn, **kw):
            t = time.monotonic()
            r = _orig(*a, **kw)
            timings[f"{_fn}_s"] = round(time.monotonic() - t, 2)
            return r

        setattr(verify, fn, timed)
    extract = json.loads((proj / layout.METRICS / "extract.json").read_text())
    # the extraction's data time, from the engine ready to the last shard written (what docs/BENCHMARKS.md
    # "Verify's cost" divides by)
    extract_run_s = state.get(f"data_s_{name}") or extract["wall_s"] - extract.get("engine_load_s", 0)
    summary = {
        "extract_wall_s": extract["wall_s"],
        "extract_engine_load_s": extract.get("engine_load_s"),
        "extract_tok_s": extract.get("tok_per_s"),
        "extract_time_s": extract.get("time_s"),
        "extract_data_s": extract_run_s,
    }
    model_dir = json.loads((proj / "artifacts/model/target.json").read_text())["path"]
    only_preloaded = os.environ.get("VERIFY_ONLY_PRELOADED") == "1"  # the data pass alone, nothing else
    if only_preloaded or SHORT:
        summary["cold_process"] = {"skipped": "VERIFY_ONLY_PRELOADED or VERIFY_SHORT"}
    else:
        summary["cold_process"] = run_cold_process(proj, COLD_PROCESS)
    log(f"verifyall {name} cold_process: {json.dumps(summary['cold_process'])}")
    # more cold processes, before this process holds any GPU memory: another commit's pipeline/ (for a before/after in
    # one call) or other settings of the environment, as JSON {"name": {"code": directory or null, "env": {variable:
    # value}}}
    for variant, how in ({} if only_preloaded else json.loads(os.environ.get("VERIFY_COLD_VARIANTS", "{}"))).items():
        summary[f"cold_process_{variant}"] = run_cold_process(proj, COLD_PROCESS, how.get("code"), how.get("env"))
        log(f"verifyall {name} cold_process_{variant}: {json.dumps(summary[f'cold_process_{variant}'])}")
    if os.environ.get("VERIFY_PYSPY") in ("1", "gil"):
        summary["profiled_cold_process"] = profiled_cold_process(proj, Path(state["out"]))
        log(f"verifyall {name} profiled_cold_process: {json.dumps(summary['profiled_cold_process'])}")
    import torch

    from pipeline.verification.samples import scores as verify_samples

    # VERIFY_COLD_ONLY=1: the cold processes alone (a short call: no in-process runs, no profile)
    cold_only = os.environ.get("VERIFY_COLD_ONLY") == "1"
    for mode, params in ({} if only_preloaded or cold_only else VERIFY_MODES).items():
        timings.clear()
        params = dict(params)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(params.pop("_torch_threads", threads_before))
        slots_before = verify_samples.SCORING_SLOTS
        verify_samples.SCORING_SLOTS = params.pop("_scoring_slots", slots_before)
        if params.pop("_kernel_profile", False) or mode in PROFILED.split(","):
            profiling_scan(timings)
        interval_before = sys.getswitchinterval()
        sys.setswitchinterval(params.pop("_switch_interval", interval_before))
        failed, verify_s = _run_verify(proj, **params)
        sys.setswitchinterval(interval_before)
        torch.set_num_threads(threads_before)
        verify_samples.SCORING_SLOTS = slots_before
        metrics = json.loads((proj / layout.METRICS / "verify.json").read_text())
        (Path(state["out"]) / f"verifyall_{name}_{mode}_report.md").write_text((proj / "reports/verify/report.md").read_text())
        scan_s = timings.get("check_structure_and_values_s")
        summary[mode] = {
            "passed": failed is None,
            "failure": failed,
            "verify_s": round(verify_s, 2),
            **timings,
            "scan_s": metrics.get("scan_seconds"),
            "staging_s": metrics.get("staging_seconds"),
            "reference": metrics.get("reference"),
            "reference_choice": metrics.get("reference_choice"),
            "reference_load": metrics.get("reference_load"),
            "reference_load_seconds": metrics.get("reference_load_seconds"),
            "reference_check_seconds": metrics.get("reference_check_seconds"),
            "verify_seconds": metrics.get("verify_seconds"),
            "argmax_agreement": metrics.get("argmax_agreement"),
            "layer_rel_rms_error": {k: v.get("rel_rms_error") for k, v in (metrics.get("layers") or {}).items()},
            "scan_thread_seconds": metrics.get("scan_thread_seconds"),
            "final_state_head": metrics.get("final_state_head"),
            "masked_positions": metrics.get("masked_positions"),
            "workers": metrics.get("verify_workers"),
            "audited_shards": len(metrics.get("audited_shards") or []),
            "hashed_shards": metrics.get("hashed_shards"),
            "num_shards": metrics.get("num_shards"),
            "total_bytes": metrics.get("total_bytes"),
            "num_tokens": metrics.get("num_tokens"),
            "final_state_positions": metrics.get("final_state_positions"),
            "verify_over_extract_wall": round(verify_s / extract["wall_s"], 4),
            # the part that grows with the data, against the extraction's part that does
            "scan_over_extract_after_load": round(scan_s / extract_run_s, 4) if scan_s else None,
            "checks": metrics.get("checks"),
        }
        log(f"verifyall {name} {mode}: {json.dumps(summary[mode])}")
    if os.environ.get("VERIFY_SKIP_PRELOADED") == "1" or cold_only:
        log(f"verifyall {name}: {json.dumps(summary)}")
        return {"summary": summary}
    # the data pass alone: references loaded beforehand (what grows with the data, without the
    # load it otherwise overlaps)
    from pipeline.verification.reference import model as reference

    meta = json.loads((proj / layout.HIDDEN_STATES_DIR / "extract_meta.json").read_text())
    preloaded = reference.load_references(Path(model_dir), meta["dtype"])
    verify.load_references = lambda *a, **k: preloaded
    for mode, params in {"references_preloaded": {}}.items():
        timings.clear()
        failed, verify_s = _run_verify(proj, **params)
        metrics = json.loads((proj / layout.METRICS / "verify.json").read_text())
        summary[mode] = {
            "passed": failed is None, "failure": failed, "verify_s": round(verify_s, 2), **timings,
            "scan_s": metrics.get("scan_seconds"), "reference_check_seconds": metrics.get("reference_check_seconds"),
            "final_state_positions": metrics.get("final_state_positions"),
            "scan_thread_seconds": metrics.get("scan_thread_seconds"),
            "scan_over_extract_after_load": round(metrics["scan_seconds"] / extract_run_s, 4),
        }
        log(f"verifyall {name} {mode}: {json.dumps(summary[mode])}")
    if os.environ.get("VERIFY_HEAD_MICROBENCH") == "1":
        summary["head_microbench"] = head_microbench(preloaded.fp32)
        log(f"verifyall {name} head_microbench: {json.dumps(summary['head_microbench'])}")
    log(f"verifyall {name}: {json.dumps(summary)}")
    return {"summary": summary}
