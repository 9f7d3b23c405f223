"""One module per DVC stage; each exposes `run(section)` taking only its own params section."""

STAGES = ("model", "prepare", "extract", "verify", "train", "eval")
# which params.yaml section each stage reads
SECTION = {"model": "model", "prepare": "data", "extract": "extract", "verify": "verify", "train": "train", "eval": "eval"}
