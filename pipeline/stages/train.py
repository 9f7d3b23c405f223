"""train stage: speculators' own EAGLE-3 trainer on our hidden-state shards.

Checkpoints go to DRAFT_DIR/<epoch>/ (a speculators checkpoint vLLM loads as an EAGLE-3 draft);
DRAFT_DIR/final.json names the last epoch's. A killed run resumes from its last complete epoch;
a run key (params + data + target) makes a changed input start afresh instead.

train.nproc_per_node x train.nnodes > 1: the stage is this node's torchrun agent
(pipeline/training/torchrun.py) and the ranks run pipeline/training/worker.py under DDP; node 0 prepares
the draft directory and, after its ranks are done, writes the metrics and final.json.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import shutil
from importlib.metadata import version

import torch
from safetensors import safe_open
from speculators.train.config import TrainConfig
from speculators.train.logger import setup_root_logger
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from pipeline.atomic import atomic_write_text, open_up_to_umask
from pipeline.errors import PipelineError
from pipeline.hidden_states import format as shards
from pipeline.layout import (
    ARTIFACTS,
    DRAFT_DIR,
    FINAL_POINTER,
    HIDDEN_STATES_DIR,
    TOKEN_FREQ,
    TRAIN_CURVE,
    TRAIN_METRICS,
    VERIFY_VERDICT,
)
from pipeline.params import TrainParams
from pipeline.target import Target, load_target, sha256_file, sha256_json
from pipeline.training import cpu_determinism, speculators_cpu, torchrun
from pipeline.training.worker import EPOCH_METRICS, train_here, write_job

RUN_KEY = DRAFT_DIR / "run_key.json"
RUN_DIR = ARTIFACTS / ".train"  # per node: the job torchrun's ranks read and their logs; not an output
log = logging.getLogger("pipeline.train")


def check_inputs(meta: dict) -> None:
    """Only complete hidden states of a format we know, and only the ones verify passed."""
    where = HIDDEN_STATES_DIR / shards.META_FILE
    if meta.get("format") != shards.FORMAT_NAME or meta.get("format_version") not in range(1, shards.FORMAT_VERSION + 1):
        raise PipelineError(f"{where}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
                            f"{shards.FORMAT_NAME!r} v1 to v{shards.FORMAT_VERSION}; re-run extract")
    if not meta.get("complete"):
        raise PipelineError(f"{where}: the extract run has not finished; run it to completion first")
    if not VERIFY_VERDICT.is_file():
        raise PipelineError(f"{VERIFY_VERDICT} not found: run the verify stage; train uses only verified hidden states")
    verdict = json.loads(VERIFY_VERDICT.read_text())
    if not verdict.get("passed") or verdict.get("run_key") != meta.get("run_key"):
        raise PipelineError(f"{VERIFY_VERDICT} does not vouch for these hidden states (run_key "
                            f"{str(verdict.get('run_key'))[:12]} vs {str(meta.get('run_key'))[:12]}); re-run verify")


def check_layer_ids(meta: dict, target: Target) -> list[int]:
    """The auxiliary layer ids speculators wants (all but the last), after checking the shards'
    last layer really is the target's final pre-norm state (vLLM id N)."""
    ids, n = list(meta.get("layer_ids") or []), target.num_layers
    where = f"{HIDDEN_STATES_DIR / shards.META_FILE}"
    if len(ids) < 2 or ids != sorted(set(ids)) or ids[0] < 0:
        raise PipelineError(f"{where}: layer_ids {ids} must be >= 2 distinct ids in ascending order")
    if meta.get("num_layers", n) != n or ids[-1] != n:
        raise PipelineError(
            f"{where}: layer_ids {ids} (from a {meta.get('num_layers')}-layer model) do not end with id {n}, the "
            f"final pre-norm state of the {n}-layer target {target.path}; EAGLE-3 training needs it as the last layer. "
            "Re-run extract for this target (`dvc repro extract`)"
        )
    if meta.get("hidden_size") != target.hidden_size:
        raise PipelineError(f"{where}: hidden_size {meta.get('hidden_size')} != the target's {target.hidden_size}")
    first = next(iter(shards.complete_shards(HIDDEN_STATES_DIR)), None)
    if first is None:
        raise PipelineError(f"{HIDDEN_STATES_DIR}: no complete shard; re-run extract")
    sid = shards.read_manifest(first)["sample_ids"][0]
    with safe_open(str(first), framework="pt") as f:
        name = f"{sid}/hidden_states" if f"{sid}/hidden_states" in f.keys() else f"{sid}{shards.FP8_SUFFIX}"
        shape = f.get_slice(name).get_shape()
    if shape[1:] != [len(ids), target.hidden_size]:
        raise PipelineError(f"{first}: sample {sid} has hidden states {shape}, expected [T, {len(ids)}, {target.hidden_size}] "
                            f"for layer_ids {ids}; the shards do not match {where}")
    return ids[:-1]


