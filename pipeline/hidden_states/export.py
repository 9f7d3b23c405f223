"""Export our hidden-state shards (docs/FORMAT.md) to the layouts speculators' trainers read.

`python -m pipeline export --format speculators-0.3|speculators-0.9 --out DIR`

speculators-0.9 (speculators >= 0.5; what `speculators.train.data.ArrowDataset` with the default
`hs_connectors.FileTransfer` reads):

    DIR/                              an Arrow dataset (datasets' save_to_disk), torch format:
      data-*.arrow, dataset_info.json, state.json
                                      input_ids list<int64>, loss_mask list<int64>, seq_len int64
      hidden_states/hs_{i}.safetensors  for dataset row i: "hidden_states" [T, L, H] (extract dtype; float32
                                      dequantized for float8_e4m3 shards: speculators' trainer reads no scales;
                                      layers in vLLM's convention, the last = the final pre-norm
                                      state) and "token_ids" [T] int64 -- what vLLM's
                                      ExampleHiddenStatesConnector writes
      export_meta.json                our sidecar (source run, layer ids, row -> sample_id)

speculators-0.3 (speculators 0.3.0's offline data, scripts/data_generation_offline.py):

    DIR/data_{i}.pt                   torch.save({"input_ids": long[T], "hidden_states": [[T, H]
                                      per layer, in order, the last = the final layer],
                                      "loss_mask": long[T]})
      export_meta.json                sidecar: the layer ids in 0.3.0's convention (ours - 1)

Row / file index i runs over the exported samples in ascending sample_id (i == sample_id when
the shards hold the whole dataset). Samples are read and written one at a time; everything is
written into a temp directory beside DIR that is renamed to DIR at the end, so DIR holds a whole
export or nothing. DIR must not exist or be empty.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.atomic import TMP_MARK, fsync_dir
from pipeline.errors import PipelineError
from pipeline.hidden_states import format as shards
from pipeline.hidden_states import fp8
from pipeline.layout import HIDDEN_STATES_DIR

FORMATS = ("speculators-0.3", "speculators-0.9")
EXPORT_META = "export_meta.json"
SPECULATORS_03_CONVENTION = "speculators 0.3.0: id k = output of decoder layer k (= vLLM id k + 1)"


def log(msg: str) -> None:
    print(f"[export] {msg}", flush=True)


def to_speculators_03_ids(layer_ids: list[int]) -> list[int]:
    """vLLM ids (k = input of layer k) -> speculators 0.3.0 ids (k = output of layer k)."""
    if 0 in layer_ids:
        raise PipelineError(
            "layer id 0 (the embeddings output) has no id in speculators 0.3.0's convention "
            "(its id k is the output of decoder layer k); re-extract without it"
        )
    return [k - 1 for k in layer_ids]


def iter_all_samples(hs_dir: Path) -> Iterator[shards.Sample]:
    """Every sample of the complete shards, ascending sample_id, one at a time."""
    for p in shards.complete_shards(hs_dir):
        m = shards.read_manifest(p)
        if m.get("format") != shards.FORMAT_NAME or m.get("format_version") not in range(1, shards.FORMAT_VERSION + 1):
            raise PipelineError(f"{p}: unknown format {m.get('format')!r} version {m.get('format_version')!r}")
        yield from shards.iter_samples(p)


def check_source(hs_dir: Path) -> dict:
    meta = shards.read_meta(hs_dir)
    if meta.get("format") != shards.FORMAT_NAME or meta.get("format_version") not in range(1, shards.FORMAT_VERSION + 1):
        raise PipelineError(f"{hs_dir}: unknown format {meta.get('format')!r} version {meta.get('format_version')!r}")
    if not meta.get("complete"):
        raise PipelineError(f"{hs_dir}: extraction is not complete (extract_meta.json complete=false); re-run extract")
    if meta["layer_ids"][-1] != meta["num_layers"]:
        raise PipelineError(
            f"layer_ids {meta['layer_ids']}: speculators takes the last captured layer as the target's final "
            f"state, which is id {meta['num_layers']} (N); re-extract with it last"
        )
    return meta


def check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise PipelineError(f"{out} exists and is not an empty directory; export writes only to a new one")


def _write_03(tmp: Path, samples: Iterator[shards.Sample]) -> list[int]:
    ids = []
    for i, s in enumerate(samples):
        hs = s.hidden_states
        torch.save(
            {
                "input_ids": s.input_ids.to(torch.long).clone(),
                "hidden_states": [hs[:, j].clone() for j in range(hs.shape[1])],
                "loss_mask": s.loss_mask.to(torch.long).clone(),
            },
            tmp / f"data_{i}.pt",
        )
        ids.append(s.sample_id)
    return ids


def _write_09(tmp: Path, samples: Iterator[shards.Sample]) -> list[int]:
    import datasets
    from datasets.arrow_writer import ArrowWriter

    hs_dir = tmp / "hidden_states"
    hs_dir.mkdir()
    ids: list[int] = []

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    # the token columns are streamed into one Arrow file outside `tmp`, then saved into it
    cache = Path(tempfile.mkdtemp(prefix=f"{tmp.name}-rows", dir=tmp.parent))
    try:
        writer = ArrowWriter(features=features, path=str(cache / "rows.arrow"))
        for i, s in enumerate(samples):
            save_file(
                {"hidden_states": s.hidden_states.contiguous(), "token_ids": s.input_ids.to(torch.int64).contiguous()},
                hs_dir / f"hs_{i}.safetensors",
            )
            writer.write(
                {
                    "input_ids": s.input_ids.tolist(),
                    "loss_mask": s.loss_mask.to(torch.int64).tolist(),
                    "seq_len": int(s.input_ids.numel()),
                }
            )
            ids.append(s.sample_id)
        writer.finalize()
        writer.close()
        ds = datasets.Dataset.from_file(str(cache / "rows.arrow"))
        ds.set_format(type="torch")  # as speculators' prepare-data saves it
        ds.save_to_disk(str(tmp))
        del ds
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if len(datasets.load_from_disk(str(tmp))) != len(ids):
        raise PipelineError(f"export wrote {len(ids)} hidden-state files but a different number of rows")
    return ids


def export(fmt: str, out: Path, hs_dir: Path = HIDDEN_STATES_DIR) -> dict:
    """Write the export of `hs_dir` to the new directory `out`; return its sidecar metadata."""
    if fmt not in FORMATS:
        raise PipelineError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
    out = Path(out)
    check_out(out)
    meta = check_source(Path(hs_dir))
    layer_ids = list(meta["layer_ids"])
    sidecar = {
        "format": fmt,
        "source_format": shards.FORMAT_NAME,
        "source_format_version": meta["format_version"],
        "source_run_key": meta["run_key"],
        "model_fingerprint": meta["model_fingerprint"],
        "dtype": meta["dtype"],
        # float8_e4m3 shards are exported dequantized (speculators 0.9.0's trainer reads one "hidden_states" tensor and
        # no scales): float32, the exact values the reader returns and verify checked
        "exported_dtype": "float32" if meta["dtype"] == fp8.STORAGE_DTYPE else meta["dtype"],
        "hidden_size": meta["hidden_size"],
        "num_layers": meta["num_layers"],
        "vllm_layer_ids": layer_ids,
    }
    if fmt == "speculators-0.3":
        sidecar |= {"layer_ids": to_speculators_03_ids(layer_ids), "layer_id_convention": SPECULATORS_03_CONVENTION}
    else:
        sidecar |= {"layer_ids": layer_ids, "layer_id_convention": meta["layer_id_convention"]}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + TMP_MARK, dir=out.parent))
    try:
        writer = _write_03 if fmt == "speculators-0.3" else _write_09
        sample_ids = writer(tmp, iter_all_samples(Path(hs_dir)))
        if not sample_ids:
            raise PipelineError(f"{hs_dir} holds no complete shards")
        if len(set(sample_ids)) != len(sample_ids):
            raise PipelineError(f"{hs_dir}: a sample_id appears in more than one shard")
        sidecar |= {"num_samples": len(sample_ids), "sample_ids": sample_ids}
        (tmp / EXPORT_META).write_text(json.dumps(sidecar, indent=1) + "\n")
        check_out(out)  # still free?
        if out.is_dir():
            out.rmdir()
        tmp.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dequantized = f", dequantized from {meta['dtype']} to float32" if meta["dtype"] == fp8.STORAGE_DTYPE else ""
    log(f"{len(sample_ids)} samples -> {out} ({fmt}, layers {sidecar['layer_ids']}, {sidecar['exported_dtype']}{dequantized})")
    return sidecar
