"""One module per DVC stage; each exposes `run(section)` taking only its own params section."""

STAGES = ("check", "model", "regenerate", "prepare", "extract", "verify", "train", "eval")
# which params.yaml section each stage reads; check reads all of it (pipeline/stages/check.py)
SECTION = {"check": None, "model": "model", "regenerate": "data", "prepare": "data", "extract": "extract",
           "verify": "verify", "train": "train", "eval": "eval"}
