"""extract: run the target through vLLM once per sample and store its EAGLE-3 hidden states.

Reads the prepared dataset and `artifacts/model/target.json`; writes shards (docs/FORMAT.md) to
`artifacts/hidden_states/` and `metrics/extract.json`. Shard k holds samples
[k*S, (k+1)*S) and belongs to rank k % world_size. The output directory persists across runs:
shards of an identical run (same run key) are kept and skipped, anything else is deleted first.

Throughput: one thread keeps the engine fed (requests added as others finish, so the GPU never
waits on the host and no batch ends part-empty) while a pool of threads, one per core, waits for
vLLM's per-request files, checks them and writes the shards (each thread reads, checks, writes
and hashes only ~0.2 GB/s on the H200 host; docs/BENCHMARKS.md). `metrics/extract.json` splits
the time between them (`time_s`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pipeline import invalidation, shard_stats, shards, vllm_compat
from pipeline.atomic import atomic_write_text, remove_stale_temps
from pipeline.errors import PipelineError
from pipeline.layout import HIDDEN_STATES_DIR, METRICS, PREPARED_DATASET
from pipeline.params import ExtractParams, resolve_layer_ids
from pipeline.target import Target, load_target, sha256_json

METRICS_FILE = METRICS / "extract.json"
COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len")
# Shard threads: one per core up to this cap. Measured on the H200 host (16 cores, Llama-8B
# shape, 43.6k tok/s = 1.43 GB/s of hidden states): each thread writes + hashes ~0.2 GB/s there,
# so 8 threads held the engine back (32.1k tok/s until all shards written) and 16 kept up
# (40.2k tok/s, the engine at the plain-prefill rate). docs/BENCHMARKS.md has the runs.
MAX_SHARD_WORKERS = 32
POLL_S = 0.002


def log(msg: str) -> None:
    print(f"[extract] {msg}", flush=True)


# --- Fault-injection hook, for tests/test_extract_kill.py only; inert unless the variable is set. ---
# EAGLE3_TEST_KILL_AT=<event>:<n> sends this process SIGKILL at the n-th occurrence of <event>:
#   engine_started      the engine has loaded, no shard written yet (n = 1)
#   shard_tmp_written   a shard's data is in its .tmp- file, which is first cut to half its size (a torn write)
#   shard_data_renamed  a shard's data file is in place, its manifest not yet written
#   shard_done          a shard's manifest is written (n = the number of shards this run computes: the last one)
KILL_AT_ENV = "EAGLE3_TEST_KILL_AT"
_kill_lock = threading.Lock()
_kill_counts: dict[str, int] = {}


def _kill_point(event: str, before=None) -> None:
    spec = os.environ.get(KILL_AT_ENV)
    if not spec or spec.rpartition(":")[0] != event:
        return
    with _kill_lock:
        _kill_counts[event] = _kill_counts.get(event, 0) + 1
        if _kill_counts[event] == int(spec.rpartition(":")[2]):
            if before is not None:
                before()
            log(f"{KILL_AT_ENV}={spec}: SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached


def _install_kill_hook() -> None:
    """Wrap the shard writer's file writes with the two in-write kill points (test runs only)."""
    if not os.environ.get(KILL_AT_ENV) or getattr(shards, "_kill_hooked", False):
        return
    save_file, write_text = shards.save_file, shards.atomic_write_text

    def in_output(path) -> bool:  # not the sample shard pipeline/plan.py writes to a temp dir
        return Path(path).resolve().parent == HIDDEN_STATES_DIR.resolve()

    def hooked_save_file(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        if in_output(path):
            _kill_point("shard_tmp_written", before=lambda: os.truncate(path, os.path.getsize(path) // 2))

    def hooked_write_text(final, text):
        if Path(final).name.startswith("shard-") and in_output(final):
            _kill_point("shard_data_renamed")
        write_text(final, text)

    shards.save_file, shards.atomic_write_text, shards._kill_hooked = hooked_save_file, hooked_write_text, True


# --- end of the fault-injection hook ---


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


def check_free_space(out: Path, params: ExtractParams, target: Target, layer_ids: list[int], plan: ShardPlan,
                     seq_lens, run_key: str) -> None:
    """Refuse, before the output is touched or the engine loads, when the shards still to write (and
    vLLM's scratch files) do not fit the output's filesystem with extract.free_space_margin."""
    from pipeline import plan as capacity

    kept, kept_bytes, reclaimed = capacity.existing_work(out, run_key)
    todo = [i for k in plan.shards if k not in kept for i in range(*plan.bounds(k))]
    mine = [i for k in plan.shards for i in range(*plan.bounds(k))]
    overhead = capacity.measure_overhead(out, len(layer_ids), target.hidden_size, params.dtype, params.samples_per_shard)
    proj = capacity.Projection(len(mine), int(seq_lens[mine].sum()) if mine else 0, len(layer_ids), target.hidden_size,
                               params.dtype, overhead)
    need = capacity.disk_need(out, proj, int(seq_lens[todo].sum()) if todo else 0, len(todo), kept_bytes, reclaimed,
                              params.samples_per_shard, params.max_num_batched_tokens, params.free_space_margin)
    if not need.fits:
        raise PipelineError(need.refusal(proj, int(max(seq_lens)) if len(seq_lens) else None))
    log(f"space: {capacity.human_bytes(need.needed)} to write (shards + scratch bound), "
        f"{capacity.human_bytes(need.available)} free on {need.filesystem}")


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


@dataclass
class Progress:
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0  # extraction only, engine start-up excluded
    load_seconds: float = 0.0
    bytes: int = 0
    # where the time went: the feeding thread's wall time in engine steps and in adding
    # requests; the shard threads' time summed over threads (waiting for vLLM's files,
    # reading + checking them, writing + hashing shards)
    time_s: dict = field(default_factory=dict)
    shard_workers: int = 0
    extra: dict = field(default_factory=dict)  # more metrics (engine: ray: replicas, losses, retries)

    def add_time(self, key: str, seconds: float) -> None:
        self.time_s[key] = self.time_s.get(key, 0.0) + seconds


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
    # one pass over the tensor while it is in memory: the manifest's record, and the finite check
    stats = shard_stats.sample_stats(hs)
    if not shard_stats.finite(stats):
        raise PipelineError(f"sample {sid}: vLLM returned non-finite hidden states (try extract.dtype: float32)")
    ids = torch.tensor(input_ids, dtype=torch.int64)
    return shards.Sample(sid, ids, torch.tensor(loss_mask, dtype=torch.uint8), hs, stats)


# errno / message text of a write that failed for lack of space (safetensors' Rust writer raises
# its own error type, which carries the OS error only in its text)
_NO_SPACE_ERRNOS = {errno.ENOSPC: "disk full", errno.EFBIG: "file size limit", errno.EDQUOT: "disk quota exceeded"}
_NO_SPACE_TEXT = {"No space left on device": "disk full", "StorageFull": "disk full", "File too large": "file size limit",
                  "FileTooLarge": "file size limit", "Disk quota exceeded": "disk quota exceeded"}


def no_space_reason(e: BaseException) -> str | None:
    """'disk full' / 'file size limit' / 'disk quota exceeded' if `e` (or its cause) is one, else None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return _NO_SPACE_ERRNOS[e.errno]
        for text, reason in _NO_SPACE_TEXT.items():
            if text in str(e):
                return reason
        e = e.__cause__ or e.__context__
    return None


def run(params: ExtractParams) -> None:
    """The stage; a write that fails for lack of space becomes a PipelineError naming the output.

    extract.engine: ray joins the Ray cluster and checks that the replicas fit it before anything
    loads (pipeline/ray_extract.py); everything else (plan, resume, meta, metrics) is this module's.
    """
    try:
        if params.engine == "ray":
            from pipeline import ray_extract

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
    _install_kill_hook()
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
        "format_version": shards.FORMAT_VERSION,
        **common,
        "run_key_fields": key_fields,
        "num_layers": target.num_layers,
        "model_files_sha256": target.fingerprint.get("files", {}),
        "prepared_dataset_sha256": key_fields["prepared_dataset_sha256"],
        # only the keys that define the shards: tuning (batch sizes, parallelism, memory) goes to metrics,
        # so a run with other tuning writes the same bytes (pipeline/invalidation.py)
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
        if cluster is not None:  # engine: ray, the replicas write the very same shards (ray_extract.py)
            prog = cluster.extract_shards(params, target, layer_ids, max_model_len, plan, todo, out, common)
        else:
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


def shard_workers() -> int:
    """Threads that collect vLLM's files and write shards, beside the one feeding the engine."""
    return max(1, min(MAX_SHARD_WORKERS, os.cpu_count() or 1))


@dataclass
class _ShardInFlight:
    rows: dict  # the prepared rows of this shard (sample_id, input_ids, loss_mask lists)
    paths: list  # vLLM's file per row, filled in as requests finish
    left: int  # rows whose request has not finished yet


def collect_shard(
    engine,
    out: Path,
    index: int,
    rows: dict,
    paths: list[str],
    shape: tuple[int, int],
    extra: dict,
    stop: threading.Event,
) -> tuple[int, int, int, dict]:
    """In a shard thread: wait for the shard's files, check them, write the shard; return counts."""
    times = {"wait_files": 0.0, "read_check": 0.0, "write_shard": 0.0}
    samples = []
    for r, path in enumerate(paths):
        t0 = time.monotonic()
        deadline = t0 + vllm_compat.WRITE_TIMEOUT_S
        while not engine.written(path):
            if stop.is_set():
                raise PipelineError(f"shard {index}: stopped before vLLM wrote {path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not finish writing {path} within {vllm_compat.WRITE_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        t1 = time.monotonic()
        data = vllm_compat.read_hidden_states(path)
        samples.append(to_sample(rows["sample_id"][r], rows["input_ids"][r], rows["loss_mask"][r], data, shape))
        times["wait_files"] += t1 - t0
        times["read_check"] += time.monotonic() - t1
    t2 = time.monotonic()
    manifest = shards.write_shard(out, index, samples, extra)
    _kill_point("shard_done")
    times["write_shard"] += time.monotonic() - t2
    return len(samples), sum(len(s.input_ids) for s in samples), manifest["bytes"], times


def start_engine(
    params: ExtractParams, target: Target, layer_ids: list[int], max_model_len: int, scratch: Path, **engine_extra
) -> vllm_compat.HiddenStatesEngine:
    """The one vLLM engine of a local run, or of one Ray replica (pipeline/ray_extract.py): same args."""
    return vllm_compat.HiddenStatesEngine(
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
        expert_parallel=params.expert_parallel,
        gpu_memory_utilization=params.gpu_memory_utilization,
        trust_remote_code=target.trust_remote_code,
        **engine_extra,
    )


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
    engine: vllm_compat.HiddenStatesEngine | None = None,
    show_progress: bool = True,
) -> Progress:
    """Start one engine, stream the `todo` shards' samples through it, write the shards; return the counts.

    The calling thread feeds the engine: it keeps up to 2 x max_num_seqs requests (at most
    4 x max_num_batched_tokens tokens) queued, steps the engine, and hands each shard whose
    requests have all finished to a pool of shard threads. When the shard threads fall behind
    (2 x threads shards waiting), no new shard is started until they catch up.

    With `engine` given (a Ray replica, which keeps one engine for many calls), that engine is
    used and left open, and no engine is started or closed here.
    """
    prog = Progress()
    own_engine = engine is None
    scratch = (out.parent / f"{out.name}.scratch").resolve()  # vLLM's per-request files, outside the DVC out
    if own_engine:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        t_load = time.monotonic()
        engine = start_engine(params, target, layer_ids, max_model_len, scratch)
        prog.load_seconds = time.monotonic() - t_load
        _kill_point("engine_started")
    shape = (len(layer_ids), target.hidden_size)
    prog.shard_workers = workers = shard_workers()
    max_tasks = 2 * workers
    max_requests = 2 * params.max_num_seqs
    max_tokens = 4 * params.max_num_batched_tokens
    pool = ThreadPoolExecutor(workers, thread_name_prefix="shard")
    stop = threading.Event()

    todo_left = deque(todo)
    feeding: tuple[int, _ShardInFlight, int] | None = None  # (shard, state, next row to add)
    in_flight: dict[int, _ShardInFlight] = {}
    owner: dict[str, tuple[int, int, int]] = {}  # request id -> (shard, row, tokens)
    engine_tokens = 0
    ready: deque[int] = deque()  # shards whose requests all finished, not yet handed to a thread
    tasks: dict[Future, int] = {}
    started = time.monotonic()
    bar = tqdm(
        total=sum(len(range(*plan.bounds(k))) for k in todo),
        unit="sample",
        desc="extract",
        mininterval=1.0,
        disable=not show_progress,
    )
    try:
        while True:
            for fut in [f for f in tasks if f.done()]:
                del tasks[fut]
                n, tokens, nbytes, times = fut.result()  # re-raises a shard thread's error
                prog.samples += n
                prog.tokens += tokens
                prog.bytes += nbytes
                for key, sec in times.items():
                    prog.add_time(key, sec)
                prog.seconds = time.monotonic() - started
                bar.update(n)
                bar.set_postfix_str(f"{prog.tokens / max(prog.seconds, 1e-9):,.0f} tok/s", refresh=False)
            while ready and len(tasks) < max_tasks:
                k = ready.popleft()
                state = in_flight.pop(k)
                fut = pool.submit(collect_shard, engine, out, k, state.rows, state.paths, shape, manifest_extra, stop)
                tasks[fut] = k

            t_add = time.monotonic()
            while len(owner) < max_requests and engine_tokens < max_tokens:
                if feeding is None or feeding[2] == len(feeding[1].paths):
                    if not todo_left or len(tasks) + len(ready) >= max_tasks:
                        break  # nothing left, or the shard threads are behind: start no new shard
                    k = todo_left.popleft()
                    lo, hi = plan.bounds(k)
                    rows = ds[lo:hi]
                    if empty := [sid for sid, ids in zip(rows["sample_id"], rows["input_ids"], strict=True) if not ids]:
                        raise PipelineError(f"samples {empty[:5]} have no tokens; re-run the prepare stage")
                    feeding = (k, _ShardInFlight(rows, [None] * (hi - lo), hi - lo), 0)
                    in_flight[k] = feeding[1]
                k, state, r = feeding
                ids = state.rows["input_ids"][r]
                if owner and engine_tokens + len(ids) > max_tokens:
                    break
                request_id = f"s{state.rows['sample_id'][r]}"
                engine.add(request_id, ids)
                owner[request_id] = (k, r, len(ids))
                engine_tokens += len(ids)
                feeding = (k, state, r + 1)
            prog.add_time("add_requests", time.monotonic() - t_add)

            if owner:
                t_step = time.monotonic()
                finished = engine.step()
                prog.add_time("engine_step", time.monotonic() - t_step)
                for request_id, path in finished:
                    if request_id not in owner:
                        raise RuntimeError(f"vLLM finished request {request_id!r}, which this stage did not add")
                    k, r, tokens = owner.pop(request_id)
                    engine_tokens -= tokens
                    state = in_flight[k]
                    state.paths[r] = path
                    state.left -= 1
                    if state.left == 0:  # all of its requests were added and have finished
                        ready.append(k)
            elif tasks or ready:
                t_idle = time.monotonic()
                engine.idle()
                wait(list(tasks), timeout=POLL_S, return_when=FIRST_COMPLETED)
                prog.add_time("wait_shard_threads", time.monotonic() - t_idle)
            elif not todo_left and (feeding is None or feeding[2] == len(feeding[1].paths)):
                break
        # until the last shard is on disk; the engine's shutdown (seconds on a GPU) is not extraction
        prog.seconds = time.monotonic() - started
    except BaseException:
        stop.set()
        raise
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
        if own_engine:
            t_close = time.monotonic()
            engine.close()
            shutil.rmtree(scratch, ignore_errors=True)
            prog.add_time("engine_close", time.monotonic() - t_close)
    return prog
