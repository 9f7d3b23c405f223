"""Train the tiny project's draft with 1 and with N processes and print what each run gives.

    python bench/train_processes.py --out /tmp/tp --runs 1:192:0,2:96:0,1:192:1

Each run is `python -m pipeline train` (the real stage; N > 1 through torchrun) in its own copy
of one tiny project (tests/tiny_project.py, 48 samples of 48 tokens); a run is
nproc_per_node:max_len:seed. Prints val full_acc per position, val loss, steps per epoch,
mean epoch seconds and metrics/train.json's train_tokens_per_s, one JSON line per run.
On a GPU host the same command measures tokens/s with 1 and 2 GPUs (pass a bigger project by
pointing --project at a prepared, extracted and verified one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN = {"epochs": 4, "ttt_steps": 2, "lr": 3e-3, "val_fraction": 0.25}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", default="1:192:0,2:96:0,1:192:1")
    ap.add_argument("--project", type=Path, help="an existing project to copy (default: a new tiny one)")
    ap.add_argument("--epochs", type=int, default=TRAIN["epochs"])
    args = ap.parse_args()
    base = args.project
    if base is None:
        from tests.tiny_project import make_project

        base = args.out / "base"
        if not base.exists():
            make_project(base, n_samples=48)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for run in args.runs.split(","):
        nproc, max_len, seed = (int(x) for x in run.split(":"))
        root = args.out / f"p{nproc}-len{max_len}-seed{seed}"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(base, root, symlinks=True, ignore=shutil.ignore_patterns("draft", "train.json", "train_curve.csv"))
        params = yaml.safe_load((root / "params.yaml").read_text()) or {}
        params["train"] = {**params.get("train", {}), **TRAIN, "epochs": args.epochs, "max_len": max_len, "seed": seed,
                           "nproc_per_node": nproc}
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        t0 = time.perf_counter()
        with open(root / "train.log", "w") as log:
            subprocess.run([sys.executable, "-m", "pipeline", "train"], cwd=root, env=env, stdout=log, stderr=log, check=True)
        m = json.loads((root / "metrics" / "train.json").read_text())
        print(json.dumps({"run": run, "wall_s": round(time.perf_counter() - t0, 1), "steps": m["steps"],
                          "val_loss": m["val"]["loss"],
                          "val_full_acc": [m["val"][k] for k in sorted(m["val"]) if k.startswith("full_acc_")],
                          "mean_epoch_seconds": m["mean_epoch_seconds"], "train_tokens_per_s": m["train_tokens_per_s"]}),
              flush=True)


if __name__ == "__main__":
    main()
