"""bench step sens: how weak a fault in 16 positions of one layer of one sample the per-sample tests catch at the
8B shape's width (bench/verify_sample_sensitivity.py on the stage's GPU extraction, scored on the GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_jobs.common import REPO, log


def job_sens(state: dict, name: str) -> dict:
    """Per judged stride (SENS_STRIDES, default 4 then 1), the sensitivity bench on the first SENS_SHARDS shards
    (default 16) with SENS_VICTIMS victims (default 3) and errors SENS_EPS; its stdout into out/sens_NAME_strideS.txt."""
    import torch

    proj = Path(state[f"project_{name}"])
    env = dict(os.environ, DEVICE="cuda" if torch.cuda.is_available() else "cpu", SHARDS=os.environ.get("SENS_SHARDS", "16"),
               EPS=os.environ.get("SENS_EPS", "0.05,0.1,0.15,0.2,0.3,0.5,1"))
    out: dict = {}
    for stride in os.environ.get("SENS_STRIDES", "4,1").split(","):
        t = time.monotonic()
        run = subprocess.run([sys.executable, str(REPO / "bench/verify_sample_sensitivity.py"), str(proj), stride,
                              os.environ.get("SENS_VICTIMS", "3")], env=env, capture_output=True, text=True,
                             timeout=max(30, state["child_deadline_unix"] - time.time() - 5))
        (Path(state["out"]) / f"sens_{name}_stride{stride}.txt").write_text(run.stdout + "\n--- stderr ---\n" + run.stderr[-3000:])
        out[f"stride_{stride}"] = {"rc": run.returncode, "wall_s": round(time.monotonic() - t, 1), "stdout": run.stdout[-4000:]}
        log(f"sens {name} stride {stride}: rc {run.returncode}, {out[f'stride_{stride}']['wall_s']} s\n{run.stdout[-4000:]}")
    return {"summary": out}
