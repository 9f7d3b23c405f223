"""The per-shard pass of verify: structure, recorded values and final-state hits of one shard.

Every shard is independent, so `scan_shards` runs them in a thread pool (sha256, numpy copies out
of memory maps and torch kernels release the GIL) and hands back one `ShardScan` per shard in
shard order; the verify stage merges them (duplicates across shards, missing samples, outlier
shards).

What is read of a shard: its manifest, its safetensors header (names, dtypes, shapes, offsets),
every sample's token ids and loss mask, every captured layer's rows at the positions the per-sample
tests judge (pipeline/verification/samples/scores.py), whose final-layer rows at the answers' positions go through
lm_head: the token identity's next-token contrast reads each (pipeline/verification/samples/next_token.py), the
final-state check a seeded sample of them (with `final_state_positions_per_shard: null`, or no per-sample tests, the
final layer's rows at every masked position are read instead). The per-layer
statistics come from the manifest, where the extractor recorded them from the tensors it wrote.
An audited shard (a seeded sample, `verify.audit_*`, and any shard without records) is also read
in full (pipeline/verification/audit.py, ahead of its scan in threads of its own): its sha256 is
re-computed and its statistics re-derived from the bytes and compared with the record. Per-layer
detail (which layer is NaN, all zeros) is worked out only for a sample already known bad.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import PipelineError
from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.format import FORMAT_NAME, check_version, logical_header, manifest_path, read_header
from pipeline.progress import progress
from pipeline.verification.audit import read_in_full
from pipeline.verification.final_head import FINAL_CHUNK_POSITIONS, FinalHead, sample_final_positions, split_positions
from pipeline.verification.host_staging import HostStaging
from pipeline.verification.reference.model import FinalHeadModel, ReferenceModel
from pipeline.verification.report import Finding
from pipeline.verification.samples.next_token import answered_positions, contrast_scores, contrast_tokens
from pipeline.verification.samples.positions import batch_capacity, judged_positions
from pipeline.verification.samples.scores import INDICES_PER_ROW
from pipeline.verification.shard_view import _NUMPY_VIEW, ShardView, map_shard, read_final_rows
from pipeline.verification.values import bad_values, suspect_layers

_ShardView = ShardView  # the name tests and benches know


class PreparedTokens:
    """The prepared dataset's token ids and loss masks as flat arrays + offsets (one Arrow copy):
    a sample's rows are numpy slices, not a datasets row decode per sample (which, under the GIL,
    was most of the per-shard pass on an H200)."""

    def __init__(self, dataset) -> None:
        table = dataset.flatten_indices().data if getattr(dataset, "_indices", None) is not None else dataset.data
        self.input_ids, self.input_offsets = self._flat(table.column("input_ids"))
        self.loss_mask, self.mask_offsets = self._flat(table.column("loss_mask"))

    @staticmethod
    def _flat(column) -> tuple[np.ndarray, np.ndarray]:
        array = column.combine_chunks()
        offsets = array.offsets.to_numpy()
        values = array.values.to_numpy(zero_copy_only=False)
        return values[offsets[0] :] if offsets[0] else values, offsets - offsets[0]

    def __len__(self) -> int:
        return len(self.input_offsets) - 1

    def longest(self) -> int:
        return int(np.diff(self.input_offsets).max(initial=0))

    def row(self, sid: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.input_ids[self.input_offsets[sid] : self.input_offsets[sid + 1]]
        mask = self.loss_mask[self.mask_offsets[sid] : self.mask_offsets[sid + 1]]
        return ids, mask


@dataclass
class ScanContext:
    """What every shard is checked against (read-only, shared by the worker threads)."""

    layer_ids: list[int]
    hidden_size: int
    dtype: torch.dtype  # of the values the scan reads (float32 for fp8 states, which it dequantizes)
    prepared: PreparedTokens
    # the fp32 final norm + lm_head: loaded alone before the scan, or (where that cannot be done
    # exactly) the full fp32 reference's, which loads while the shards' other checks run
    head_model: Callable[[], ReferenceModel | FinalHeadModel]
    audit: frozenset[str] = frozenset()  # shard names read in full: sha256 and statistics re-derived
    hash_all: bool = False  # re-hash every shard, not only the audited ones
    final_state_positions: int | None = None  # per shard through lm_head; None = every masked position
    seed: int = 0
    coherence: Any = None  # samples.scores.Coherence: every sample's per-token scores
    stored_dtype: torch.dtype | None = None  # as stored, where it differs from `dtype` (fp8)
    staging: HostStaging | None = None  # the scan threads' host buffers (made by scan_shards)
    _final_head: FinalHead | None = field(default=None, init=False, repr=False)
    _final_head_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def final_head(self) -> FinalHead:
        """lm_head(norm(.)) in fp32; the first caller may wait for the full reference to load."""
        with self._final_head_lock:
            if self._final_head is None:
                self._final_head = FinalHead(self.head_model())
            return self._final_head


@dataclass
class ShardScan:
    name: str
    path: Path
    findings: list[Finding] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)  # samples whose tensors were read (for duplicates/missing)
    stats: dict | None = None  # per layer id: mean, std, abs_max, rms
    hits: int = 0  # masked positions whose argmax(lm_head(norm(h_N))) is the next token
    counted: int = 0
    tokens: int = 0
    bytes: int = 0
    read_ok: bool = False  # manifest, size and key set were fine
    audited: bool = False  # read in full: statistics re-derived from the bytes
    hashed: bool = False  # sha256 re-computed and equal to the manifest's
    masked_positions: int = 0  # masked positions in the shard (`counted` of them went through lm_head)
    seconds: dict = field(default_factory=dict)  # where this shard's time went (docs/BENCHMARKS.md)
    sample_scores: list = field(default_factory=list)  # samples.scores.SampleScores of each sample judged

    def timed(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[key] = self.seconds.get(key, 0.0) + now - since
        return now

    def fail(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, shard=self.name, **where))


# scan threads by default on a CPU: each thread's scoring is torch's CPU work, on its share of the cores
DEFAULT_WORKERS = 4
# and where the scan feeds a GPU: 4 threads kept an H200 as busy as 16 did (16 took 2-3x the thread-seconds: GIL,
# page-locked staging, the GPU's queues; 2026-12-04); 8 threads, with torch's CPU operations on half the cores
# between them (one each on 16; `intra_op_threads`), scanned the 8B shape on an H100 in 1.167-1.173 s against
# 1.300-1.337 s from 4 threads at four each (2026-12-05), where 8 at two each are not clearly faster than 4 at four
# (docs/ARCHITECTURE.md, "Per-sample tests: what is caught, what cannot be")
DEFAULT_GPU_WORKERS = 8
# the GIL's switch interval while the scan's threads run (Python's default: 5 ms): a thread back from a torch call or a
# row copy waits at most this long for one in a stretch of Python (a shard's sample checks, its indices); on an H200
# (8B shape) on a contended host 1 ms took the scan 1.98-2.19 -> 1.57 s; on a fast one it changed nothing, and 0.5 ms was
# slower (2026-12-05, code c78ad1a: `git show 61b87c6:docs/BENCHMARKS.md`)
SCAN_SWITCH_INTERVAL = 0.001


def default_workers() -> int:
    wanted = DEFAULT_GPU_WORKERS if torch.cuda.is_available() else DEFAULT_WORKERS
    return max(1, min(wanted, len(os.sched_getaffinity(0))))


def intra_op_threads(threads: int, current: int) -> int:
    """torch's intra-op threads while `threads` scan threads run. Their CPU operations (a GPU host's row gathers, a CPU's
    whole scoring) share the cores: each thread's call otherwise starts a team of every core's thread (16 x 4 on an
    H200 host), and the GPU's feeders wait for cores (a shard's scoring from 4 threads: 91 -> 117 batches a second,
    2026-12-05). Feeding a GPU, they share half the cores, the rest left to the audit's readers, the CUDA calls and
    the Python between them: 8 threads at one each on 16 cores scanned the 8B shape ~12% faster than 4 at four, where 8
    at two are not clearly faster (H100, 2026-12-05; docs/ARCHITECTURE.md, "Per-sample tests: what is caught, what
    cannot be")."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(current, cores // (2 * threads) if torch.cuda.is_available() else cores // threads))


def scan_threads(workers: int, shards: int) -> int:
    return max(1, min(workers, shards))


def staging_for(ctx: ScanContext, threads: int) -> HostStaging:
    """One buffer per scan thread, large enough for a coherence batch's judged rows of every captured layer and for
    a chunk of final-layer rows (at the 8B shape: 128 MiB a thread); page-locked where the scan uploads to a GPU."""
    rows = batch_capacity(ctx.prepared.longest(), ctx.coherence.stride) if ctx.coherence is not None else 0
    row_bytes = max(rows * len(ctx.layer_ids), FINAL_CHUNK_POSITIONS) * ctx.hidden_size * ctx.dtype.itemsize
    return HostStaging(threads, row_bytes, INDICES_PER_ROW * rows, pinned=torch.cuda.is_available())


def scan_shards(files: list[Path], ctx: ScanContext, workers: int) -> list[ShardScan]:
    """Scan every shard (in parallel when workers > 1); results come back in `files` order. The shards read in full
    (audited, or every one with `hash_all`) are read by threads of their own from the start and scanned last, when
    their reading is done: read by a scan thread, it held that thread while the others alone fed the GPU."""
    threads = scan_threads(workers, len(files))
    if ctx.staging is None or ctx.staging.count < threads:
        ctx.staging = staging_for(ctx, threads)
    if threads == 1:
        return [scan_shard(p, ctx) for p in progress(files, desc="verify shards", unit="shard")]
    ahead = [ctx.hash_all or p.stem in ctx.audit for p in files]  # read in full, ahead of the scan
    read_fully = [i for i, a in enumerate(ahead) if a]
    order = [i for i, a in enumerate(ahead) if not a] + read_fully
    scans: list[ShardScan | None] = [None] * len(files)
    readers = ThreadPoolExecutor(max_workers=max(1, min(threads, len(read_fully))), thread_name_prefix="verify-audit")
    interval, intra_op = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(min(interval, SCAN_SWITCH_INTERVAL))
    torch.set_num_threads(intra_op_threads(threads, intra_op))
    try:
        full_reads = {i: readers.submit(read_in_full, files[i], files[i].stem in ctx.audit) for i in read_fully}
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="verify") as pool:
            done = pool.map(lambda i: (i, scan_shard(files[i], ctx, full_reads.get(i))), order)
            for i, scan in progress(done, total=len(files), desc="verify shards", unit="shard"):
                scans[i] = scan
    finally:
        readers.shutdown(cancel_futures=True)
        sys.setswitchinterval(interval)
        torch.set_num_threads(intra_op)
    return scans


def scan_shard(path: Path, ctx: ScanContext, full_read: Future | None = None) -> ShardScan:
    """One shard's checks; `full_read`: its `read_in_full`, started earlier (else read here if it is to be)."""
    scan = ShardScan(name=path.stem, path=path)
    if not manifest_path(path).is_file():
        scan.fail("structure", "shard has no manifest: an incomplete write (killed run?); re-run extract to resume")
        return scan
    t = time.perf_counter()
    manifest = json.loads(manifest_path(path).read_text())
    scan.timed("manifest", t)
    if manifest.get("format") != FORMAT_NAME:
        scan.fail("structure", f"manifest format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
        return scan
    try:
        check_version(manifest.get("format_version"), manifest_path(path))
    except PipelineError as e:
        scan.fail("structure", str(e))
        return scan
    if manifest.get("layer_ids") is not None and list(manifest["layer_ids"]) != list(ctx.layer_ids):
        scan.fail("structure", f"manifest layer_ids {manifest['layer_ids']} differ from the run's {ctx.layer_ids}")
    size = path.stat().st_size
    if size != manifest["bytes"]:
        scan.fail("structure", f"file is {size} bytes, its manifest says {manifest['bytes']}: truncated or corrupt")
        return scan
    records = (manifest.get("layer_stats") or {}).get("samples")
    scan.audited = path.stem in ctx.audit or records is None
    full = None
    if scan.audited or ctx.hash_all:
        # read ahead with statistics for the audit's names only: a shard found here without records (hashed ahead
        # under hash_all, or one scan thread) is read now
        if full_read is not None and (path.stem in ctx.audit or not scan.audited):
            t = time.perf_counter()
            full = full_read.result()
            scan.timed("full_read_wait", t)
        else:
            full = read_in_full(path, scan.audited)
        for key, seconds in full.seconds.items():
            scan.seconds[key] = scan.seconds.get(key, 0.0) + seconds
        if full.digest != manifest["sha256"]:
            scan.fail("structure", "file content does not match its manifest sha256: corrupt, or changed after extraction")
            return scan
        scan.hashed = True
    scan.bytes = size
    sample_ids = list(manifest["sample_ids"])
    t = time.perf_counter()
    try:
        header, data_start = read_header(path)
        header = logical_header(header)  # fp8 states + scale as "{sid}/hidden_states" (format version 2)
    except (ValueError, KeyError, TypeError) as e:
        scan.fail("structure", f"unreadable safetensors file: {e}")
        return scan
    scan.timed("header", t)
    keys = set(header)
    expected_keys = {f"{sid}/{k}" for sid in sample_ids for k in ("hidden_states", "input_ids", "loss_mask")}
    if keys != expected_keys:
        extra, missing = sorted(keys - expected_keys), sorted(expected_keys - keys)
        scan.fail(
            "structure",
            f"key set differs from manifest: {len(keys)} tensors, expected {len(expected_keys)} "
            f"(3 per sample); unexpected {extra[:5]}, missing {missing[:5]}",
        )
        return scan
    if unknown := sorted({e["dtype"] for e in header.values()} - set(_NUMPY_VIEW)):
        scan.fail("structure", f"tensors of dtype {unknown}: not one this format uses")
        return scan
    scan.read_ok = True
    shard = map_shard(path, header, data_start, read_whole=scan.audited)
    scan_samples(scan, shard, sample_ids, records or {}, ctx, full.stats if full is not None else {})
    return scan


def scan_samples(
    scan: ShardScan, shard: ShardView, sample_ids: list[int], records: dict, ctx: ScanContext, derived: dict[int, np.ndarray]
) -> None:
    """`derived`: the audited shard's statistics from the bytes (`read_in_full`), judged against the records."""
    num_layers = len(ctx.layer_ids)
    sums = np.zeros((num_layers, 4))  # sum, sum of squares, abs max, count
    masked: list[tuple[str, np.ndarray, np.ndarray]] = []  # (tensor name, check 4's candidate positions, ids) per sample
    sample_of: dict[str, int] = {}  # tensor name -> sample id
    in_shard: set[int] = set()
    to_score: list = []  # (id, hidden states, dtype, ids) of the samples the per-sample tests score
    # check 4's final states taken from the scoring's rows (a seeded sample of the judged masked positions), or read
    # from the shard (every masked position, or no per-sample tests)
    from_scoring = ctx.coherence is not None and ctx.final_state_positions is not None
    loop_started = time.perf_counter()
    for sid in sample_ids:
        if sid in in_shard:
            scan.fail("structure", "duplicate sample id within the shard's manifest", sample=sid)
            continue
        in_shard.add(sid)
        scan.sample_ids.append(sid)
        if not 0 <= sid < len(ctx.prepared):
            scan.fail("structure", f"sample id not in the prepared dataset (0..{len(ctx.prepared) - 1})", sample=sid)
            continue
        name = f"{sid}/hidden_states"
        # numpy views of the memory map, not torch copies: a sample's checks are ~20 small operations, and a torch
        # call costs several times a numpy one, under the GIL the scan threads share
        ids = shard.numpy(f"{sid}/input_ids")
        mask = shard.numpy(f"{sid}/loss_mask")
        if not check_sample_structure(scan, sid, shard.shape(name), shard.stored_dtype(name), ids, mask, ctx,
                                      shard.header[name].get("scale")):
            continue
        T, _, H = shard.shape(name)
        hs = shard.numpy(name)
        recorded = records.get(str(sid))
        if scan.audited:
            stats = derived[sid] if sid in derived else shard_stats.sample_stats(hs)  # every byte of the sample
            if recorded is not None and (bad := shard_stats.records_agree(recorded, stats, T * H)):
                scan.fail(
                    "structure",
                    f"the manifest's recorded statistics differ from the bytes at layer(s) {[ctx.layer_ids[i] for i in bad]} "
                    f"(recorded {np.asarray(recorded)[bad[0]].tolist()}, derived {stats[bad[0]].tolist()}): "
                    "the extractor's record is wrong or the file changed after it was written",
                    sample=sid,
                )
        elif recorded is None:
            scan.fail("structure", "the manifest has no recorded statistics for this sample", sample=sid)
            continue
        else:
            stats = np.asarray(recorded, dtype=np.float64)
        if suspect_layers(stats, T * H):
            for check, message, layer in bad_values(shard.tensor(name), ctx.layer_ids, stats):
                scan.fail(check, message, sample=sid, layer=layer)
            continue
        lo, hi = stats[:, 2], stats[:, 3]
        sums[:, 0] += stats[:, 0]
        sums[:, 1] += stats[:, 1]
        sums[:, 2] = np.maximum(sums[:, 2], np.maximum(-lo, hi))
        sums[:, 3] += T * H
        scan.tokens += T
        if ctx.coherence is not None:
            to_score.append((sid, hs, shard.kind(name), ids))
            shard.prefetch(name, judged_positions(T, ctx.coherence.stride, ctx.coherence.seed, sid))
        positions = np.flatnonzero(mask[:-1])
        scan.masked_positions += len(positions)
        if from_scoring:
            # a sample of them is enough: drawn from the positions the per-sample tests judge, whose rows the scoring
            # has uploaded (read again from the shard, scattered rows page-faulted: an H200's scan read them at a
            # quarter of the gather's rate)
            judged = judged_positions(T, ctx.coherence.stride, ctx.coherence.seed, sid)
            judged_here = np.zeros(T, dtype=bool)  # a lookup table: np.isin sorts, ~5x the time at a sample's size
            judged_here[judged] = True
            positions = positions[judged_here[positions]]
        if len(positions):
            masked.append((name, positions, ids))
            sample_of[name] = sid
    # the per-sample checks (ids, masks, shapes, records) without the audit's reading
    scan.seconds["sample_checks"] = time.perf_counter() - loop_started
    chosen = sample_final_positions(masked, ctx.final_state_positions, ctx.seed, scan.name)
    predicted = []
    with ctx.staging.buffer() as staging:
        if to_score:
            t = time.perf_counter()
            # the final state of every judged position of the answers goes through lm_head: the per-sample token-identity
            # test reads each of them, check 4 its seeded sample
            ids_of = {sid: ids for sid, _, _, ids in to_score}
            judged = {sid: judged_positions(len(ids), ctx.coherence.stride, ctx.coherence.seed, sid) for sid, ids in ids_of.items()}
            masks_of = {sid: shard.numpy(f"{sid}/loss_mask") for sid in ids_of}
            answered = {sid: answered_positions(judged[sid], masks_of[sid]) for sid in ids_of}
            answered = {sid: positions for sid, positions in answered.items() if len(positions)}
            scores, final_states = ctx.coherence.score_keeping_final_states(to_score, answered, scan.timed, staging)
            t = scan.timed("sample_coherence", t)
            for score in scores:
                score.next_token = torch.full((score.positions.size,), float("nan"))
            if answered:
                tokens = torch.from_numpy(np.concatenate([contrast_tokens(ids_of[sid], answered[sid]) for sid in answered]))
                best, log_probs = ctx.final_head.predict(torch.cat([final_states[sid] for sid in answered]), tokens, scan.timed)
                sizes = [len(positions) for positions in answered.values()]
                best_of = dict(zip(answered, best.split(sizes), strict=True))
                log_probs_of = dict(zip(answered, log_probs.split(sizes), strict=True))
                for score in scores:
                    if score.sample in answered:
                        score.next_token = contrast_scores(log_probs_of[score.sample], answered[score.sample], score.positions,
                                                           masks_of[score.sample])
                if from_scoring and chosen:
                    predicted.append(torch.cat([best_of[sample_of[name]][np.searchsorted(answered[sample_of[name]], positions)]
                                                for name, positions, _ in chosen]))
                scan.timed("final_lm_head", t)
            scan.sample_scores.extend(scores)
        if not from_scoring:  # through lm_head in pieces the staging buffer holds
            for piece in split_positions(chosen, staging.rows.numel() // (ctx.hidden_size * ctx.dtype.itemsize)):
                t = time.perf_counter()
                states = read_final_rows(shard, piece, num_layers - 1, ctx.hidden_size, staging)
                t = scan.timed("read_final_rows", t)
                predicted.append(ctx.final_head.argmax(states, scan.timed))
                scan.timed("final_lm_head", t)
    if chosen:
        targets = torch.from_numpy(np.concatenate([ids[positions + 1] for _, positions, ids in chosen]))
        scan.hits, scan.counted = int((torch.cat(predicted) == targets.long()).sum()), int(targets.numel())
    count = np.maximum(sums[:, 3], 1)
    mean = sums[:, 0] / count
    rms = np.sqrt(sums[:, 1] / count)
    scan.stats = {
        str(lid): {
            "mean": float(mean[i]),
            "std": float(np.sqrt(max(rms[i] ** 2 - mean[i] ** 2, 0.0))),
            "abs_max": float(sums[i, 2]),
            "rms": float(rms[i]),
        }
        for i, lid in enumerate(ctx.layer_ids)
    }


def check_sample_structure(scan: ShardScan, sid: int, shape: tuple, dtype: torch.dtype, ids, mask, ctx: ScanContext,
                           scale: dict | None = None) -> bool:
    """`scale`: fp8 states' scale entry (format version 2), None for other states."""
    want_ids, want_mask = ctx.prepared.row(sid)
    T, L, H = len(want_ids), len(ctx.layer_ids), ctx.hidden_size
    if tuple(shape) != (T, L, H):
        scan.fail("structure", f"hidden_states shape {list(shape)}, expected [T={T}, L={L}, H={H}]", sample=sid)
        return False
    if dtype == torch.float8_e4m3fn and scale is None:
        scan.fail("structure", "fp8 hidden states without their scale tensor (hidden_states_scale)", sample=sid)
        return False
    if scale is not None and (scale.get("dtype") != "F32" or list(scale.get("shape", [])) != [T, L]):
        scan.fail("structure", f"hidden_states_scale is {scale.get('dtype')} {scale.get('shape')}, expected F32 [T={T}, L={L}]",
                  sample=sid)
        return False
    ok = True
    if dtype != (ctx.stored_dtype or ctx.dtype):
        scan.fail("structure", f"hidden_states dtype {dtype}, the run declares {ctx.stored_dtype or ctx.dtype}", sample=sid)
        ok = False
    if ids.shape != want_ids.shape or not np.array_equal(ids, want_ids):
        scan.fail("structure", "input_ids differ from the prepared dataset's", sample=sid)
        ok = False
    if mask.shape != want_mask.shape or not np.array_equal(mask, want_mask):
        scan.fail("structure", "loss_mask differs from the prepared dataset's", sample=sid)
        ok = False
    return ok
