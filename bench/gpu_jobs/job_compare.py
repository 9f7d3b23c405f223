"""bench step compare: a run's shards against its base run's, sample by sample."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_jobs.common import device, log


def _shard_index(hs_dir: Path) -> tuple[dict[int, Path], dict[str, str]]:
    """sample id -> shard file, and shard file name -> its sha256 (from the manifests)."""
    from pipeline.hidden_states import format as shards

    where, digests = {}, {}
    for p in shards.complete_shards(hs_dir):
        m = shards.read_manifest(p)
        digests[p.name] = m.get("sha256")
        for sid in m["sample_ids"]:
            where[int(sid)] = p
    return where, digests


def job_compare(state: dict, name: str) -> dict:
    """Run `name`'s shards against its base run's (RUNS), sample by sample: token ids and loss masks
    exactly equal; per layer the relative RMS error ||h - h_base|| / ||h_base|| over every position
    of every sample, and the cosine per position (mean / min); which shards are byte-identical."""
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open

    from pipeline import layout
    from pipeline.hidden_states import format as shards

    base = state[f"base_{name}"]
    dirs = {r: Path(state[f"project_{r}"]) / layout.HIDDEN_STATES_DIR for r in (name, base)}
    (mine, my_sha), (ref, ref_sha) = _shard_index(dirs[name]), _shard_index(dirs[base])
    layer_ids = shards.read_meta(dirs[name])["layer_ids"]
    dev = device()
    n_layers = len(layer_ids)
    diff2 = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    ref2 = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    cos_sum = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    cos_min = torch.full((n_layers,), 2.0, dtype=torch.float64, device=dev)
    max_abs = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    exact = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    worst_rel = torch.zeros(n_layers, dtype=torch.float64, device=dev)
    positions = elements = 0
    ids_equal = masks_equal = 0
    missing = sorted(set(ref) ^ set(mine))
    opened: dict[str, tuple] = {}  # run -> (shard path, safe_open handle): shards are read in sample order

    def tensors(run: str, path: Path, sid: int) -> dict:
        if opened.get(run, (None,))[0] != path:
            opened[run] = (path, safe_open(str(path), framework="pt", device="cuda:0" if dev == "cuda" else "cpu"))
        f = opened[run][1]
        return {k: f.get_tensor(f"{sid}/{k}") for k in ("hidden_states", "input_ids", "loss_mask")}

    t = time.monotonic()
    common = sorted(set(ref) & set(mine))
    for sid in common:
        a, b = tensors(name, mine[sid], sid), tensors(base, ref[sid], sid)
        ids_equal += int(torch.equal(a["input_ids"], b["input_ids"]))
        masks_equal += int(torch.equal(a["loss_mask"], b["loss_mask"]))
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()  # [T, L, H]
        d = ha - hb
        per_d2 = d.pow(2).sum(dim=(0, 2)).double()
        per_r2 = hb.pow(2).sum(dim=(0, 2)).double()
        diff2 += per_d2
        ref2 += per_r2
        worst_rel = torch.maximum(worst_rel, (per_d2 / per_r2.clamp_min(1e-30)).sqrt())
        cos = F.cosine_similarity(ha, hb, dim=-1).double().clamp(max=1.0)  # [T, L]; fp32 rounding can pass 1
        cos_sum += cos.sum(dim=0)
        cos_min = torch.minimum(cos_min, cos.min(dim=0).values)
        max_abs = torch.maximum(max_abs, d.abs().amax(dim=(0, 2)).double())
        exact += (d == 0).sum(dim=(0, 2)).double()
        positions += ha.shape[0]
        elements += ha.shape[0] * ha.shape[2]
    seconds = time.monotonic() - t
    same_bytes = sorted(n for n, h in my_sha.items() if h is not None and ref_sha.get(n) == h)
    layers = {
        str(lid): {
            "rel_rms_error": float((diff2[i] / ref2[i].clamp_min(1e-30)).sqrt()),
            "rel_rms_error_worst_sample": float(worst_rel[i]),
            "cos_mean": float(cos_sum[i] / max(positions, 1)),
            "cos_min": float(cos_min[i]),
            "max_abs_error": float(max_abs[i]),
            "exactly_equal_share": float(exact[i] / max(elements, 1)),
        }
        for i, lid in enumerate(layer_ids)
    }
    summary = {
        "vs": base,
        "samples": len(common),
        "samples_missing_in_one": missing[:20],
        "token_ids_equal": ids_equal == len(common) and not missing,
        "token_ids_equal_samples": ids_equal,
        "loss_masks_equal": masks_equal == len(common) and not missing,
        "positions": positions,
        "shards": len(my_sha),
        "shards_byte_identical": len(same_bytes),
        "all_byte_identical": len(same_bytes) == len(my_sha) == len(ref_sha) and len(my_sha) > 0,
        "layers": layers,
        "compare_s": round(seconds, 2),
        "device": dev,
    }
    log(f"compare {name} vs {base}: {json.dumps(summary)}")
    return {"summary": summary}
