"""eval stage: the trained draft with speculative decoding in vLLM, against the same engine without it.

Each engine runs in its own child process (`python -m pipeline.stages.eval <spec.json>`), so its
memory is returned to the system before the next starts. Greedy decoding on the held-out prompts;
mean acceptance length tau = 1 + accepted / drafts from vLLM's own counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.atomic import atomic_write_text
from pipeline.console import current_log, say
from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.layout import HELDOUT_PROMPTS, METRICS, REPORTS, TRAIN_METRICS
from pipeline.params import EvalParams
from pipeline.target import Target, load_target
from pipeline.training.draft import final_draft
from pipeline.watchdog import watch

EVAL_METRICS = METRICS / "eval.json"
EVAL_REPORT = REPORTS / "eval.md"
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def load_prompts(target: Target, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    if not HELDOUT_PROMPTS.is_file():
        raise PipelineError(f"{HELDOUT_PROMPTS} not found: run the prepare stage")
    tok = AutoTokenizer.from_pretrained(target.path, trust_remote_code=target.trust_remote_code)
    lines = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()][:n]
    if not lines:
        raise PipelineError(f"{HELDOUT_PROMPTS} holds no prompts; lower data.heldout_fraction's rounding or add data")
    prompts = []
    for line in lines:
        ids = tok.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def engine_main(spec: dict) -> dict:
    """Runs in the child process: one vLLM engine, a warm-up, then all prompts in one batch."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["cpu_kvcache_gib"]))
    # asked of vLLM, not torch: torch.accelerator / torch.cuda would register torch's fork guard, and the
    # engine process vLLM forks on a GPU would fail to initialise CUDA (vllm_compat.on_cuda)
    if vllm_compat.on_cuda():
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the packed GPU tree has no flashinfer
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # ~3 s start instead of ~20 s on CPU
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.extraction.vllm_compat import cpu_mla_overrides

    with watch("eval", Path(spec["log"]) if spec["log"] else None) as dog:
        # the parent shows this process's stall message (the log's tail may end in the stacks)
        dog.on_stall(lambda: Path(spec["stalled"]).write_text(dog.message))
        kept = "The draft and the earlier stages are kept: the re-run runs eval alone."
        dog.engine_starting(spec["engine_start_timeout_s"], "eval.engine_start_timeout_s", kept)
        # an MLA (DeepSeek-V3-shaped) target on CPU: the exact rotary, and a step budget that fits a whole prompt
        mla = cpu_mla_overrides(Path(spec["target"]), spec["max_model_len"], None, "eval")
        llm = vllm_compat.start_llm(
            "eval", spec,
            **mla,
            model=spec["target"],
            speculative_config=spec["speculative_config"],
            enforce_eager=spec["enforce_eager"],
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
            tensor_parallel_size=spec["tensor_parallel_size"],
            gpu_memory_utilization=spec["gpu_memory_utilization"],
            trust_remote_code=spec["trust_remote_code"],
            disable_log_stats=False,  # keeps the spec-decode counters get_metrics() reads
            seed=0,
        )
        dog.engine_running("decoding the held-out prompts (no request finished)", spec["engine_stall_timeout_s"],
                           "eval.engine_stall_timeout_s", kept)
        bar = dog.progress_bar()
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=bar)  # warm-up
        before = _spec_counters(llm)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=bar)
        seconds = time.perf_counter() - t0
        after = _spec_counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        n_tokens = sum(map(len, tokens))
        spec_counts = {k: _minus(v, before.get(k)) for k, v in after.items()}  # without the warm-up's drafts
        decode = {str(b): _timed_batches(llm, prompts, b, greedy, bar) for b in spec["decode_batch_sizes"]}
    return {"tokens": tokens, "seconds": seconds, "generated_tokens": n_tokens, "tokens_per_s": n_tokens / seconds,
            "spec": spec_counts, "decode": decode}


