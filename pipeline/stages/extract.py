"""extract: run the target through vLLM once per sample and store its EAGLE-3 hidden states.

Reads the prepared dataset and `artifacts/model/target.json`; writes shards (docs/FORMAT.md) to
`artifacts/hidden_states/` and `metrics/extract.json`. Shard k holds samples
[k*S, (k+1)*S) and belongs to rank k % world_size. The output directory persists across runs:
shards of an identical run (same run key) are kept and skipped, anything else is deleted first.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pipeline import shards, vllm_compat
from pipeline.atomic import atomic_write_text, remove_stale_temps
from pipeline.errors import PipelineError
from pipeline.layout import HIDDEN_STATES_DIR, METRICS, PREPARED_DATASET
from pipeline.params import ExtractParams, resolve_layer_ids
from pipeline.target import Target, load_target, sha256_json

METRICS_FILE = METRICS / "extract.json"
COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len")


def log(msg: str) -> None:
    print(f"[extract] {msg}", flush=True)


@dataclass(frozen=True)
class ShardPlan:
    num_samples: int
    samples_per_shard: int
    shards: list[int]  # this rank's shard indices

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.samples_per_shard, min((k + 1) * self.samples_per_shard, self.num_samples)


def plan_shards(num_samples: int, samples_per_shard: int, rank: int, world_size: int) -> ShardPlan:
    total = -(-num_samples // samples_per_shard)
    return ShardPlan(num_samples, samples_per_shard, [k for k in range(total) if k % world_size == rank])


def open_prepared(path: Path = PREPARED_DATASET):
    import datasets

    if not path.is_dir():
        raise PipelineError(f"{path} not found: run the prepare stage first (`dvc repro prepare`)")
    ds = datasets.load_from_disk(str(path))
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise PipelineError(f"{path} lacks columns {missing}; re-run the prepare stage")
    ids = ds.with_format("numpy")["sample_id"][:]
    if (ids != np.arange(len(ids))).any():
        raise PipelineError(f"{path}: sample_id must be 0..n-1 in order; re-run the prepare stage")
    return ds.select_columns(["sample_id", "input_ids", "loss_mask"]), ds.with_format("numpy")["seq_len"][:]


def dataset_hash(path: Path = PREPARED_DATASET) -> str:
    """Content hash of the Arrow data files (state.json may differ between identical saves)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.arrow")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def run_key_fields(target: Target, data_hash: str, layer_ids: list[int], params: ExtractParams) -> dict:
    """What the shards' contents depend on; engine tuning (batch sizes, memory) does not count."""
    return {
        "model_fingerprint": target.fingerprint["sha256"],
        "prepared_dataset_sha256": data_hash,
        "layer_ids": layer_ids,
        "dtype": params.dtype,
        "format_version": shards.FORMAT_VERSION,
        "samples_per_shard": params.samples_per_shard,
        "world_size": params.world_size,
    }


def prepare_output_dir(out: Path, run_key: str, key_fields: dict) -> set[int]:
    """Make `out` hold only shards of this run; return the indices already complete."""
    out.mkdir(parents=True, exist_ok=True)
    if n := remove_stale_temps(out):
        log(f"removed {n} leftover temp file(s) of an interrupted run")
    try:
        old = shards.read_meta(out)
    except FileNotFoundError:
        old = None
    files = sorted(out.glob("shard-*"))
    if old is None or old.get("run_key") != run_key:
        if files:
            old_fields = (old or {}).get("run_key_fields", {})
            changed = [k for k, v in key_fields.items() if old_fields.get(k) != v] or ["unknown (no extract_meta.json)"]
            log(
                f"{out} holds shards of a different run (changed: {', '.join(changed)}); deleting {len(files)} old files"
            )
        for f in files:
            f.unlink()
        return set()
    done = set()
    for p in shards.complete_shards(out):
        m = shards.read_manifest(p)
        if m.get("run_key") == run_key and p.stat().st_size == m.get("bytes"):
            done.add(int(m["shard_index"]))
        else:
            log(f"{p.name}: manifest does not match this run; recomputing it")
            p.unlink()
            shards.manifest_path(p).unlink()
    for p in out.glob("shard-*"):  # halves of a shard whose other half is missing
        pair = shards.manifest_path(p) if p.suffix == ".safetensors" else p.with_suffix(".safetensors")
        if not pair.exists():
            p.unlink()
    return done


