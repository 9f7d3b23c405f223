"""The per-shard pass of verify: structure, values and final-state hits of one shard, read once.

Every shard is independent, so `scan_shards` runs them in a thread pool (sha256, safetensors reads
and torch kernels release the GIL) and hands back one `ShardScan` per shard in shard order; the
verify stage merges them (duplicates across shards, missing samples, outlier shards). The common,
clean path does a few whole-sample reductions per sample and one lm_head pass per shard; the
per-layer detail is worked out only for a sample that is already known to be bad.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pipeline.reference import ReferenceModel
from pipeline.shards import FORMAT_NAME, manifest_path, read_manifest
from pipeline.target import sha256_file


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


@dataclass
class ScanContext:
    """What every shard is checked against (read-only, shared by the worker threads)."""

    layer_ids: list[int]
    hidden_size: int
    dtype: torch.dtype
    prepared: object  # datasets.Dataset in torch format (input_ids, loss_mask)
    reference: ReferenceModel


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
    read_ok: bool = False  # manifest, hash and key set were fine

    def fail(self, check: str, message: str, **where) -> None:
        self.findings.append(Finding(check, message, shard=self.name, **where))


def default_workers() -> int:
    return max(1, min(32, len(os.sched_getaffinity(0))))


def scan_shards(files: list[Path], ctx: ScanContext, workers: int) -> list[ShardScan]:
    """Scan every shard (in parallel when workers > 1); results come back in `files` order."""
    if workers <= 1 or len(files) <= 1:
        return [scan_shard(p, ctx) for p in tqdm(files, desc="verify shards", unit="shard")]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        return list(tqdm(pool.map(lambda p: scan_shard(p, ctx), files), total=len(files), desc="verify shards", unit="shard"))


def scan_shard(path: Path, ctx: ScanContext) -> ShardScan:
    scan = ShardScan(name=path.stem, path=path)
    if not manifest_path(path).is_file():
        scan.fail("structure", "shard has no manifest: an incomplete write (killed run?); re-run extract to resume")
        return scan
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT_NAME:
        scan.fail("structure", f"manifest format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
        return scan
    if manifest.get("layer_ids") is not None and list(manifest["layer_ids"]) != list(ctx.layer_ids):
        scan.fail("structure", f"manifest layer_ids {manifest['layer_ids']} differ from the run's {ctx.layer_ids}")
    size = path.stat().st_size
    if size != manifest["bytes"] or sha256_file(path) != manifest["sha256"]:
        scan.fail("structure", f"file content does not match its manifest sha256/size ({size} vs {manifest['bytes']} bytes): corrupt or truncated")
        return scan
    scan.bytes = size
    sample_ids = list(manifest["sample_ids"])
    expected_keys = {f"{sid}/{k}" for sid in sample_ids for k in ("hidden_states", "input_ids", "loss_mask")}
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for a bad header
        scan.fail("structure", f"unreadable safetensors file: {e}")
        return scan
    with handle as f:
        keys = set(f.keys())
        if keys != expected_keys:
            extra, missing = sorted(keys - expected_keys), sorted(expected_keys - keys)
            scan.fail(
                "structure",
                f"key set differs from manifest: {len(keys)} tensors, expected {len(expected_keys)} "
                f"(3 per sample); unexpected {extra[:5]}, missing {missing[:5]}",
            )
            return scan
        scan.read_ok = True
        scan_samples(scan, f, sample_ids, ctx)
    return scan


def scan_samples(scan: ShardScan, f, sample_ids: list[int], ctx: ScanContext) -> None:
    num_layers = len(ctx.layer_ids)
    sums = torch.zeros(num_layers, 4, dtype=torch.float64)  # sum, sum of squares, abs max, count
    final_states, next_ids = [], []
    in_shard: set[int] = set()
    for sid in sample_ids:
        if sid in in_shard:
            scan.fail("structure", "duplicate sample id within the shard's manifest", sample=sid)
            continue
        in_shard.add(sid)
        scan.sample_ids.append(sid)
        if not 0 <= sid < len(ctx.prepared):
            scan.fail("structure", f"sample id not in the prepared dataset (0..{len(ctx.prepared) - 1})", sample=sid)
            continue
        hs = f.get_tensor(f"{sid}/hidden_states")
        ids = f.get_tensor(f"{sid}/input_ids")
        mask = f.get_tensor(f"{sid}/loss_mask")
        if not check_sample_structure(scan, sid, hs, ids, mask, ctx):
            continue
        hsf = hs.to(ctx.reference.device).float()  # the reductions run on the GPU when there is one
        layer_max = hsf.amax(dim=(0, 2))
        layer_min = hsf.amin(dim=(0, 2))
        abs_max = torch.maximum(layer_max, -layer_min)
        # NaN propagates through amax/amin and Inf shows in abs_max: one check covers both, and the
        # per-layer detail is only computed for a sample that fails it
        constant = hsf.shape[0] * hsf.shape[2] > 1 and bool((layer_max == layer_min).any())
        if not bool(torch.isfinite(abs_max).all()) or constant:
            report_bad_values(scan, sid, hs, ctx.layer_ids)
            continue
        sums[:, 0] += hsf.sum(dim=(0, 2), dtype=torch.float64).cpu()
        sums[:, 1] += hsf.square().sum(dim=(0, 2), dtype=torch.float64).cpu()
        sums[:, 2] = torch.maximum(sums[:, 2], abs_max.double().cpu())
        sums[:, 3] += hsf.shape[0] * hsf.shape[2]
        scan.tokens += ids.numel()
        positions = mask[:-1].bool().nonzero().squeeze(-1)
        if positions.numel():
            final_states.append(hs[positions, -1])
            next_ids.append(ids[positions + 1])
    if final_states:  # one lm_head pass for the shard
        pred = ctx.reference.final_logits(torch.cat(final_states)).argmax(-1).cpu()
        targets = torch.cat(next_ids)
        scan.hits, scan.counted = int((pred == targets).sum()), int(targets.numel())
    count = sums[:, 3].clamp_min(1)
    mean = sums[:, 0] / count
    rms = (sums[:, 1] / count).sqrt()
    scan.stats = {
        str(lid): {
            "mean": mean[i].item(),
            "std": (rms[i] ** 2 - mean[i] ** 2).clamp_min(0).sqrt().item(),
            "abs_max": sums[i, 2].item(),
            "rms": rms[i].item(),
        }
        for i, lid in enumerate(ctx.layer_ids)
    }


def check_sample_structure(scan: ShardScan, sid: int, hs, ids, mask, ctx: ScanContext) -> bool:
    row = ctx.prepared[sid]
    want_ids, want_mask = row["input_ids"], row["loss_mask"]
    T, L, H = len(want_ids), len(ctx.layer_ids), ctx.hidden_size
    if hs.dim() != 3 or tuple(hs.shape) != (T, L, H):
        scan.fail("structure", f"hidden_states shape {list(hs.shape)}, expected [T={T}, L={L}, H={H}]", sample=sid)
        return False
    ok = True
    if hs.dtype != ctx.dtype:
        scan.fail("structure", f"hidden_states dtype {hs.dtype}, the run declares {ctx.dtype}", sample=sid)
        ok = False
    if ids.shape != want_ids.shape or not torch.equal(ids.long(), want_ids.long()):
        scan.fail("structure", "input_ids differ from the prepared dataset's", sample=sid)
        ok = False
    if mask.shape != want_mask.shape or not torch.equal(mask.long(), want_mask.long()):
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
