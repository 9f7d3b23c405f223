"""One vLLM engine fed with the planned samples; its captures checked and written as shards.

Throughput: one thread keeps the engine fed (requests added as others finish, so the GPU never
waits on the host and no batch ends part-empty) while a pool of threads, one per core, waits for
vLLM's per-request files, checks them and writes the shards (16 threads keep the disk at 0.88-1.04
of its best on a 16-core H100 host, one thread runs at its SHA-256's rate, about 0.6 of it:
docs/BENCHMARKS.md, "Shard writing against the disk"). `metrics/extract.json` splits the time
between them (`time_s`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.extraction.inputs import ShardPlan
from pipeline.hidden_states import format as shards
from pipeline.hidden_states import fp8
from pipeline.hidden_states import stats as shard_stats
from pipeline.params import ExtractParams
from pipeline.progress import progress
from pipeline.target import Target
from pipeline.watchdog import Watchdog, watch

# Shard threads: one per core up to this cap. Each thread reads vLLM's files, checks and writes;
# on a 16-core host 16 of them keep the disk at its own rate (docs/BENCHMARKS.md, "Shard writing
# against the disk"), where the 8B shape at plain prefill's rate needs 1.43 GB/s.
MAX_SHARD_WORKERS = 32
POLL_S = 0.002
KEPT = "Complete shards are kept: the re-run resumes from them."


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
    sid: int, input_ids: list[int], loss_mask: list[int], data: dict, shape: tuple[int, int], dtype: str | None = None
) -> shards.Sample:
    """vLLM's capture of one request, checked, as the sample to write (`dtype`: extract.dtype; float8_e4m3 states
    arrive quantized by the connector, on the GPU where the engine runs on one: pipeline/extraction/hs_connector.py)."""
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
    stored_fp8 = fp8.STATES_KEY in data
    if stored_fp8 != (dtype == fp8.STORAGE_DTYPE):
        raise PipelineError(f"sample {sid}: vLLM's file holds {sorted(data)}, not the states of extract.dtype {dtype}")
    hs = data[fp8.STATES_KEY] if stored_fp8 else data["hidden_states"]
    if tuple(hs.shape) != (len(input_ids), *shape):
        raise PipelineError(f"sample {sid}: hidden_states shape {tuple(hs.shape)}, expected {(len(input_ids), *shape)}")
    ids = torch.tensor(input_ids, dtype=torch.int64)
    scale = None
    if stored_fp8:  # the connector computed the statistics, of the dequantized values (a non-finite value made its
        scale, stats = data[fp8.SCALE_KEY], data[fp8.STATS_KEY].numpy()  # row NaN there: the finite check sees it)
        if tuple(scale.shape) != tuple(hs.shape[:-1]) or stats.shape != (hs.shape[1], len(shard_stats.FIELDS)):
            raise PipelineError(f"sample {sid}: fp8 scales {tuple(scale.shape)} and statistics {stats.shape} "
                                f"for states {tuple(hs.shape)}")
    else:
        # one pass over the tensor while it is in memory: the manifest's record, and the finite check
        stats = shard_stats.sample_stats(hs)
    if not shard_stats.finite(stats):
        raise PipelineError(f"sample {sid}: vLLM returned non-finite hidden states (try extract.dtype: float32)")
    return shards.Sample(sid, ids, torch.tensor(loss_mask, dtype=torch.uint8), hs, stats, scale)


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
        samples.append(to_sample(rows["sample_id"][r], rows["input_ids"][r], rows["loss_mask"][r], data, shape, extra.get("dtype")))
        times["wait_files"] += t1 - t0
        times["read_check"] += time.monotonic() - t1
    t2 = time.monotonic()
    manifest = shards.write_shard(out, index, samples, extra)
    times["write_shard"] += time.monotonic() - t2
    return len(samples), sum(len(s.input_ids) for s in samples), manifest["bytes"], times


def start_engine(
    params: ExtractParams, target: Target, layer_ids: list[int], max_model_len: int, scratch: Path, **engine_extra
) -> vllm_compat.HiddenStatesEngine:
    """The one vLLM engine of a local run, or of one Ray replica (pipeline/extraction/ray.py): same args."""
    return vllm_compat.HiddenStatesEngine(
        cpu_kvcache_gib=params.cpu_kvcache_gib,
        model=target.path,
        layer_ids=layer_ids,
        scratch_dir=scratch,
        dtype=shards.engine_dtype(params.dtype),  # fp8 is a storage format: the engine computes in bf16
        quantize_fp8=params.dtype == fp8.STORAGE_DTYPE,  # and its connector quantizes what it captured
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
    watched = contextlib.ExitStack()
    dog: Watchdog | None = None
    if own_engine:  # (not in a Ray replica, whose engine lives on in the actor between calls)
        dog = watched.enter_context(watch("extract"))
        dog.on_stall(lambda: shutil.rmtree(scratch, ignore_errors=True))
        dog.engine_starting(params.engine_start_timeout_s, "extract.engine_start_timeout_s", KEPT)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        t_load = time.monotonic()
        try:
            engine = start_engine(params, target, layer_ids, max_model_len, scratch)
        except BaseException:
            watched.close()
            raise
        prog.load_seconds = time.monotonic() - t_load
        dog.engine_running("extraction (no request finished, no shard written)", params.engine_stall_timeout_s,
                           "extract.engine_stall_timeout_s", KEPT)
    beat = dog.beat if dog is not None else lambda: None
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
    bar = progress(
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
                beat()
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
                if finished:
                    beat()
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
        watched.close()
    return prog