def _timed_batches(llm, prompts: list, batch: int, sampling, bar) -> dict:
    """Every prompt, cycled to whole batches, in generate calls of `batch` requests each. The prompts ran
    once already, so with prefix caching on (vLLM's GPU default) their prefill is mostly a cache hit: the
    time is decode's, in the speculative engine and the plain one alike."""
    n = -(-max(len(prompts), batch) // batch) * batch
    requests = [prompts[i % len(prompts)] for i in range(n)]
    tokens, seconds = 0, 0.0
    for i in range(0, n, batch):
        t0 = time.perf_counter()
        outputs = llm.generate(requests[i : i + batch], sampling, use_tqdm=bar)
        seconds += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"batch_size": batch, "requests": n, "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _minus(a: int | list[int], b: int | list[int] | None) -> int | list[int]:
    if b is None:
        return a
    return [x - y for x, y in zip(a, b, strict=True)] if isinstance(a, list) else a - b


def _spec_counters(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in SPEC_COUNTERS:
            out[name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def run_engine(spec: dict, label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="eval-") as tmp:
        spec_path, out_path, stalled = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "stalled.txt"
        log = current_log()
        spec_path.write_text(json.dumps({**spec, "stalled": str(stalled), "log": str(log.resolve()) if log else None}))
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.stages.eval", str(spec_path), str(out_path)],
                                start_new_session=True)
        try:
            rc = proc.wait()
        finally:  # vLLM's engine-core process can outlive its parent, holding (GPU) memory
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            wait_group_exited(proc.pid, label)
        if stalled.is_file():
            raise PipelineError(f"the {label} vLLM engine stopped: " + stalled.read_text().removeprefix("[eval] error: "))
        if rc != 0 or not out_path.is_file():
            raise PipelineError(f"the {label} vLLM engine failed (exit {rc}); its output is in the stage's log")
        return json.loads(out_path.read_text())


def wait_group_exited(pgid: int, label: str, timeout_s: float = 120.0) -> None:
    """SIGKILL is asynchronous: a killed engine's processes, and the GPU memory they hold, can linger for
    seconds, and the next engine would then find less free memory than eval.gpu_memory_utilization asks.
    Exited (zombie) processes hold none."""
    deadline = time.monotonic() + timeout_s
    while _live_members(pgid):
        if time.monotonic() > deadline:
            raise PipelineError(f"the {label} vLLM engine's processes (group {pgid}) were still alive {timeout_s:.0f} s "
                                "after SIGKILL; the next engine would not find its GPU memory free")
        time.sleep(0.2)


def _live_members(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # exited while being read
        if int(group) == pgid and state != "Z":
            return True
    return False


def reconcile(train_metrics: dict | None, accept: list[float], max_gap: float) -> list[dict]:
    """Training's per-step validation accuracy next to vLLM's per-position acceptance.

    Both measure P(draft tokens 0..k all match the target's greedy choice): full_acc_k on
    teacher-forced training data, acceptance at position k on the target's own generations."""
    val = (train_metrics or {}).get("val", {})
    rows = []
    for k, a in enumerate(accept):
        t = val.get(f"full_acc_{k}")
        gap = None if t is None else a - t
        rows.append({"position": k, "train_full_acc": t, "vllm_acceptance": a, "gap": gap,
                     "flag": gap is not None and abs(gap) > max_gap})
    return rows


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def write_report(metrics: dict, rows: list[dict], train_metrics: dict | None, max_gap: float) -> None:
    f = _fmt
    lines = [
        "# Draft evaluation (vLLM speculative decoding, greedy)",
        "",
        f"- draft: `{metrics['draft']}` (epoch {metrics['draft_epoch']}), k = {metrics['num_speculative_tokens']}, "
        f"{metrics['num_prompts']} held-out prompts, max {metrics['max_tokens']} new tokens",
        f"- mean acceptance length tau = **{metrics['tau']:.3f}** "
        f"(predicted from training: {f(metrics['tau_predicted_from_training'])})",
        f"- tokens/s: {metrics['spec_tokens_per_s']:.1f} with speculation, {metrics['baseline_tokens_per_s']:.1f} without "
        f"(x{metrics['speedup']:.2f})",
        f"- outputs identical to the non-speculative engine: {metrics['outputs_identical']}/{metrics['num_prompts']}"
        + ("" if metrics["outputs_identical"] == metrics["num_prompts"] else
           " **(greedy outputs differ: speculative decoding must not change them; check dtype/numerics)**"),
        "",
        "## Reconciliation: training accuracy vs serving acceptance",
        "",
    ]
    if train_metrics is None:
        lines.append(f"{TRAIN_METRICS} not found: no training figures to compare.")
    else:
        same = train_metrics.get("epoch") == metrics["draft_epoch"]
        lines.append(f"Training: validation full_acc_k of epoch {train_metrics.get('epoch')}"
                     + ("" if same else f" **(not the evaluated checkpoint, epoch {metrics['draft_epoch']})**") + ".")
    lines += ["", "| position k | training full_acc_k | vLLM acceptance | gap | |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['position']} | {f(r['train_full_acc'])} | {f(r['vllm_acceptance'])} | {f(r['gap'])} | "
                     f"{'**gap > ' + str(max_gap) + '**' if r['flag'] else ''} |")
    if any(r["flag"] for r in rows):
        lines += [
            "",
            f"**A gap above {max_gap} at some position.** Training data and serving disagree about what the draft sees. "
            "Either the hidden states it was trained on are not the ones vLLM feeds it: a layer-id convention "
            "mismatch (state entering vs leaving a layer, off by one) or the final state taken after instead of before "
            "the final norm (check the verify stage's report and extract_meta.json layer_ids against the draft's "
            "eagle_aux_hidden_state_layer_ids). Or the training conversations are not text the target writes: "
            "training scores the draft teacher-forced on them, serving on the target's own greedy output; a target "
            "that fits its data poorly (the verify report's next-token accuracy well below 1) shows gaps of this size "
            "(docs/BENCHMARKS.md, 'The DeepSeek-V3-shaped embedded target on CPU'), and on-policy data (data.regenerate.enabled) closes them. "
            "`python bench/acceptance_probe.py --out probe.json` tells the two apart: the trained draft teacher-forced "
            "on the target's own greedy text, walked like vLLM's draft/verify loop, matches vLLM's acceptance when the "
            "serving path feeds the draft as training did.",
        ]
    lines += _more_k_lines(metrics) + _decode_lines(metrics)
    lines.append("")
    atomic_write_text(EVAL_REPORT, "\n".join(lines))


def _more_k_lines(metrics: dict) -> list[str]:
    if len(metrics.get("by_k", {})) < 2:
        return []
    f = _fmt
    lines = ["", "## Every k measured (one engine each)", "",
             "| k | tau | predicted from training | acceptance per position | tokens/s | speedup | identical |",
             "|---|---|---|---|---|---|---|"]
    for k, m in metrics["by_k"].items():
        accept = ", ".join(f"{a:.3f}" for a in m["acceptance_per_position"])
        lines.append(f"| {k} | {m['tau']:.3f} | {f(m['tau_predicted_from_training'])} | {accept} | {m['tokens_per_s']:.1f} | "
                     f"x{m['speedup']:.2f} | {m['outputs_identical']}/{metrics['num_prompts']} |")
    return lines


def _decode_lines(metrics: dict) -> list[str]:
    if not metrics.get("decode"):
        return []
    ks = list(metrics["by_k"])
    lines = ["", "## Decode throughput by batch size (generated tokens/s, each engine timing its own batches)", "",
             "| batch | requests | plain | " + " | ".join(f"k = {k}" for k in ks) + " |",
             "|---|---|---|" + "---|" * len(ks)]
    for b, row in metrics["decode"].items():
        cells = " | ".join(f"{row[f'k{k}_tokens_per_s']:.1f} (x{row[f'k{k}_speedup']:.2f})" for k in ks)
        lines.append(f"| {b} | {row['requests']} | {row['plain_tokens_per_s']:.1f} | {cells} |")
    return lines


def per_k(result: dict, k: int, plain: dict, train_metrics: dict | None, max_gap: float) -> dict:
    """One speculative engine's figures: tau, acceptance per position against training, speed, fidelity."""
    counts = result["spec"]
    drafts = counts.get("num_drafts", 0)
    if not drafts:
        raise PipelineError(f"vLLM reported no speculative drafts at k = {k}: speculative decoding did not run")
    accept = [a / drafts for a in counts["num_accepted_tokens_per_pos"][:k]]
    rows = reconcile(train_metrics, accept, max_gap)
    predicted = 1 + sum(r["train_full_acc"] for r in rows) if all(r["train_full_acc"] is not None for r in rows) else None
    return {
        "tau": 1 + counts["num_accepted_tokens"] / drafts,
        "tau_predicted_from_training": predicted,
        "acceptance_per_position": accept,
        "draft_token_acceptance_rate": counts["num_accepted_tokens"] / max(counts["num_draft_tokens"], 1),
        "num_drafts": drafts,
        "tokens_per_s": result["tokens_per_s"],
        "speedup": result["tokens_per_s"] / plain["tokens_per_s"],
        "outputs_identical": sum(a == b for a, b in zip(result["tokens"], plain["tokens"], strict=True)),
        "rows": rows,
    }


def decode_table(spec: dict[int, dict], plain: dict) -> dict:
    """Per batch size: the plain engine's decode tokens/s and each k's, with its speedup."""
    out = {}
    for b, base in plain["decode"].items():
        row = {"plain_tokens_per_s": base["tokens_per_s"], "requests": base["requests"]}
        for k, result in spec.items():
            row[f"k{k}_tokens_per_s"] = result["decode"][b]["tokens_per_s"]
            row[f"k{k}_speedup"] = result["decode"][b]["tokens_per_s"] / base["tokens_per_s"]
        out[b] = row
    return out


def run(params: EvalParams) -> None:
    target = load_target()
    unservable = vllm_compat.int4_engine_problem(target.path)
    if unservable:  # before the engine's child starts, not on its first step
        raise PipelineError(f"eval: {unservable}")
    draft = final_draft()
    prompts = load_prompts(target, params.num_prompts)
    k = params.num_speculative_tokens
    ks = [k, *params.compare_speculative_tokens]
    max_pos = int(target.config.get("text_config", target.config).get("max_position_embeddings", 1 << 30))
    fitting = [p for p in prompts if len(p) + params.max_tokens + max(ks) <= max_pos]
    if not fitting:
        raise PipelineError(f"no held-out prompt fits the target's {max_pos} positions with eval.max_tokens={params.max_tokens}")
    base = {
        "target": str(target.path), "prompts": fitting, "max_tokens": params.max_tokens,
        "max_model_len": max(map(len, fitting)) + params.max_tokens + max(ks),
        "tensor_parallel_size": params.tensor_parallel_size, "gpu_memory_utilization": params.gpu_memory_utilization,
        "cpu_kvcache_gib": params.cpu_kvcache_gib, "dtype": params.dtype, "trust_remote_code": target.trust_remote_code,
        "enforce_eager": params.enforce_eager, "decode_batch_sizes": params.decode_batch_sizes,
        "engine_start_timeout_s": params.engine_start_timeout_s, "engine_stall_timeout_s": params.engine_stall_timeout_s,
    }
    spec = {}
    for n in ks:  # one engine per k, each started and stopped on its own
        config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": n}
        spec[n] = run_engine({**base, "speculative_config": config}, f"speculative (k = {n})")
    plain = run_engine({**base, "speculative_config": None}, "baseline")

    train_metrics = json.loads(TRAIN_METRICS.read_text()) if TRAIN_METRICS.is_file() else None
    by_k = {n: per_k(spec[n], n, plain, train_metrics, params.max_acceptance_gap) for n in ks}
    head = by_k[k]
    rows = head.pop("rows")
    metrics = {
        "draft": str(draft),
        "draft_epoch": int(draft.name) if draft.name.isdigit() else None,
        "num_prompts": len(fitting),
        "num_speculative_tokens": k,
        "max_tokens": params.max_tokens,
        "tau": head["tau"],
        "tau_predicted_from_training": head["tau_predicted_from_training"],
        "acceptance_per_position": head["acceptance_per_position"],
        "draft_token_acceptance_rate": head["draft_token_acceptance_rate"],
        "num_drafts": head["num_drafts"],
        "spec_tokens_per_s": head["tokens_per_s"],
        "baseline_tokens_per_s": plain["tokens_per_s"],
        "speedup": head["speedup"],
        "outputs_identical": head["outputs_identical"],
        "reconciliation_flagged_positions": [r["position"] for r in rows if r["flag"]],
        "enforce_eager": params.enforce_eager,
        "device": "gpu" if vllm_compat.on_cuda() else "cpu",
        "by_k": {str(n): {key: v for key, v in m.items() if key != "rows"} for n, m in by_k.items()},
        "decode": decode_table(spec, plain),
    }
    atomic_write_text(EVAL_METRICS, json.dumps(metrics, indent=1) + "\n")
    write_report(metrics, rows, train_metrics, params.max_acceptance_gap)
    say(f"[eval] tau {metrics['tau']:.3f}, acceptance {[round(a, 3) for a in metrics['acceptance_per_position']]}, "
          f"{metrics['spec_tokens_per_s']:.0f} vs {metrics['baseline_tokens_per_s']:.0f} tok/s, "
          f"identical {metrics['outputs_identical']}/{metrics['num_prompts']}"
          + "".join(f"; k = {n}: tau {m['tau']:.3f}" for n, m in by_k.items() if n != k)
          + "".join(f"; batch {b}: x{row[f'k{k}_speedup']:.2f}" for b, row in metrics["decode"].items()))


if __name__ == "__main__":  # the engine child: python -m pipeline.stages.eval SPEC_JSON OUT_JSON
    result = engine_main(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine shutdown can hang (seen on GPU); the result is written, the parent kills the rest
