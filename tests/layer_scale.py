"""A systematic scale of one captured layer in every sample (a misapplied scale factor, a skipped norm weight), planted
through the project's shard writer (`format.write_shard` on `format.stored` samples: sizes, sha256 and recorded
statistics agree with the scaled data; fp8 re-quantized, so its per-token scales carry the factor), and what verify
must say about it: the reference check's projection ratio names the layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.hidden_states.format import (
    Sample,
    complete_shards,
    load_sample,
    read_manifest,
    read_meta,
    stored,
    write_shard,
)
from tests.conftest import run_stage

# written by write_shard itself; everything else in a manifest is the extractor's and is kept
WRITER_KEYS = ("format", "format_version", "shard_index", "file", "bytes", "sha256", "sample_ids", "num_tokens", "layer_stats")


def scale_layer(root: Path, layer: int, factor: float) -> None:
    """Every sample's captured layer `layer` (index into layer_ids) times `factor`, in every shard."""
    hs_dir = root / layout.HIDDEN_STATES_DIR
    dtype = read_meta(hs_dir)["dtype"]
    for shard in complete_shards(hs_dir):
        manifest = read_manifest(shard)
        samples = []
        for sid in manifest["sample_ids"]:
            s = load_sample(shard, sid)  # fp8: dequantized float32, re-quantized by `stored`
            h = s.hidden_states.clone()
            h[:, layer] = (h[:, layer].double() * factor).to(h.dtype)
            samples.append(stored(Sample(sid, s.input_ids, s.loss_mask, h.contiguous()), dtype))
        write_shard(hs_dir, manifest["shard_index"], samples, {k: v for k, v in manifest.items() if k not in WRITER_KEYS})


def verify_names_the_scale(root: Path, layer_id: int, **params) -> str:
    """verify fails, its reference check naming `layer_id` as systematically scaled, in its lines, report and metrics."""
    with pytest.raises(PipelineError) as err:
        run_stage(root, "verify", **params)
    message = str(err.value)
    line = next((x for x in message.splitlines() if x.startswith(f"  [reference] layer={layer_id}:") and "systematically scaled" in x), None)
    assert line and "projection ratio" in line and "scale factor or norm weight" in line, message
    assert not (root / layout.VERIFY_VERDICT).exists()
    metrics = json.loads((root / layout.METRICS / "verify.json").read_text())
    assert metrics["checks"]["reference"] == "fail"
    row = metrics["layers"][str(layer_id)]
    assert abs(row["scale_ratio"] - 1) > row["scale_bound"], row
    assert "systematically scaled" in (root / layout.REPORTS / "verify" / "report.md").read_text()
    return line