class ShardWriter:
    """Writes shards on a background thread so the next forward pass overlaps the disk writes."""

    def __init__(self, out: Path, extra: dict, depth: int = 2) -> None:
        self.out, self.extra = out, extra
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.bytes = 0
        self.thread = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:  # after a failure keep draining so put() never blocks forever
                try:
                    manifest = shards.write_shard(self.out, item[0], item[1], self.extra)
                    self.bytes += manifest["bytes"]
                except BaseException as e:
                    self.error = e

    def put(self, index: int, samples: list[shards.Sample]) -> None:
        self._raise()
        self.q.put((index, samples))

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass
class Progress:
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0  # extraction only, engine start-up excluded
    load_seconds: float = 0.0
    bytes: int = 0


def to_sample(
    sid: int, input_ids: list[int], loss_mask: list[int], data: dict, shape: tuple[int, int]
) -> shards.Sample:
    got = data["token_ids"].tolist()
    if got != input_ids:
        first = next(
            (i for i, (a, b) in enumerate(zip(got, input_ids, strict=False)) if a != b), min(len(got), len(input_ids))
        )
        raise PipelineError(
            f"sample {sid}: vLLM captured token ids that differ from the prepared input_ids "
            f"(lengths {len(got)} vs {len(input_ids)}, first difference at position {first}); "
            "the hidden states would be misaligned, so nothing is written"
        )
    if len(loss_mask) != len(input_ids):
        raise PipelineError(
            f"sample {sid}: {len(loss_mask)} loss_mask entries for {len(input_ids)} tokens; re-run prepare"
        )
    hs = data["hidden_states"]
    if tuple(hs.shape) != (len(input_ids), *shape):
        raise PipelineError(f"sample {sid}: hidden_states shape {tuple(hs.shape)}, expected {(len(input_ids), *shape)}")
    if not torch.isfinite(hs).all():
        raise PipelineError(f"sample {sid}: vLLM returned non-finite hidden states (try extract.dtype: float32)")
    ids = torch.tensor(input_ids, dtype=torch.int64)
    return shards.Sample(sid, ids, torch.tensor(loss_mask, dtype=torch.uint8), hs)


def batches(todo: list[int], plan: ShardPlan, min_samples: int) -> list[list[int]]:
    """Consecutive shards grouped so each engine call gets at least `min_samples` requests."""
    out: list[list[int]] = []
    n = 0
    for k in todo:
        if not out or n >= min_samples:
            out.append([])
            n = 0
        out[-1].append(k)
        lo, hi = plan.bounds(k)
        n += hi - lo
    return out


