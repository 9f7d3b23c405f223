"""One rank of speculators' EAGLE-3 trainer: what the train stage runs in its own process, or in
each process `torchrun` starts (`python -m pipeline.training.worker JOB_DIR`, pipeline/training/torchrun.py).

Every rank builds the same draft (speculators broadcasts rank 0's initial weights), reads its
part of each epoch's samples through speculators' own distributed packing sampler
(MultipackDistributedBatchSamplerV2 with the data-parallel rank and size, one seed for all ranks),
and trains under DDP. Only rank 0 writes: speculators saves checkpoints on rank 0 alone, and
the epoch metrics collector and run.yaml exist only there.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from speculators.model import SpeculatorModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.cli import build_draft_model, set_seed
from speculators.train.config import TrainConfig
from speculators.train.dataloader import _setup_dataloader
from speculators.train.distributed import get_rank, get_world_size, maybe_destroy_distributed
from speculators.train.logger import setup_root_logger
from speculators.train.trainer import Trainer, TrainerConfig

from pipeline.atomic import atomic_write_text
from pipeline.errors import PipelineError
from pipeline.layout import DRAFT_DIR, HIDDEN_STATES_DIR
from pipeline.params import TrainParams
from pipeline.training import cpu_determinism, speculators_cpu
from pipeline.training.data import ShardDataset, index_shards, split_refs

EPOCH_METRICS = "epoch_metrics.json"  # written into each <epoch>/ dir; with training_state.json marks it complete
JOB_FILE = "job.json"  # what the stage hands each torchrun rank: params, speculators config, vocab size
VOCAB_FILE = "vocab_mapping.pt"  # d2t / t2d tensors (None for the full vocabulary)
log = logging.getLogger("pipeline.train")


class EpochMetrics(logging.Handler):
    """Captures speculators' metric records (logger 'speculators.metrics'): per-step train metrics
    are averaged over the epoch, and the validation record (logged after the epoch's checkpoint)
    is written with them into <epoch>/epoch_metrics.json. The records are already reduced over
    the ranks (speculators all-reduces them), so rank 0's are the run's."""

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.step_seconds = 0.0
        self.tokens = 0.0  # rank 0's; the ranks step in lockstep on batches of the same token budget
        self.t0 = time.perf_counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            for k, v in msg["train"].items():
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.steps += 1
            if profile := msg.get("profile"):
                self.step_seconds += profile["step_ms"] / 1000
                self.tokens += profile["tokens_per_s"] * profile["step_ms"] / 1000
        elif "val" in msg:
            epoch = int(msg["epoch"])
            world = get_world_size()
            row = {
                "epoch": epoch,
                "seconds": round(time.perf_counter() - self.t0, 2),
                "steps": self.steps,
                "processes": world,
                "train_tokens_per_s": round(world * self.tokens / self.step_seconds, 1) if self.step_seconds else None,
                "val": {k.removesuffix("_epoch"): v for k, v in msg["val"].items() if not k.startswith("error_records")},
                "train": {k: v / max(self.steps, 1) for k, v in self.sums.items() if not k.startswith("error_records")},
            }
            atomic_write_text(DRAFT_DIR / str(epoch) / EPOCH_METRICS, json.dumps(row, indent=1) + "\n")
            log.info("train: epoch %d done in %.1f s: val loss %.4f, full_acc %s", epoch, row["seconds"],
                     row["val"].get("loss", float("nan")),
                     [round(v, 3) for k, v in sorted(row["val"].items()) if k.startswith("full_acc_")])
            self._reset()


@contextlib.contextmanager
def collect_epoch_metrics() -> Iterator[None]:
    metrics_logger = logging.getLogger("speculators.metrics")
    collector = EpochMetrics()
    saved = metrics_logger.level, metrics_logger.propagate
    metrics_logger.addHandler(collector)
    metrics_logger.setLevel(logging.INFO)  # the records are INFO; a caller's root level may be higher
    metrics_logger.propagate = False  # no per-step console lines
    try:
        yield
    finally:
        metrics_logger.removeHandler(collector)
        metrics_logger.level, metrics_logger.propagate = saved


def train(cfg: TrainConfig, params: TrainParams, d2t, t2d, draft_vocab_size: int) -> None:
    """What `speculators train` does after resolving its config, with our datasets in place of its
    Arrow/hidden-states files. Runs on every rank (distributed set up or not)."""
    args = argparse.Namespace(**cfg.flatten())
    set_seed(args.seed)
    if get_rank() == 0:
        # the resolved speculators config; not cfg.save(), which also stores timestamps and a git diff of the cwd's repo
        atomic_write_text(Path(args.save_path) / "run.yaml", cfg.dump_yaml())
    model_class = SpeculatorModel.registry["eagle3"]
    model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    dtype = getattr(torch, args.hidden_states_dtype)
    train_refs, val_refs = split_refs(index_shards(HIDDEN_STATES_DIR), params.val_fraction, params.seed)
    if not train_refs or not val_refs:
        raise PipelineError(f"{HIDDEN_STATES_DIR}: {len(train_refs) + len(val_refs)} samples cannot make both a train and a val split")
    hidden_size = model.config.transformer_layer_config.hidden_size
    loader = dict(total_seq_len=args.total_seq_len, hidden_size=hidden_size, num_workers=args.num_workers,
                  num_target_layers=len(model.target_layer_ids), prefetch_factor=args.prefetch_factor, preprocess=shift_batch)
    # speculators' sampler splits each epoch's packed batches over the data-parallel ranks
    train_loader = _setup_dataloader(ShardDataset(train_refs, args.total_seq_len, dtype), seed=args.seed, **loader)
    val_loader = _setup_dataloader(ShardDataset(val_refs, args.total_seq_len, dtype), **loader)
    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(args))
    config = TrainerConfig(
        lr=args.lr, num_epochs=args.epochs, save_path=args.save_path, resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, optimizer=args.optimizer,
        weight_decay=args.weight_decay, muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
        hidden_states_dtype=dtype, log_freq=args.log_freq,
    )
    Trainer(model, config, train_loader, val_loader).run_training()


def train_here(cfg: TrainConfig, params: TrainParams, d2t, t2d, draft_vocab_size: int) -> None:
    """The whole run in this process (one process: no torchrun)."""
    if speculators_cpu.needed():  # the draft's weights depend on the count: a constant, not the cores
        torch.set_num_threads(cpu_determinism.TRAINING_THREADS)
    with collect_epoch_metrics(), speculators_cpu.cpu_training():
        train(cfg, params, d2t, t2d, draft_vocab_size)


def write_job(job_dir: Path, cfg: TrainConfig, params: TrainParams, d2t, t2d, draft_vocab_size: int) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": d2t, "t2d": t2d}, job_dir / VOCAB_FILE)
    job = {"params": params.model_dump(), "config": cfg.flatten(), "draft_vocab_size": draft_vocab_size}
    atomic_write_text(job_dir / JOB_FILE, json.dumps(job, indent=1, default=str) + "\n")


def _die_with_parent() -> None:
    """A SIGKILLed torchrun agent (the stage) cannot stop its workers, which run in sessions of
    their own: without this they would train on, and write checkpoints, under the next run."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    parent = os.environ.get("EAGLE3_TRAIN_AGENT_PID")
    if parent and os.getppid() != int(parent):  # the agent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    _die_with_parent()
    job_dir = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads((job_dir / JOB_FILE).read_text())
    vocab = torch.load(job_dir / VOCAB_FILE, weights_only=True)
    cfg, params = TrainConfig.from_flat(job["config"]), TrainParams.model_validate(job["params"])
    setup_root_logger()
    log.setLevel(logging.INFO)
    speculators_cpu.setup_distributed()
    try:
        metrics = collect_epoch_metrics() if get_rank() == 0 else contextlib.nullcontext()
        with metrics, speculators_cpu.cpu_training():
            train(cfg, params, vocab["d2t"], vocab["t2d"], job["draft_vocab_size"])
    finally:
        maybe_destroy_distributed()


if __name__ == "__main__":
    main()
