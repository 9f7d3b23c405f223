"""The trained draft eval loads: read through the pointer the train stage writes last.

Its own module so that eval reads it without importing the train stage (and speculators).
"""

import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.layout import FINAL_POINTER


def final_draft() -> Path:
    """The checkpoint directory eval loads (vLLM's speculative_config 'model')."""
    if not FINAL_POINTER.is_file():
        raise PipelineError(f"{FINAL_POINTER} not found: run the train stage first")
    path = Path(json.loads(FINAL_POINTER.read_text())["path"])
    if not (path / "config.json").is_file():
        raise PipelineError(f"{FINAL_POINTER} names {path}, which holds no checkpoint; re-run the train stage")
    return path
