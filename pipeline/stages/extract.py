"""extract: run the target through vLLM once per sample and store its EAGLE-3 hidden states.

Reads the prepared dataset and `artifacts/model/target.json`; writes shards (docs/FORMAT.md) to
`artifacts/hidden_states/` and `metrics/extract.json`. Shard k holds samples
[k*S, (k+1)*S) and belongs to rank k % world_size. The output directory persists across runs:
shards of an identical run (same run key) are kept and skipped, anything else is deleted first.

This module is the stage alone: params -> checks -> the extraction core (pipeline/extraction/:
inputs, output, engine, ray) -> extract_meta.json and metrics.
"""

from __future__ import annotations

import json
import socket
import time

from pipeline.atomic import atomic_write_text
from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.extraction.engine import Progress, extract_shards
from pipeline.extraction.inputs import dataset_hash, log, open_prepared, plan_shards, run_key_fields
from pipeline.extraction.output import check_free_space, no_space_reason, prepare_output_dir
from pipeline.hidden_states import format as shards
from pipeline.layout import HIDDEN_STATES_DIR, METRICS
from pipeline.params import ExtractParams, resolve_layer_ids
from pipeline.target import load_target, sha256_json
from pipeline.workflow import invalidation

METRICS_FILE = METRICS / "extract.json"


def run(params: ExtractParams) -> None:
    """The stage; a write that fails for lack of space becomes a PipelineError naming the output.

    extract.engine: ray joins the Ray cluster and checks that the replicas fit it before anything
    loads (pipeline/extraction/ray.py); everything else (plan, resume, meta, metrics) is this module's.
    """
    try:
        if params.engine == "ray":
            from pipeline.extraction import ray as ray_extract

            with ray_extract.connect(params) as cluster:
                _run(params, cluster)
        else:
            _run(params)
    except PipelineError:
        raise
    except Exception as e:
        reason = no_space_reason(e)
        if reason is None:
            raise
        raise PipelineError(
            f"writing to {HIDDEN_STATES_DIR} ({HIDDEN_STATES_DIR.resolve()}) failed: {reason} "
            f"({type(e).__name__}: {e}). The disk is full or a file size limit was hit: free space there "
            "(or raise the limit) and re-run extract; the complete shards are kept and only the rest is computed"
        ) from e


def _run(params: ExtractParams, cluster=None) -> None:
    t0 = time.monotonic()
    target = load_target()
    layer_ids = resolve_layer_ids(params.layer_ids, target.num_layers)
    unservable = None if cluster else vllm_compat.int4_engine_problem(target.path)  # (Ray replicas: GPUs)
    if unservable:  # before the output directory is touched, not on the engine's first step
        raise PipelineError(f"extract: {unservable}")
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
    check_free_space(out, params, target, layer_ids, plan, seq_lens, run_key)  # before anything is written
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
        "format_version": shards.format_version(params.dtype),
        **common,
        "run_key_fields": key_fields,
        "num_layers": target.num_layers,
        "model_files_sha256": target.fingerprint.get("files", {}),
        "prepared_dataset_sha256": key_fields["prepared_dataset_sha256"],
        # only the keys that define the shards: tuning (batch sizes, parallelism, memory) goes to metrics,
        # so a run with other tuning writes the same bytes (pipeline/workflow/invalidation.py)
        "params": invalidation.output_params(params, "extract", "extract"),
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
        if cluster is not None:  # engine: ray, the replicas write the very same shards (pipeline/extraction/ray.py)
            prog = cluster.extract_shards(params, target, layer_ids, max_model_len, plan, todo, out, common)
        else:
            prog = extract_shards(params, target, layer_ids, max_model_len, ds, plan, todo, out, common)

    complete = shards.complete_shards(out)
    held = [shards.read_manifest(p) for p in complete]  # what the output holds: this run's shards and resumed ones
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
        "output_samples": sum(len(m["sample_ids"]) for m in held),
        "output_tokens": sum(sum(m["num_tokens"]) for m in held),
        "shard_workers": prog.shard_workers,
        "time_s": {k: round(v, 3) for k, v in sorted(prog.time_s.items())},
        "vllm_version": version,
        "engine": params.engine,
        "engine_params": {k: v for k, v in params.model_dump().items() if k not in meta["params"]},
        **prog.extra,
        # what `python -m pipeline plan` needs to reuse this run's tok/s for a projection here
        "host": socket.gethostname(),
        "layer_ids": layer_ids,
        "dtype": params.dtype,
    }
    METRICS_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(METRICS_FILE, json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    log(f"done: {len(todo)} shards written, {metrics['shards_resumed']} resumed, {prog.tokens} tokens in {wall:.1f} s")
