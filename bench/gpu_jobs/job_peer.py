"""bench step peer: speculators' own data generation on the prompts our extract stage ran on.

speculators 0.9 generates EAGLE-3 data with a vLLM server that captures hidden states through the same
`extract_hidden_states` method and `ExampleHiddenStatesConnector` our stage uses, and an async client
(`speculators generate-offline-data`) that sends each prompt as token ids (max_tokens=1) and moves the file
the server wrote to `hs_{i}.safetensors`. Here: the server with our stage's engine settings (the same
speculative and kv-transfer configs, token budget, sequences, memory share, prefix caching off), then the
client at its default concurrency, without and with `--validate-outputs`, each timed from the client's start
until it exits (every file written), with the GPU's utilisation sampled (nvidia-smi). Then a few samples of
speculators' files against our stage's shards of the same workload (same engine, so bf16 noise at most).
On CPU (`--smoke`) the server takes the project's CPU-safe connector: the stock one needs pinned memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpu_jobs.common import log
from gpu_jobs.engine_runs import _engine_params
from gpu_jobs.gpu_busy import Utilisation

SERVER_START_LIMIT_S = 420  # 8B bf16 on the H200: ~110 s (torch.compile, graphs)
CLIENT_LIMIT_S = 300
COMPARED_SAMPLES = 4  # per prompt length


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(state: dict, name: str, model: Path, storage: Path, port: int, max_model_len: int) -> list[str]:
    """`vllm serve` as speculators' launch script builds it, with our extract stage's engine arguments."""
    from pipeline.extraction import vllm_compat

    params = _engine_params(state, name)
    kw = vllm_compat.engine_kwargs(
        model=model, layer_ids=params.layer_ids, scratch_dir=storage, dtype=params.dtype, max_model_len=max_model_len,
        max_num_seqs=params.max_num_seqs, max_num_batched_tokens=params.max_num_batched_tokens,
        gpu_memory_utilization=params.gpu_memory_utilization,
    )
    kw.pop("skip_tokenizer_init")  # a server detokenises its one generated token (speculators' setup has a tokenizer)
    kw.pop("trust_remote_code")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def wait_ready(url: str, server: subprocess.Popen, limit_s: float) -> float:
    t = time.monotonic()
    while time.monotonic() - t < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.returncode} before it was ready")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t
        time.sleep(1.0)
    raise RuntimeError(f"the vLLM server was not ready after {limit_s} s")


def run_client(url: str, data: Path, out: Path, validate: bool, concurrency: int | None, log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", url,
           "--preprocessed-data", str(data), "--output", str(out)]
    if validate:
        cmd.append("--validate-outputs")
    if concurrency:
        cmd += ["--concurrency", str(concurrency)]
    t = time.monotonic()
    with open(log_path, "w") as logf, Utilisation() as busy:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=CLIENT_LIMIT_S).returncode
    wall = time.monotonic() - t
    files = sorted(out.glob("hs_*.safetensors"))
    return {"rc": rc, "wall_s": round(wall, 2), "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "gpu_busy": busy.mean(), "command": " ".join(cmd[1:]), "log_tail": log_path.read_text(errors="replace")[-1500:]}


def compare_with_ours(proj: Path, peer_out: Path, phases: list[str]) -> dict:
    """A few samples of each prompt length: speculators' states against our stage's, per captured layer."""
    import torch
    from safetensors.torch import load_file

    from pipeline import layout
    from pipeline.hidden_states import format as shards

    wanted = [i for ph in sorted(set(phases)) for i in [k for k, p in enumerate(phases) if p == ph][:COMPARED_SAMPLES]]
    where = {sid: path for path in shards.complete_shards(proj / layout.HIDDEN_STATES_DIR)
             for sid in shards.read_manifest(path)["sample_ids"]}
    rows = []
    for sid in wanted:
        theirs = load_file(str(peer_out / f"hs_{sid}.safetensors"))
        mine = shards.load_sample(where[sid], sid)
        a, b = theirs["hidden_states"].float(), mine.hidden_states.float()
        row = {"sample": sid, "phase": phases[sid], "tokens": int(b.shape[0]), "shape_theirs": list(a.shape),
               "shape_ours": list(b.shape), "token_ids_equal": bool(torch.equal(theirs["token_ids"].long(), mine.input_ids.long()))}
        if a.shape == b.shape:
            err = (a - b).pow(2).sum((0, 2)).sqrt() / b.pow(2).sum((0, 2)).sqrt().clamp_min(1e-30)
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [T, L]
            row |= {"bitwise_equal": bool(torch.equal(theirs["hidden_states"], mine.hidden_states)),
                    "rel_rms_err_per_layer": [round(float(x), 6) for x in err],
                    "cos_min_per_layer": [round(float(x), 6) for x in cos.min(0).values]}
        rows.append(row)
    return {"samples": rows, "max_rel_rms_err": max((max(r.get("rel_rms_err_per_layer", [float("inf")])) for r in rows), default=None),
            "all_token_ids_equal": all(r["token_ids_equal"] for r in rows)}


def job_peer(state: dict, name: str) -> dict:
    import datasets

    from pipeline import layout
    from pipeline.extraction import vllm_compat

    proj = Path(state[f"project_{name}"])
    work = Path(state["work"]) / f"peer-{name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "data"  # speculators reads input_ids with .tolist(): the torch format
    prepared = datasets.load_from_disk(str(proj / layout.PREPARED_DATASET)).select_columns(["input_ids", "loss_mask"])
    prepared.set_format("torch")
    prepared.save_to_disk(str(data))
    tokens = int(sum(len(x) for x in datasets.load_from_disk(str(proj / layout.PREPARED_DATASET))["input_ids"]))
    model = Path(json.loads((proj / layout.TARGET_JSON).read_text())["path"])
    max_model_len = max(len(x) for x in prepared["input_ids"]) + 1
    vllm_compat.configure_process_env(1, model, max_model_len)  # the server inherits the stage's process settings
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # CPU: the stage's in-process engine; a server runs its engine apart
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    storage = work / "server-storage"
    cmd = server_command(state, name, model, storage, port, max_model_len)
    log(f"peer {name}: server: {' '.join(cmd[1:])}")
    server_log = Path(state["out"]) / f"peer_{name}_server.log"
    with open(server_log, "w") as slog:
        server = subprocess.Popen(cmd, stdout=slog, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            ready_s = wait_ready(url, server, SERVER_START_LIMIT_S)
            log(f"peer {name}: server ready in {ready_s:.1f} s")
            runs = {}
            concurrency = [int(c) for c in os.environ.get("PEER_CONCURRENCY", "0").split(",")]  # 0: its default (32)
            for label, validate, conc in [("plain", False, c) for c in concurrency] + [("validate", True, concurrency[0])]:
                key = label + (f"_c{conc}" if conc else "")
                out = work / f"out-{key}"
                runs[key] = run_client(url, data, out, validate, conc or None, Path(state["out"]) / f"peer_{name}_{key}.log")
                runs[key]["tok_s"] = round(tokens / runs[key]["wall_s"], 1)
                runs[key]["bytes_per_token"] = round(runs[key]["bytes"] / tokens, 1)
                log(f"peer {name}: {key}: {json.dumps({k: v for k, v in runs[key].items() if k != 'log_tail'})}")
                if key != next(iter(runs)):
                    shutil.rmtree(out, ignore_errors=True)  # the first run's files stay for the comparison
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGKILL)
    first = work / f"out-{next(iter(runs))}"
    comparison = compare_with_ours(proj, first, state[f"phases_{name}"])
    log(f"peer {name}: against our shards: {json.dumps(comparison)[:1500]}")
    shutil.rmtree(first, ignore_errors=True)
    summary = {"server_ready_s": round(ready_s, 1), "tokens": tokens, "samples": len(prepared),
               "runs": {k: {x: v for x, v in r.items() if x != "log_tail"} for k, r in runs.items()},
               "max_rel_rms_err_vs_ours": comparison["max_rel_rms_err"], "token_ids_equal": comparison["all_token_ids_equal"]}
    return {"summary": summary, "comparison": comparison, "client_logs": {k: r["log_tail"] for k, r in runs.items()}}