def vocab_mapping(params: TrainParams, target: Target) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(d2t, t2d, draft vocab size) from prepare's token counts; no mapping for the full vocabulary."""
    size = params.draft_vocab_size or target.vocab_size
    if size > target.vocab_size:
        raise PipelineError(f"train.draft_vocab_size {size} exceeds the target vocabulary ({target.vocab_size})")
    if size == target.vocab_size:
        return None, None, size
    if not TOKEN_FREQ.is_file():
        raise PipelineError(f"train.draft_vocab_size={size} needs {TOKEN_FREQ}: run the prepare stage")
    counts = json.loads(TOKEN_FREQ.read_text())
    d2t, t2d = build_vocab_mappings_from_distribution({i: c for i, c in enumerate(counts) if c}, size, target.vocab_size)
    return d2t, t2d, size


def run_key(params: TrainParams, meta: dict, target: Target) -> dict:
    """What the checkpoints depend on. extract's own run key, not its whole meta: an extract rerun
    that only changed engine settings keeps the same shards, and then training need not restart.
    The process count is in (it sets the batch, the data order and the step count), the
    rendezvous endpoint is not."""
    manifests = [shards.read_manifest(p)["sha256"] for p in shards.complete_shards(HIDDEN_STATES_DIR)]
    return {
        "params": params.model_dump(exclude=torchrun.RENDEZVOUS_FIELDS),
        "extract_run_key": meta.get("run_key"),
        "layer_ids": meta["layer_ids"],
        "shards_sha256": sha256_json(manifests),
        "target": target.fingerprint["sha256"],
        "token_freq": sha256_file(TOKEN_FREQ) if params.draft_vocab_size and TOKEN_FREQ.is_file() else None,
        "speculators": version("speculators"),
        # on CPU the arithmetic decides the weights' bits: other pins never resume these checkpoints
        "cpu_arithmetic": {**cpu_determinism.PINNED_ENV, "threads": cpu_determinism.TRAINING_THREADS}
        if speculators_cpu.needed() else None,
    }


def complete_epochs() -> list[int]:
    return sorted(
        int(d.name) for d in DRAFT_DIR.glob("[0-9]*")
        if d.name.isdigit() and not d.is_symlink() and (d / "training_state.json").is_file() and (d / EPOCH_METRICS).is_file()
    )


def prepare_draft_dir(key: dict) -> None:
    """Keep what a resume can use: nothing if the key changed, else only complete epochs."""
    stored = json.loads(RUN_KEY.read_text()) if RUN_KEY.is_file() else None
    if stored != key and DRAFT_DIR.exists():
        log.info("train: %s; starting afresh", "inputs changed since the last run" if stored else "no run key")
        shutil.rmtree(DRAFT_DIR)
    DRAFT_DIR.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RUN_KEY, json.dumps(key, indent=1, sort_keys=True) + "\n")
    done = set(complete_epochs())
    for d in DRAFT_DIR.iterdir():
        # a killed save, an epoch whose metrics were never recorded, a SIGTERM 'interrupted' dir
        if d.is_dir() and not d.is_symlink() and not (d.name.isdigit() and int(d.name) in done):
            log.info("train: removing incomplete checkpoint %s", d)
            shutil.rmtree(d)
        elif d.is_symlink() and not d.exists():
            d.unlink()
    FINAL_POINTER.unlink(missing_ok=True)


def speculators_config(params: TrainParams, target: Target, aux_ids: list[int], dtype: str) -> TrainConfig:
    flat = {
        "speculator_type": "eagle3",
        "seed": params.seed,
        "mask_token_id": 0,  # EAGLE-3 never uses it; set so speculators does not load the tokenizer to resolve it
        "verifier_name_or_path": str(target.path),
        "trust_remote_code": target.trust_remote_code,
        "num_layers": params.draft_layers,
        "target_layer_ids": aux_ids,
        "draft_vocab_size": params.draft_vocab_size,
        "data_path": str(HIDDEN_STATES_DIR),
        "total_seq_len": params.max_len,
        "hidden_states_dtype": dtype,
        "ttt_steps": params.ttt_steps,
        "optimizer": params.optimizer,
        "lr": params.lr,
        "epochs": params.epochs,
        "save_path": str(DRAFT_DIR),
        "loss_implementation": params.loss_implementation,
        "log_freq": 1,  # every step's metrics feed the epoch means
        **(speculators_cpu.cpu_trainer_options() if speculators_cpu.needed() else {}),
    }
    return TrainConfig.from_flat(flat)


def write_metrics(epochs: list[int]) -> None:
    rows = [json.loads((DRAFT_DIR / str(e) / EPOCH_METRICS).read_text()) for e in epochs]
    last = rows[-1]
    summary = {**last, "epochs_trained": len(rows), "mean_epoch_seconds": round(sum(r["seconds"] for r in rows) / len(rows), 2),
               # trained on a GPU: its arithmetic is the GPU's, no CPU pin to report
               "cpu_arithmetic": cpu_determinism.in_force() if speculators_cpu.needed() else None}
    atomic_write_text(TRAIN_METRICS, json.dumps(summary, indent=1) + "\n")
    flat = [{"epoch": r["epoch"], "seconds": r["seconds"], **{f"val_{k}": v for k, v in r["val"].items()},
             **{f"train_{k}": v for k, v in r["train"].items()}} for r in rows]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(k for row in flat for k in row)))
    writer.writeheader()
    writer.writerows(flat)
    atomic_write_text(TRAIN_CURVE, out.getvalue())


