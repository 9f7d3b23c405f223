"""What speculators 0.9's own trainer needs to run on a machine without an accelerator.

speculators assumes a GPU in three places; each override below was shown necessary by removing
it alone (tests/test_train.py::test_each_cpu_override_is_needed):

  device       Trainer moves the model and every batch to `local_rank` (device index 0)
               -> "Cannot access accelerator device when none is available". It also autocasts on
               "cuda", which on CPU is only disabled with a warning (no crash): with
               hidden_states_dtype bfloat16 nothing would autocast, hence autocast device "cpu" too.
  synchronize  the step timer calls torch.accelerator.synchronize() whenever it logs metrics
               -> same RuntimeError at the first training step
  checkpoint   on resume the checkpointer loads weights/optimizer state to get_current_device(),
               which falls back to "cuda:0" -> resume fails

Under torchrun (several processes) speculators' `maybe_setup_distributed` also wants an
accelerator: it selects device LOCAL_RANK and binds the process group to it ->
"Cannot access accelerator device when none is available"; `setup_distributed` runs the same
function with the CPU device and the gloo backend
(tests/test_train_ddp.py::test_stock_distributed_setup_needs_an_accelerator).

Beyond these, a CPU run needs only trainer options (see `cpu_trainer_options`). Note that an
in-process vLLM CPU engine replaces torch.accelerator.synchronize and Tensor.pin_memory for the
whole process: after one, the last two overrides look unnecessary, so the proof runs in a fresh process.
With an accelerator present nothing is patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from speculators.train import checkpointer
from speculators.train.distributed import maybe_setup_distributed
from speculators.train.trainer import Trainer

OVERRIDES = ("device", "synchronize", "checkpoint")
_stock_setup_model = Trainer.setup_model


def needed() -> bool:
    return not torch.accelerator.is_available()


def cpu_trainer_options() -> dict[str, object]:
    """speculators options a CPU run needs: flex attention has no CPU backward, and dataloader
    workers only add start-up time on a couple of cores (the fused losses need Triton: train.loss_implementation
    must be eager, which the train stage checks)."""
    return {"draft_attn_impl": "sdpa", "num_workers": 0}


def _setup_model_on_cpu(self: Trainer) -> None:
    self.local_rank = "cpu"  # used for model.to() and for every batch's .to()
    self.device_type = "cpu"  # autocast device
    _stock_setup_model(self)


@contextlib.contextmanager
def cpu_training(skip: Collection[str] = ()) -> Iterator[None]:
    """Apply the overrides while training runs (no-op with an accelerator). `skip` is for the
    test that proves each override necessary."""
    if unknown := set(skip) - set(OVERRIDES):
        raise ValueError(f"unknown overrides {unknown}; known: {OVERRIDES}")
    with contextlib.ExitStack() as stack:
        if needed():
            if "device" not in skip:
                stack.enter_context(mock.patch.object(Trainer, "setup_model", _setup_model_on_cpu))
            if "synchronize" not in skip:
                stack.enter_context(mock.patch.object(torch.accelerator, "synchronize", lambda *a, **k: None))
            if "checkpoint" not in skip:
                stack.enter_context(mock.patch.object(checkpointer, "get_current_device", lambda: "cpu"))
        yield


def setup_distributed() -> None:
    """speculators' `maybe_setup_distributed` (a no-op outside torchrun); without an accelerator
    with the CPU device, so that its backend is gloo, and no device bound to the process group."""
    if not needed():
        maybe_setup_distributed()
        return
    init = dist.init_process_group
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.accelerator, "set_device_index", lambda index: None))
        stack.enter_context(mock.patch.object(torch.accelerator, "current_accelerator",
                                              lambda check_available=False: torch.device("cpu")))
        stack.enter_context(mock.patch.object(dist, "init_process_group",
                                              lambda backend=None, device_id=None, **kw: init(backend, **kw)))
        maybe_setup_distributed()
