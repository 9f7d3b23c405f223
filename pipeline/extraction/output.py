"""Where an extraction goes: free space checked first, other runs' shards cleared, a full disk named."""

from __future__ import annotations

import errno
from pathlib import Path

from pipeline.atomic import remove_stale_temps
from pipeline.errors import PipelineError
from pipeline.extraction import capacity
from pipeline.extraction.inputs import ShardPlan, log
from pipeline.hidden_states import format as shards
from pipeline.params import ExtractParams
from pipeline.target import Target


def check_free_space(out: Path, params: ExtractParams, target: Target, layer_ids: list[int], plan: ShardPlan,
                     seq_lens, run_key: str) -> None:
    """Refuse, before the output is touched or the engine loads, when the shards still to write (and
    vLLM's scratch files) do not fit the output's filesystem with extract.free_space_margin."""
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
