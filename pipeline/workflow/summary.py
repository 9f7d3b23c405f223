"""What a `make repro` (or `make <stage>`) proved, in a few lines, read from metrics/*.json.

`python -m pipeline summary --since T` (the Makefile, after `dvc repro`): one line per stage whose
metrics were written at or after T (Unix seconds: the stages that ran), then where the reports and
plots are and how to share the results. Without --since: every stage that has metrics.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pipeline.layout import METRICS, REPORTS


def _n(value) -> str:
    """A count with thousands separators (as it is, if it is not one)."""
    return f"{value:,}" if isinstance(value, int) else str(value)


def _read(name: str) -> dict | None:
    try:
        return json.loads((METRICS / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _model(m: dict) -> str:
    if not m.get("embedded"):
        return "model: a local target, checked"
    loss = m.get("final_loss")
    return (f"model: the embedded {m.get('architecture', '')} target trained"
            + (f", final loss {loss:.4f}" if isinstance(loss, float) else ""))


def _prepare(m: dict) -> str:
    return f"prepare: {m.get('kept', '?')} conversations to train on ({_n(m.get('tokens', '?'))} tokens), {m.get('heldout', '?')} held out"


def _extract(m: dict) -> str:
    """What the output holds; after a resume, also what this run extracted of it."""
    held = (f"hidden states of {m.get('output_samples', m.get('samples', '?'))} samples "
            f"({_n(m.get('output_tokens', m.get('tokens', '?')))} tokens), layers {m.get('layer_ids')}, {m.get('dtype', '?')}, "
            f"{m.get('shards_written', 0) + m.get('shards_resumed', 0)} shards")
    if not m.get("shards_resumed"):
        return f"extract: {held}"
    return (f"extract: {held}; this run extracted {m.get('samples', '?')} samples ({_n(m.get('tokens', '?'))} tokens) "
            f"into {m.get('shards_written', 0)} shards, {m['shards_resumed']} shards were complete from an earlier run")


def _verify(m: dict) -> str:
    checks = m.get("checks") or {}
    judged = (m.get("sample_tests") or {}).get("judged_positions")
    not_run = m.get("tests_not_run") or []
    verdict = "passed" if m.get("passed") else "FAILED"
    if m.get("passed") and not_run:  # a small run: what could not be judged is said, not passed over
        verdict = ("passed, with these tests not run: "
                   + ", ".join(sorted({f"{e['test'].split(' (')[0]} (from {e['needs']:,} {e['unit']})" for e in not_run}))
                   + ";")
    return (f"verify: {verdict}{'' if verdict.endswith(';') else ','} every one of {m.get('num_samples', '?')} samples "
            f"({_n(m.get('num_tokens', '?'))} tokens) judged"
            + (f", {_n(judged)} positions by the per-sample tests" if judged else "")
            + f", {len(m.get('reference_samples', []))} re-computed by a transformers reference"
            + (": " + ", ".join(f"{c} {s}" for c, s in sorted(checks.items())) if checks else ""))


def _train(m: dict) -> str:
    acc = [round(v, 3) for k, v in sorted(m.get("val", {}).items()) if k.startswith("full_acc_")]
    return (f"train: {m.get('epochs_trained', '?')} epochs of speculators' EAGLE-3 trainer, "
            f"validation accuracy by draft position {acc}")


def _eval(m: dict) -> str:
    acc = [round(a, 3) for a in m.get("acceptance_per_position", [])]
    speed = m.get("speedup")
    line = f"eval: tau {m.get('tau', float('nan')):.3f} at k = {m.get('num_speculative_tokens')}, acceptance {acc}, "
    if m.get("device") == "gpu" and isinstance(speed, (int, float)):
        line += (f"speedup x{speed:.2f} ({m.get('spec_tokens_per_s', 0):.0f} vs {m.get('baseline_tokens_per_s', 0):.0f} "
                 "tok/s), ")
    elif m.get("device") == "cpu":  # a tiny target's decode on a few cores times the host, not speculation: tau is the figure
        line += "no decode speedup stated (measured on a CPU, it is noise), "
    return line + f"outputs identical {m.get('outputs_identical')}/{m.get('num_prompts')}"


LINES: dict[str, Callable[[dict], str]] = {
    "model": _model, "prepare": _prepare, "extract": _extract, "verify": _verify, "train": _train, "eval": _eval,
}
WHERE = (
    ("verify report and plots", REPORTS / "verify" / "report.md"),
    ("eval report", REPORTS / "eval.md"),
    ("training curve", METRICS / "train_curve.csv"),
    ("stage logs (engine output)", Path("logs")),
)


def summary(since: float | None = None) -> list[str]:
    ran = [s for s in LINES if (METRICS / f"{s}.json").is_file()
           and (since is None or (METRICS / f"{s}.json").stat().st_mtime >= since)]
    if not ran:
        return ["summary: nothing ran; every stage asked for is up to date (`dvc status` says what would run)"]
    lines = [f"summary of {'this run' if since is not None else 'the last runs'}:"]
    for stage in ran:
        m = _read(stage)
        if m is not None:
            lines.append("  " + LINES[stage](m))
    where = [f"{what} {path}" for what, path in WHERE if path.exists()]
    if where:
        lines.append("  where: " + "; ".join(where) + " (`dvc plots show` draws the plots)")
    lines.append("  share: `make push` sends the outputs and the run-cache to the DVC remote; a teammate runs `make pull`")
    return lines


def main(since: float | None) -> None:
    print("\n".join(summary(since)), flush=True)
