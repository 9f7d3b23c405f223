"""The per-shard pass of verify: structure, recorded values and final-state hits of one shard.

Every shard is independent, so `scan_shards` runs them in a thread pool (sha256, numpy copies out
of memory maps and torch kernels release the GIL) and hands back one `ShardScan` per shard in
shard order; the verify stage merges them (duplicates across shards, missing samples, outlier
shards).

What is read of a shard: its manifest, its safetensors header (names, dtypes, shapes, offsets),
every sample's token ids and loss mask, and the final layer's rows at the masked positions (for
the final-state check). The per-layer statistics come from the manifest, where the extractor
recorded them from the tensors it wrote. An audited shard (a seeded sample, `verify.audit_*`, and
any shard without records) is read in full instead: its sha256 is re-computed and its statistics
re-derived from the bytes and compared with the record. Per-layer detail (which layer is NaN, all
zeros) is worked out only for a sample already known bad.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import shard_stats
from pipeline.progress import progress
from pipeline.reference import FinalHeadModel, ReferenceModel
from pipeline.shard_view import _NUMPY_VIEW, ShardView, read_final_rows
from pipeline.shards import FORMAT_NAME, manifest_path, read_header, read_manifest
from pipeline.target import sha256_file
from pipeline.verify_final_head import FinalHead

_ShardView = ShardView  # the name tests and benches know

GROUP_SHARDS = 8  # shards scored together at most (without per-sample tests, what bounds a group of final states)


@dataclass
class Finding:
    check: str
    message: str
    shard: str | None = None
    sample: int | None = None
    layer: int | None = None
    severity: str = "fail"  # fail | warn

    def where(self) -> str:
        parts = [f"{k}={v}" for k, v in (("shard", self.shard), ("sample", self.sample), ("layer", self.layer)) if v is not None]
        return ", ".join(parts)


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

    def row(self, sid: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.input_ids[self.input_offsets[sid] : self.input_offsets[sid + 1]]
        mask = self.loss_mask[self.mask_offsets[sid] : self.mask_offsets[sid + 1]]
        return ids, mask


@dataclass
class ScanContext:
    """What every shard is checked against (read-only, shared by the worker threads)."""

    layer_ids: list[int]
    hidden_size: int
    dtype: torch.dtype
    prepared: PreparedTokens
    # the fp32 final norm + lm_head: loaded alone before the scan, or (where that cannot be done
    # exactly) the full fp32 reference's, which loads while the shards' other checks run
    head_model: Callable[[], ReferenceModel | FinalHeadModel]
    audit: frozenset[str] = frozenset()  # shard names read in full: sha256 and statistics re-derived
    hash_all: bool = False  # re-hash every shard, not only the audited ones
    final_state_positions: int | None = None  # per shard through lm_head; None = every masked position
    seed: int = 0
    coherence: Any = None  # verify_samples.Coherence: every sample's per-token scores
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
    sample_scores: list = field(default_factory=list)  # verify_samples.SampleScores of each sample judged

    def timed(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[key] = self.seconds.get(key, 0.0) + now - since
        return now

    def fail(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, shard=self.name, **where))


def default_workers() -> int:
    return max(1, min(32, len(os.sched_getaffinity(0))))


def scan_shards(files: list[Path], ctx: ScanContext, workers: int) -> list[ShardScan]:
    """Scan every shard; results come back in `files` order.

    Each of `workers` threads takes shards one at a time and does their host part (manifest, header, structure,
    the rows to judge); once the shards it holds fill a scoring batch (or no shard is left), it scores
    them together and runs their final states through lm_head in one pass (`group_full`). On a GPU that is a few large batches
    per group instead of a small one per shard: the 8B scan's cost was per operation, not per FLOP
    (docs/BENCHMARKS.md)."""
    results: list[ShardScan | None] = [None] * len(files)
    queued = iter(enumerate(files))
    lock = threading.Lock()
    with progress(total=len(files), desc="verify shards", unit="shard") as bar:

        def work() -> None:
            group: list[tuple[int, ShardScan, PendingShard | None]] = []
            rows = 0
            while True:
                with lock:
                    item = next(queued, None)
                if item is not None:
                    scan, pending = scan_shard_host(item[1], ctx)
                    group.append((item[0], scan, pending))
                    rows += pending.judged_rows if pending else 0
                if group and (item is None or len(group) >= GROUP_SHARDS or group_full(rows, len(group), ctx)):
                    finish_group([(scan, pending) for _, scan, pending in group if pending], ctx)
                    with lock:
                        for i, scan, _ in group:
                            results[i] = scan
                        bar.update(len(group))
                    group, rows = [], 0
                if item is None:
                    return

        threads = max(1, min(workers, len(files)))
        if threads == 1:
            work()
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="verify") as pool:
                for done in [pool.submit(work) for _ in range(threads)]:
                    done.result()  # a worker's exception, raised here
    return results


def group_full(rows: int, shards: int, ctx: ScanContext) -> bool:
    """Whether a group of `shards` shards with `rows` judged rows is scored now: one more shard like these would
    take it over one scoring batch."""
    return ctx.coherence is not None and rows + rows / shards > ctx.coherence.batch_rows


def scan_shard(path: Path, ctx: ScanContext) -> ShardScan:
    """One shard's whole pass (its group of one)."""
    scan, pending = scan_shard_host(path, ctx)
    if pending:
        finish_group([(scan, pending)], ctx)
    return scan


