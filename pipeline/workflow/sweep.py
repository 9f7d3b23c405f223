"""`make sweep`: compare EAGLE-3 layer choices with DVC experiments, in one table.

Each grid point is one `dvc exp run -S extract.layer_ids=[...]` (plus `-S train.epochs=N` when
`--train-epochs` / SWEEP_TRAIN_EPOCHS shortens training), run one after the other in the workspace.
DVC's per-stage caching does the rest: model and prepare do not depend on extract.layer_ids, so
they run at most once for the whole grid (the first point, if they are stale), and a layer set that
was already extracted is restored from the run-cache instead of extracted again. After each point
the sweep reads that point's metrics files (the previous point's are removed first, so a stage that
did not run leaves a blank, not a stale number) and at the end prints one table: layer ids, verify
status, training accuracy per draft step (validation full_acc_k), tau, tokens/s with and without
the draft, which stages ran. It is also written to reports/sweep.md and reports/sweep.json.

DVC experiments need a git repository with at least one commit (docs/EXPERIMENTS.md).
The workspace's params.yaml is restored afterwards; `dvc exp apply <name>` takes a point's
params and outputs, `dvc exp show` lists them all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pipeline.atomic import atomic_write_text
from pipeline.errors import PipelineError
from pipeline.layout import METRICS, REPORTS, TRAIN_METRICS
from pipeline.params import PARAMS_FILE, load_params, resolve_layer_ids

FILES = {"extract": METRICS / "extract.json", "verify": METRICS / "verify.json", "train": TRAIN_METRICS,
         "eval": METRICS / "eval.json"}
SWEEP_JSON = REPORTS / "sweep.json"
SWEEP_MD = REPORTS / "sweep.md"
RUNNING = re.compile(r"Running stage '([\w-]+)'")
FAILED = re.compile(r"failed to reproduce '([\w-]+)'")
SHARED = ("model", "prepare")  # do not depend on the layer ids: a failure there fails every point


def default_grid(num_layers: int) -> list[list[int]]:
    """The default EAGLE-3 layers, the auxiliary ones shifted one deeper, and a shallow set; the last
    id (the final layer's output) stays in every set."""
    default = resolve_layer_ids(None, num_layers)
    shifted = sorted({min(i + 1, num_layers - 1) for i in default[:-1]}) + [num_layers]
    shallow = [1, 2, 3, num_layers]
    grid: list[list[int]] = []
    for ids in (default, shifted, shallow):
        if ids not in grid and len(ids) >= 2:
            grid.append(ids)
    return grid


def parse_grid(text: str) -> list[list[int]]:
    """'2,4,5,8;3,5,6,8' -> [[2, 4, 5, 8], [3, 5, 6, 8]]."""
    return [[int(x) for x in part.split(",") if x.strip()] for part in text.split(";") if part.strip()]


def exp_name(ids: list[int], epochs: int | None) -> str:
    return "sweep-l" + "-".join(map(str, ids)) + (f"-e{epochs}" if epochs else "")


def num_target_layers(params) -> int:
    if params.model.is_embedded:
        return params.model.embedded.num_layers
    cfg = json.loads((Path(params.model.path) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


def collect(root: Path = Path(".")) -> dict:
    """One grid point's results from the metrics files the stages wrote (None where one is missing)."""
    m = {k: json.loads((root / p).read_text()) if (root / p).is_file() else None for k, p in FILES.items()}
    ext, ver, tr, ev = m["extract"], m["verify"], m["train"], m["eval"]
    val = (tr or {}).get("val", {})
    acc = [val[k] for k in sorted((k for k in val if k.startswith("full_acc_")), key=lambda k: int(k.rsplit("_", 1)[1]))]
    return {
        "extract_tok_per_s": (ext or {}).get("tok_per_s"),
        "verify": None if ver is None else ("passed" if ver.get("passed") else "FAILED"),
        "verify_layer_ids": (ver or {}).get("layer_ids"),
        "train_epochs": (tr or {}).get("epochs_trained"),
        "train_full_acc": acc or None,
        "tau": (ev or {}).get("tau"),
        "spec_tokens_per_s": (ev or {}).get("spec_tokens_per_s"),
        "baseline_tokens_per_s": (ev or {}).get("baseline_tokens_per_s"),
        "speedup": (ev or {}).get("speedup"),
    }


COLUMNS = ("experiment", "layer ids", "verify", "train acc per step", "tau", "tok/s (draft / plain)", "speedup",
           "extract tok/s", "stages run", "wall")


def row_cells(r: dict) -> list[str]:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    acc = "-" if not r.get("train_full_acc") else " / ".join(f"{a:.3f}" for a in r["train_full_acc"])
    tps = "-" if r.get("spec_tokens_per_s") is None else f"{r['spec_tokens_per_s']:.0f} / {r['baseline_tokens_per_s']:.0f}"
    status = r.get("verify") or "-"
    if r.get("returncode"):
        status += f" ({r.get('failed_stage') or 'exp'} failed, exit {r['returncode']})"
    return [r["name"], str(r["layer_ids"]), status, acc, f(r.get("tau"), ".3f"), tps, f(r.get("speedup"), ".2f"),
            f(r.get("extract_tok_per_s"), ",.0f"), ", ".join(r.get("stages_run") or []) or "none (all cached)",
            f(r.get("wall_s"), ".0f") + (" s" if r.get("wall_s") is not None else "")]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="layer-id sweep (dvc exp show lists the same experiments)", header_style="bold")
    for c in COLUMNS:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*row_cells(r))
    Console().print(t)


def check_git() -> None:
    try:
        subprocess.run(["git", "rev-parse", "--verify", "HEAD"], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise PipelineError(
            "DVC experiments need a git repository with at least one commit: run `git init && git add -A && "
            "git commit -m init` in the project (docs/EXPERIMENTS.md), then `make sweep` again"
        ) from None


def run_point(ids: list[int], epochs: int | None) -> dict:
    name = exp_name(ids, epochs)
    subprocess.run(["dvc", "exp", "remove", name], capture_output=True)  # a rerun replaces the old one
    for p in FILES.values():
        p.unlink(missing_ok=True)  # a stage that does not run must not leave the last point's numbers
    cmd = ["dvc", "exp", "run", "-n", name, "-S", f"extract.layer_ids=[{','.join(map(str, ids))}]"]
    if epochs:
        cmd += ["-S", f"train.epochs={epochs}"]
    print(f"[sweep] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    ran: list[str] = []
    failed: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        ran += RUNNING.findall(line)
        failed += FAILED.findall(line)
    rc = proc.wait()
    row = {"name": name, "layer_ids": ids, "returncode": rc, "failed_stage": failed[0] if failed else None,
           "stages_run": ran, "wall_s": round(time.monotonic() - t0, 1), **collect()}
    if row["verify_layer_ids"] not in (None, ids):
        raise PipelineError(f"{FILES['verify']} is of layers {row['verify_layer_ids']}, not {ids}: the sweep lost track")
    return row


def sweep(grid: list[list[int]], epochs: int | None) -> list[dict]:
    check_git()
    original = PARAMS_FILE.read_text()
    rows = []
    try:
        for ids in grid:
            rows.append(run_point(ids, epochs))
            if rows[-1]["failed_stage"] in SHARED:
                raise PipelineError(f"stage {rows[-1]['failed_stage']} failed (log above); it is the same for every "
                                    "layer set, so the sweep stops here")
    finally:
        PARAMS_FILE.write_text(original)
        if rows:
            REPORTS.mkdir(parents=True, exist_ok=True)
            atomic_write_text(SWEEP_JSON, json.dumps(rows, indent=1) + "\n")
            atomic_write_text(SWEEP_MD, markdown(rows))
    return rows


def main(grid_text: str | None, epochs: int | None) -> None:
    params = load_params()
    n = num_target_layers(params)
    grid = parse_grid(grid_text) if grid_text else default_grid(n)
    for ids in grid:
        resolve_layer_ids(ids, n)  # fail now, naming the bad set, not after the first points ran
    epochs = epochs or (int(os.environ["SWEEP_TRAIN_EPOCHS"]) if os.environ.get("SWEEP_TRAIN_EPOCHS") else None)
    print(f"[sweep] {len(grid)} layer sets on a {n}-layer target: {grid}" + (f"; train.epochs={epochs}" if epochs else ""))
    rows = sweep(grid, epochs)
    print_table(rows)
    print(f"[sweep] table in {SWEEP_MD}; `dvc exp show` lists the experiments, `dvc exp apply <name>` takes one")
    if any(r["returncode"] for r in rows):
        raise PipelineError("some grid points failed (exit status in the verify column); their logs are above")
