"""The CPU arithmetic that training on CPU is pinned to, so that every x86-64 machine with AVX2
trains the same embedded target (and the same draft from the same shards) from the same seed.

Beyond the seed, three things decide which float operations a CPU training step does, and so its
last bits (which 600 steps amplify into another target: docs/ARCHITECTURE.md "Determinism: what a second
run reproduces, and what it cannot"):

- PyTorch's own vectorised kernels (elementwise ops, reductions, softmax, the optimizer): ATen
  picks one code path per process, the widest the CPU has (AVX-512 on this Xeon, AVX2 on older or
  AMD machines), unless ATEN_CPU_CAPABILITY names one. ATen reads the variable once, when the
  first operator dispatches, and keeps it for the life of the process.
- MKL's GEMM code path (every Linear's matmul in fp32: PyPI's x86 torch is built with MKL):
  chosen per CPU unless MKL_CBWR (Conditional Numerical Reproducibility) names a branch. MKL
  reads it when it initialises, on the first MKL call.
- the intra-op thread count: how GEMMs and reductions are split (TRAINING_THREADS).

Both variables are read once per process, so they are set by `pin_environment` in the stage entry
(pipeline/cli.py) before the stage's module, and with it torch, is imported: natively, under
`dvc repro`, and inside the container, where the same entry runs again. This module imports no
torch for that reason. AVX2 is the widest path every x86-64 machine of the last ten years has; the
weights measured with these pins: docs/BENCHMARKS.md "Determinism: the pinned CPU arithmetic".
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# what each variable pins, as the library spells it (ATen: lower case; MKL: upper case)
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
# torch.backends.cpu.get_cpu_capability() once ATEN_CPU_CAPABILITY=avx2 is in force
PINNED_CAPABILITY = "AVX2"
# Intra-op threads of the embedded target's training, and of the draft's when speculators' trainer
# runs in one process on CPU (under torchrun each rank keeps torchrun's own OMP_NUM_THREADS=1), on
# every machine. One, because: the weights of both depend on the count (measured: docs/BENCHMARKS.md
# "Determinism: the pinned CPU arithmetic"), so it must be a constant; every machine has one core to
# give; and on a shared machine each extra thread waits at barriers for a descheduled peer: 40
# target steps took 184 s with 2 threads against 23-48 s with 1, and a draft epoch 219 s with 2
# threads at load average 7 (28-35 s with 2 and 58-61 s with 1 at load 3-4: on a quiet machine two
# would be faster).
TRAINING_THREADS = 1


class PinTooLate(RuntimeError):
    """torch was imported before the pins were set: they would silently not apply."""


def pin_environment(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set PINNED_ENV in this process's environment (children inherit it); returns what was overridden."""
    if "torch" in sys.modules and any(environ.get(k) != v for k, v in PINNED_ENV.items()):
        raise PinTooLate(f"torch was imported before {PINNED_ENV} were set; ATen and MKL read them only once: "
                         "set them before the stage's module is imported")
    overridden = {k: environ[k] for k, v in PINNED_ENV.items() if environ.get(k, v) != v}
    environ.update(PINNED_ENV)
    return overridden


def in_force() -> dict[str, object]:
    """What this process trains with (for metrics/model.json): the variables, ATen's capability, threads."""
    import torch

    return {
        **{k: os.environ.get(k) for k in PINNED_ENV},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pinned": all(os.environ.get(k) == v for k, v in PINNED_ENV.items())
        and torch.backends.cpu.get_cpu_capability() == PINNED_CAPABILITY,
        "torch": torch.__version__,
    }