def check_devices(rdzv: torchrun.Rendezvous, params: TrainParams) -> None:
    if params.loss_implementation == "fused" and not torch.accelerator.is_available():
        raise PipelineError("train.loss_implementation is fused, speculators' Triton kernels, but this machine has no "
                            "GPU: set it to eager in params.yaml")
    if torch.accelerator.is_available() and rdzv.nproc_per_node > torch.accelerator.device_count():
        raise PipelineError(f"train.nproc_per_node is {rdzv.nproc_per_node} but this node has "
                            f"{torch.accelerator.device_count()} GPUs: one process per GPU")


def train_ranks(rdzv: torchrun.Rendezvous, cfg: TrainConfig, params: TrainParams, d2t, t2d, draft_vocab_size: int) -> None:
    """This node's share of the run: in this process, or its ranks under torchrun."""
    if rdzv.world_size == 1:
        train_here(cfg, params, d2t, t2d, draft_vocab_size)
        return
    run_dir = RUN_DIR / f"node{rdzv.node_rank}"
    shutil.rmtree(run_dir, ignore_errors=True)
    write_job(run_dir, cfg, params, d2t, t2d, draft_vocab_size)
    log.info("train: %d processes (%d node(s) x %d), this node %d: torchrun %s", rdzv.world_size, rdzv.nnodes,
             rdzv.nproc_per_node, rdzv.node_rank, " ".join(torchrun.torchrun_argv(rdzv, run_dir, run_dir / "logs")))
    torchrun.run_ranks(rdzv, run_dir, run_dir / "logs")
    shutil.rmtree(run_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # another node's job may still be there
        RUN_DIR.rmdir()


def run(params: TrainParams) -> None:
    rdzv = torchrun.rendezvous(params)
    check_devices(rdzv, params)
    target = load_target()
    try:
        meta = shards.read_meta(HIDDEN_STATES_DIR)
    except FileNotFoundError as e:
        raise PipelineError(str(e)) from None
    check_inputs(meta)
    aux_ids = check_layer_ids(meta, target)
    d2t, t2d, draft_vocab_size = vocab_mapping(params, target)
    dtype = params.hidden_states_dtype
    if dtype == "auto":
        dtype = "float32" if speculators_cpu.needed() else "bfloat16"

    setup_root_logger()
    log.setLevel(logging.INFO)
    if rdzv.node_rank == 0:  # node 0 owns the draft directory; the other nodes' ranks meet it at the rendezvous
        prepare_draft_dir(run_key(params, meta, target))
    done = complete_epochs()
    # several nodes always meet: one node cannot tell from the shared directory alone whether node 0 will train
    if rdzv.nnodes > 1 or not done or done[-1] < params.epochs - 1:
        if done:
            log.info("train: resuming after epoch %d (checkpoints %s)", done[-1], DRAFT_DIR)
        cfg = speculators_config(params, target, aux_ids, dtype)
        log.info("train: speculators' EAGLE-3 trainer, %d epochs of %d-token batches (lr %g, %d draft layer(s), "
                 "%d TTT steps) on the verified hidden states of %d samples, layers %s; its log: logs/train.log",
                 params.epochs, params.max_len, params.lr, params.draft_layers, params.ttt_steps,
                 meta.get("num_samples", 0), meta["layer_ids"])
        train_ranks(rdzv, cfg, params, d2t, t2d, draft_vocab_size)
        done = complete_epochs()
    if rdzv.node_rank != 0:
        log.info("train: node %d done; node 0 writes the draft's metrics and final.json", rdzv.node_rank)
        return
    if not done or done[-1] != params.epochs - 1:
        # speculators turns SIGINT/SIGTERM into an 'interrupted' checkpoint and returns normally
        raise PipelineError(f"training stopped after epoch {done[-1] if done else None} of {params.epochs}; re-run to resume")
    for link in DRAFT_DIR.iterdir():  # speculators' convenience links (epochN_end, checkpoint_best): final.json is ours
        if link.is_symlink():
            link.unlink()
    write_metrics(done)
    # speculators saves the checkpoints with safetensors' save_file: owner-only (0600) whatever the umask
    open_up_to_umask(DRAFT_DIR)
    final = DRAFT_DIR / str(done[-1])
    atomic_write_text(FINAL_POINTER, json.dumps({"epoch": done[-1], "path": str(final)}, indent=1) + "\n")
    val = json.loads((final / EPOCH_METRICS).read_text())["val"]
    log.info("train: final draft %s (epoch %d): validation accuracy by draft position %s", final, done[-1],
             [round(v, 3) for k, v in sorted(val.items()) if k.startswith("full_acc_")])
