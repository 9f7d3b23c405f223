"""check stage: all of params.yaml, the data file and what the target can serve, in seconds, before DVC touches any output.

DVC deletes a stage's outputs just before it runs the stage's command, so a stage's own validation
comes too late to save them: a typo in `verify.reference_samples` would cost the verdict, the
report and the `cache: false` metrics, which no cache can restore. This stage comes first instead.
Every other stage depends on its output, and its `params:` is the whole of params.yaml, so any edit
runs it before anything else; when it refuses, `dvc repro` stops there and every finished output
stays as it was. A valid edit writes the very same bytes again (CHECKED), so the check alone never
makes another stage run: what does run is what pipeline/workflow/invalidation.py says.

What it refuses: any schema error (pipeline/params.py), a missing or empty `data.path`, a model
directory that is not one, layer ids beyond the target, and what the target cannot serve: a
`data.seq_len` beyond its context, a tensor-parallel size its attention heads (or, with
`extract.expert_parallel`, its experts) cannot be split by, a pipeline-parallel size above its
layer count, and more devices than this host has. The target's shape comes from
`model.embedded` or from `model.path`'s config.json, so nothing is loaded and no engine starts.
"""

from __future__ import annotations

from pipeline.atomic import atomic_write_text
from pipeline.console import say
from pipeline.layout import CHECKED
from pipeline.params import Params
from pipeline.workflow.input_checks import CHECKED_TEXT, CheckFailed, problems


def run(params: Params) -> None:
    found = problems(params)
    if found:
        raise CheckFailed("refused before any stage ran (no output was touched):\n  " + "\n  ".join(found))
    atomic_write_text(CHECKED, CHECKED_TEXT)
    say(f"[check] params.yaml, {params.data.path} and the target's limits: ok")