def run(params: ExtractParams) -> None:
    t0 = time.monotonic()
    target = load_target()
    layer_ids = resolve_layer_ids(params.layer_ids, target.num_layers)
    ds, seq_lens = open_prepared()
    max_pos = target.config.get("text_config", target.config).get("max_position_embeddings")
    if len(seq_lens) and max_pos and int(max(seq_lens)) > max_pos:
        raise PipelineError(
            f"prepared samples have up to {int(max(seq_lens))} tokens but the target's max_position_embeddings "
            f"is {max_pos}: lower data.seq_len to at most {max_pos}"
        )
    plan = plan_shards(len(ds), params.samples_per_shard, params.rank, params.world_size)
    key_fields = run_key_fields(target, dataset_hash(), layer_ids, params)
    run_key = sha256_json(key_fields)
    version = vllm_compat.vllm_version()

    out = HIDDEN_STATES_DIR
    done = prepare_output_dir(out, run_key, key_fields)
    todo = [k for k in plan.shards if k not in done]
    common = {
        "layer_ids": layer_ids,
        "layer_id_convention": shards.LAYER_ID_CONVENTION,
        "dtype": params.dtype,
        "hidden_size": target.hidden_size,
        "model_fingerprint": target.fingerprint["sha256"],
        "run_key": run_key,
        "vllm_version": version,
        "rank": params.rank,
    }
    meta = {
        "format": shards.FORMAT_NAME,
        "format_version": shards.FORMAT_VERSION,
        **common,
        "run_key_fields": key_fields,
        "num_layers": target.num_layers,
        "model_files_sha256": target.fingerprint.get("files", {}),
        "prepared_dataset_sha256": key_fields["prepared_dataset_sha256"],
        "params": params.model_dump(),
        "world_size": params.world_size,
        "samples_per_shard": params.samples_per_shard,
        "complete": False,
    }
    shards.write_meta(out, meta)
    log(
        f"{plan.num_samples} samples; rank {params.rank} of {params.world_size} owns {len(plan.shards)} shards, "
        f"{len(plan.shards) - len(todo)} already complete; layers {layer_ids} ({params.dtype})"
    )

    prog = Progress()
    if todo:
        max_model_len = int(max(seq_lens)) + 1  # +1: the one generated token
        prog = extract_shards(params, target, layer_ids, max_model_len, ds, plan, todo, out, common)

    complete = shards.complete_shards(out)
    meta.update(
        complete=True,
        num_shards=len(complete),
        shard_indices=[int(p.stem.split("-")[1]) for p in complete],
        num_samples=sum(plan.bounds(k)[1] - plan.bounds(k)[0] for k in plan.shards),
        total_samples=plan.num_samples,
    )
    shards.write_meta(out, meta)
    wall = time.monotonic() - t0
    metrics = {
        "samples": prog.samples,
        "tokens": prog.tokens,
        "tok_per_s": round(prog.tokens / prog.seconds, 1) if prog.seconds else None,
        "bytes_per_token": round(prog.bytes / prog.tokens, 1) if prog.tokens else None,
        "wall_s": round(wall, 2),
        "engine_load_s": round(prog.load_seconds, 2),
        "shards_written": len(todo),
        "shards_resumed": len(plan.shards) - len(todo),
        "vllm_version": version,
    }
    METRICS_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(METRICS_FILE, json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    log(f"done: {len(todo)} shards written, {metrics['shards_resumed']} resumed, {prog.tokens} tokens in {wall:.1f} s")


def extract_shards(
    params: ExtractParams,
    target: Target,
    layer_ids: list[int],
    max_model_len: int,
    ds,
    plan: ShardPlan,
    todo: list[int],
    out: Path,
    manifest_extra: dict,
) -> Progress:
    """Start one engine, run the `todo` shards through it, write them; return the counts."""
    prog = Progress()
    scratch = (out.parent / f"{out.name}.scratch").resolve()  # vLLM's per-request files, outside the DVC out
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    t_load = time.monotonic()
    engine = vllm_compat.HiddenStatesEngine(
        cpu_kvcache_gib=params.cpu_kvcache_gib,
        model=target.path,
        layer_ids=layer_ids,
        scratch_dir=scratch,
        dtype=params.dtype,
        max_model_len=max_model_len,
        max_num_seqs=params.max_num_seqs,
        max_num_batched_tokens=params.max_num_batched_tokens,
        tensor_parallel_size=params.tensor_parallel_size,
        pipeline_parallel_size=params.pipeline_parallel_size,
        gpu_memory_utilization=params.gpu_memory_utilization,
        trust_remote_code=target.trust_remote_code,
    )
    prog.load_seconds = time.monotonic() - t_load
    writer = ShardWriter(out, manifest_extra)
    shape = (len(layer_ids), target.hidden_size)
    started = time.monotonic()
    bar = tqdm(total=sum(len(range(*plan.bounds(k))) for k in todo), unit="sample", desc="extract", mininterval=1.0)
    try:
        # Many requests per engine call keep vLLM's batch full; the last call's tail runs part-empty.
        for group in batches(todo, plan, min_samples=max(4 * params.max_num_seqs, params.samples_per_shard)):
            first = plan.bounds(group[0])[0]
            rows = ds[first : plan.bounds(group[-1])[1]]
            if empty := [sid for sid, ids in zip(rows["sample_id"], rows["input_ids"], strict=True) if not ids]:
                raise PipelineError(f"samples {empty[:5]} have no tokens; re-run the prepare stage")
            paths = engine.generate(rows["input_ids"])
            for k in group:
                lo, hi = plan.bounds(k)
                engine.wait_written(paths[lo - first : hi - first])
                samples = [
                    to_sample(
                        rows["sample_id"][r - first],
                        rows["input_ids"][r - first],
                        rows["loss_mask"][r - first],
                        vllm_compat.read_hidden_states(paths[r - first]),
                        shape,
                    )
                    for r in range(lo, hi)
                ]
                writer.put(k, samples)
                prog.samples += len(samples)
                prog.tokens += sum(len(s.input_ids) for s in samples)
                prog.seconds = time.monotonic() - started
                bar.update(len(samples))
                bar.set_postfix_str(f"{prog.tokens / prog.seconds:,.0f} tok/s", refresh=False)
    finally:
        bar.close()
        try:
            writer.close()  # finishes the shards already queued, even after an error
        finally:
            engine.close()
            shutil.rmtree(scratch, ignore_errors=True)
    prog.seconds = time.monotonic() - started  # until the last shard is on disk
    prog.bytes = writer.bytes
    return prog
