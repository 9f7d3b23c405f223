"""One module per DVC stage; each exposes `run(section)` taking only its own params section."""

STAGES = ("check", "model", "regenerate", "prepare", "extract", "verify", "train", "eval")
# which params.yaml section each stage reads; check reads all of it (pipeline/stages/check.py)
SECTION = {"check": None, "model": "model", "regenerate": "data", "prepare": "data", "extract": "extract",
           "verify": "verify", "train": "train", "eval": "eval"}
# stages that train on CPU with pipeline/training/cpu_determinism.py's pinned arithmetic (set by the entry,
# pipeline/cli.py, before the stage imports torch), so another x86-64 machine trains the same weights
# (train: from the same shards; on a GPU only its CPU-side ops are affected)
CPU_PINNED = frozenset({"model", "train"})