@dataclass
class PendingShard:
    """A shard read and checked on the host, its judged rows and final states not yet scored."""

    shard: ShardView
    to_score: list  # (id, hidden states as stored, dtype, ids) of the samples the per-sample tests score
    masked: list  # (tensor name, masked positions, ids) per sample
    judged_rows: int = 0  # rows the per-sample tests score (sample_stride)


def scan_shard_host(path: Path, ctx: ScanContext) -> tuple[ShardScan, PendingShard | None]:
    """The shard's host part: manifest, header, every sample's structure and recorded values, the rows to judge."""
    scan = ShardScan(name=path.stem, path=path)
    if not manifest_path(path).is_file():
        scan.fail("structure", "shard has no manifest: an incomplete write (killed run?); re-run extract to resume")
        return scan, None
    t = time.perf_counter()
    manifest = read_manifest(path)
    scan.timed("manifest", t)
    if manifest.get("format") != FORMAT_NAME:
        scan.fail("structure", f"manifest format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
        return scan, None
    if manifest.get("layer_ids") is not None and list(manifest["layer_ids"]) != list(ctx.layer_ids):
        scan.fail("structure", f"manifest layer_ids {manifest['layer_ids']} differ from the run's {ctx.layer_ids}")
    size = path.stat().st_size
    if size != manifest["bytes"]:
        scan.fail("structure", f"file is {size} bytes, its manifest says {manifest['bytes']}: truncated or corrupt")
        return scan, None
    records = (manifest.get("layer_stats") or {}).get("samples")
    scan.audited = path.stem in ctx.audit or records is None
    if scan.audited or ctx.hash_all:
        t = time.perf_counter()
        digest = sha256_file(path)
        scan.timed("sha256", t)
        if digest != manifest["sha256"]:
            scan.fail("structure", "file content does not match its manifest sha256: corrupt, or changed after extraction")
            return scan, None
        scan.hashed = True
    scan.bytes = size
    sample_ids = list(manifest["sample_ids"])
    t = time.perf_counter()
    try:
        header, data_start = read_header(path)
    except (ValueError, KeyError, TypeError) as e:
        scan.fail("structure", f"unreadable safetensors file: {e}")
        return scan, None
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
        return scan, None
    if unknown := sorted({e["dtype"] for e in header.values()} - set(_NUMPY_VIEW)):
        scan.fail("structure", f"tensors of dtype {unknown}: not one this format uses")
        return scan, None
    scan.read_ok = True
    data = np.memmap(path, dtype=np.uint8, mode="r")  # pages are read only where a view is used
    shard = ShardView(data, header, data_start)
    return scan, scan_samples(scan, shard, sample_ids, records or {}, ctx)


def scan_samples(scan: ShardScan, shard: ShardView, sample_ids: list[int], records: dict, ctx: ScanContext) -> PendingShard:
    """Every sample's structure and recorded values, the shard's statistics; the rows to score and the masked
    positions are left to `finish_group`."""
    num_layers = len(ctx.layer_ids)
    sums = np.zeros((num_layers, 4))  # sum, sum of squares, abs max, count
    masked: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (tensor name, masked positions, ids) per sample
    in_shard: set[int] = set()
    to_score: list = []
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
        ids = shard.tensor(f"{sid}/input_ids")
        mask = shard.tensor(f"{sid}/loss_mask")
        if not check_sample_structure(scan, sid, shard.shape(name), shard.dtype(name), ids, mask, ctx):
            continue
        T, _, H = shard.shape(name)
        hs = shard.numpy(name)
        recorded = records.get(str(sid))
        if scan.audited:
            t = time.perf_counter()
            stats = shard_stats.sample_stats(hs)  # reads the sample's every byte
            scan.timed("audit_stats", t)
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
        lo, hi = stats[:, 2], stats[:, 3]
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or (T * H > 1 and (lo == hi).any()):
            report_bad_values(scan, sid, shard.tensor(name), ctx.layer_ids)
            continue
        sums[:, 0] += stats[:, 0]
        sums[:, 1] += stats[:, 1]
        sums[:, 2] = np.maximum(sums[:, 2], np.maximum(-lo, hi))
        sums[:, 3] += T * H
        scan.tokens += T
        if ctx.coherence is not None:
            to_score.append((sid, hs, shard.header[name]["dtype"], ids))
        positions = mask[:-1].bool().nonzero().squeeze(-1)
        if positions.numel():
            masked.append((name, positions, ids))
    # the per-sample checks (ids, masks, shapes, records) without the audit's reading
    scan.seconds["sample_checks"] = time.perf_counter() - loop_started - scan.seconds.get("audit_stats", 0.0)
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
    scan.masked_positions = sum(p.numel() for _, p, _ in masked)
    judged = sum(len(ctx.coherence.positions(sid, hs.shape[0])) for sid, hs, _, _ in to_score) if to_score else 0
    return PendingShard(shard, to_score, masked, judged)


def finish_group(group: list[tuple[ShardScan, PendingShard]], ctx: ScanContext) -> None:
    """The group's samples scored together (a few large batches: verify_samples.Coherence.score_samples) and its
    chosen final states through lm_head in one pass. The group's time is booked on its first shard (the scan's
    thread-seconds are summed over shards)."""
    if not group:
        return
    lead = group[0][0]
    to_score = [item for _, pending in group for item in pending.to_score]
    if to_score:
        t = time.perf_counter()
        scores = iter(ctx.coherence.score_samples(to_score, lead.timed))
        for scan, pending in group:
            scan.sample_scores.extend(next(scores) for _ in pending.to_score)
        lead.timed("sample_coherence", t)
    chosen = [sample_final_positions(pending.masked, ctx.final_state_positions, ctx.seed, scan.name) for scan, pending in group]
    counts = [sum(p.numel() for _, p, _ in c) for c in chosen]
    if not sum(counts):
        return
    t = time.perf_counter()
    head = ctx.final_head
    states = torch.empty((sum(counts), ctx.hidden_size), dtype=ctx.dtype, pin_memory=head.wants_pinned)
    at = 0
    for (_, pending), picked, n in zip(group, chosen, counts, strict=True):
        if n:
            read_final_rows(pending.shard, picked, len(ctx.layer_ids) - 1, ctx.hidden_size, out=states[at : at + n])
        at += n
    t = lead.timed("read_final_rows", t)
    pred = head.argmax(states, lead.timed)
    lead.timed("final_lm_head", t)
    at = 0
    for (scan, _), picked, n in zip(group, chosen, counts, strict=True):
        if n:
            targets = torch.cat([ids[positions + 1] for _, positions, ids in picked])
            scan.hits, scan.counted = int((pred[at : at + n] == targets.long()).sum()), n
        at += n


def sample_final_positions(masked: list, limit: int | None, seed: int, shard_name: str) -> list:
    """The masked positions whose final state goes through lm_head: all of them, or a seeded
    sample of `limit` across the shard (`verify.final_state_positions_per_shard`)."""
    total = sum(p.numel() for _, p, _ in masked)
    if limit is None or total <= limit:
        return masked
    rng = np.random.default_rng([seed, int.from_bytes(shard_name.encode()[-8:], "little")])
    keep = np.zeros(total, dtype=bool)
    keep[rng.choice(total, size=limit, replace=False)] = True
    out, start = [], 0
    for name, positions, ids in masked:
        chosen = positions[torch.from_numpy(keep[start : start + positions.numel()])]
        start += positions.numel()
        if chosen.numel():
            out.append((name, chosen, ids))
    return out


def check_sample_structure(scan: ShardScan, sid: int, shape: tuple, dtype: torch.dtype, ids, mask, ctx: ScanContext) -> bool:
    want_ids, want_mask = ctx.prepared.row(sid)
    T, L, H = len(want_ids), len(ctx.layer_ids), ctx.hidden_size
    if tuple(shape) != (T, L, H):
        scan.fail("structure", f"hidden_states shape {list(shape)}, expected [T={T}, L={L}, H={H}]", sample=sid)
        return False
    ok = True
    if dtype != ctx.dtype:
        scan.fail("structure", f"hidden_states dtype {dtype}, the run declares {ctx.dtype}", sample=sid)
        ok = False
    if tuple(ids.shape) != want_ids.shape or not np.array_equal(ids.numpy(), want_ids):
        scan.fail("structure", "input_ids differ from the prepared dataset's", sample=sid)
        ok = False
    if tuple(mask.shape) != want_mask.shape or not np.array_equal(mask.numpy(), want_mask):
        scan.fail("structure", "loss_mask differs from the prepared dataset's", sample=sid)
        ok = False
    return ok


def report_bad_values(scan: ShardScan, sid: int, hs: torch.Tensor, layer_ids: list[int]) -> None:
    for i, lid in enumerate(layer_ids):
        layer = hs[:, i]
        bad = (~torch.isfinite(layer)).sum().item()
        if bad:
            kinds = [k for k, n in (("NaN", torch.isnan(layer).sum().item()), ("Inf", torch.isinf(layer).sum().item())) if n]
            scan.fail("values", f"{bad} non-finite values ({'/'.join(kinds)})", sample=sid, layer=lid)
        elif not layer.any():
            scan.fail("values", "layer is all zeros", sample=sid, layer=lid)
        elif layer.numel() > 1 and (layer == layer.reshape(-1)[0]).all():
            scan.fail("values", f"layer is constant ({layer.reshape(-1)[0].item():g})", sample=sid, layer=lid)
