"""What fp8 hidden-state storage costs in draft quality: tau and validation accuracy, fp8 against bf16.

    .venv/bin/python bench/fp8_quality.py --out fp8-quality.json --dtypes bfloat16,float8_e4m3 --seeds 0,1,2

For each (extract.dtype, train.seed) pair the embedded default runs through the real pipeline,
`dvc repro eval`, in a clone of this repository's HEAD (commit the tree first) under --work, with
only those two keys changed in its params.yaml. bfloat16 and float8_e4m3 share the engine's dtype
(bf16): they differ only by the e4m3 quantization of the stored states (docs/FORMAT.md). Every
clone uses one DVC cache (`dvc cache dir --local`), so after the first run check, model and
prepare come from DVC's run-cache, and extract and verify from it for a dtype already extracted:
each run after the first trains and evaluates the draft (the first also trains the target).
Records tau and acceptance per position at eval.num_speculative_tokens (metrics/eval.json),
validation full_acc per position of the last epoch (metrics/train.json) and of every epoch
(metrics/train_curve.csv), verify's outcome, the stages run or restored and wall times; prints
a table with each dtype's mean and the ratio of mean tau to the first dtype's.
Machine: the project's 2-core x86-64 CPU (no GPU); measured 2026-12-06 (f7c308d): the first run 301 s
(the target trains), each later one about 100 s (train ~75 s, eval ~25 s), 6 runs 14 min.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGE_LINE = re.compile(r"Running stage '(\w+)'|Stage '(\w+)' is cached|Stage '(\w+)' didn't change")


def make_copy(dest: Path, rev: str, cache: Path, dtype: str, seed: int) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "checkout", "-q", "--detach", rev], cwd=dest, check=True)
    (dest / ".venv").symlink_to(ROOT / ".venv")  # bin/python runs .venv's python
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["extract"]["dtype"], params["train"]["seed"] = dtype, seed
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([str(ROOT / ".venv/bin/dvc"), "cache", "dir", "--local", str(cache)], cwd=dest, check=True,
                   stdout=subprocess.DEVNULL)


def repro(dest: Path) -> tuple[int, list[dict], str]:
    """`dvc repro eval` as `make eval` runs it; each stage's start (s from the run's start) and whether it ran."""
    env = {**os.environ, "PATH": f"{ROOT / '.venv/bin'}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    t0, events, lines = time.perf_counter(), [], []
    with open(dest / "repro.log", "w", buffering=1) as log:
        proc = subprocess.Popen(["dvc", "repro", "eval"], cwd=dest, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if m := STAGE_LINE.search(line):
                ran = m.group(1) is not None
                events.append({"stage": next(g for g in m.groups() if g), "ran": ran,
                               "at_s": round(time.perf_counter() - t0, 1)})
        rc = proc.wait()
    return rc, events, "".join(lines[-40:])


def collect(dest: Path) -> dict:
    def load(name: str) -> dict | None:
        p = dest / "metrics" / name
        return json.loads(p.read_text()) if p.is_file() else None

    out: dict = {}
    if (v := load("verify.json")) is not None:
        out["verify"] = {k: v.get(k) for k in ("passed", "checks", "num_failures", "num_warnings", "dtype")}
    if (t := load("train.json")) is not None:
        val = t["val"]
        out["val_full_acc"] = [val[k] for k in sorted(val) if k.startswith("full_acc_")]
        out["val_loss"] = val.get("loss")
        out["train_mean_epoch_s"] = t.get("mean_epoch_seconds")
        with open(dest / "metrics" / "train_curve.csv") as f:
            out["val_full_acc_per_epoch"] = [[float(r[k]) for k in sorted(r) if k.startswith("val_full_acc_")]
                                             for r in csv.DictReader(f)]
    if (e := load("eval.json")) is not None:
        out.update(tau=e["tau"], acceptance=e["acceptance_per_position"],
                   tau_predicted_from_training=e.get("tau_predicted_from_training"))
    if (x := load("extract.json")) is not None:
        out["extract"] = {k: x.get(k) for k in ("dtype", "samples", "tokens", "bytes_per_token", "wall_s")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("fp8-quality.json"))
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8-quality"), help="clones and the shared DVC cache")
    ap.add_argument("--keep", action="store_true", help="keep the clones (the cache is always kept)")
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    cache = args.work / "dvc-cache"
    cache.mkdir(parents=True, exist_ok=True)
    dtypes, seeds = args.dtypes.split(","), [int(s) for s in args.seeds.split(",")]
    results = {"commit": rev, "host": os.uname().nodename, "cpus": os.cpu_count(), "runs": []}
    for dtype in dtypes:
        for seed in seeds:
            dest = args.work / f"{dtype}-seed{seed}"
            t0 = time.perf_counter()
            make_copy(dest, rev, cache, dtype, seed)
            rc, events, tail = repro(dest)
            run = {"dtype": dtype, "seed": seed, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                   "stages": events, **collect(dest)}
            if rc != 0:
                run["error_tail"] = tail
            results["runs"].append(run)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"[fp8_quality] {dtype} seed {seed}: rc {rc}, {run['wall_s']} s, tau {run.get('tau')}, "
                  f"ran {[e['stage'] for e in events if e['ran']]}", flush=True)
            if not args.keep:
                shutil.rmtree(dest)
    print_table(results, dtypes)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


def print_table(results: dict, dtypes: list[str]) -> None:
    print(f"\n{'dtype':<12} {'seed':>4} {'tau':>6}  {'acceptance':<20} {'val full_acc':<20} {'wall s':>6}")
    means = {}
    for dtype in dtypes:
        runs = [r for r in results["runs"] if r["dtype"] == dtype and "tau" in r]
        for r in runs:
            print(f"{dtype:<12} {r['seed']:>4} {r['tau']:6.3f}  {' '.join(f'{a:.3f}' for a in r['acceptance']):<20} "
                  f"{' '.join(f'{a:.3f}' for a in r['val_full_acc']):<20} {r['wall_s']:6.0f}")
        if runs:
            means[dtype] = statistics.mean(r["tau"] for r in runs)
            acc = [statistics.mean(a) for a in zip(*(r["val_full_acc"] for r in runs), strict=True)]
            sd = statistics.stdev(r["tau"] for r in runs) if len(runs) > 1 else 0.0
            print(f"{dtype:<12} {'mean':>4} {means[dtype]:6.3f}  (sd {sd:.3f}){'':<9} "
                  f"{' '.join(f'{a:.3f}' for a in acc):<20}")
    if len(means) > 1:
        base = means[dtypes[0]]
        for dtype in dtypes[1:]:
            if dtype in means:
                print(f"mean tau {dtype} / {dtypes[0]}: {means[dtype] / base:.4f}")
    results["mean_tau"] = means
    results["tau_ratio_to_first"] = {d: means[d] / means[dtypes[0]] for d in means if dtypes[0] in means}


if __name__ == "__main__":
    main()
