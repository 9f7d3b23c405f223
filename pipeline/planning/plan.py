"""`python -m pipeline plan`: what an extraction will write, whether it fits, how long it takes, what it holds.

`python -m pipeline plan` (`make plan`) projects, before any GPU time is spent:

- **bytes** the extract stage will write: tokens x captured layers x hidden size x dtype size,
  plus 9 bytes per token of ids and loss mask (docs/FORMAT.md), plus the format's overhead
  (safetensors header entries, manifests) *measured* on a real shard: one in
  artifacts/hidden_states if there is one, else a few-sample shard written with the real writer;
- the **free space** on the output's filesystem, and whether the projection fits it with
  `extract.free_space_margin` (the extract stage refuses to start when it does not: `disk_need`);
- the **wall time** at the tokens/s of the last extraction on this machine (metrics/extract.json),
  else of a short calibration run of `plan.calibration_samples` samples (the real engine); at an
  engine rate given with `--tok-per-s`, the longer of the compute and the shard writes at
  `plan.write_gb_per_s`, plus the last shard's write (pipeline/planning/extract_time.py);
- the **memory** the engine takes: weights (the checkpoint's size) + KV cache, on the GPU at
  `extract.gpu_memory_utilization` of each GPU's memory, on CPU weights + `extract.cpu_kvcache_gib`.

Token counts come from the prepared dataset (exact, this rank's shards only); `--tokens` and the
shape options project a model and dataset that are not here (docs/PLANNING.md: a Kimi-K2.5-shaped example).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.extraction.capacity import (
    DTYPE_BYTES,
    IDS_MASK_BYTES,
    DiskNeed,
    Projection,
    disk_need,
    existing_work,
    human_bytes,
    human_seconds,
    measure_overhead,
)
from pipeline.hidden_states.storage import engine_dtype
from pipeline.layout import HIDDEN_STATES_DIR, METRICS, REPORTS
from pipeline.planning.extract_time import ExtractionTime, extraction_time, largest_shard
from pipeline.planning.reference import ReferenceProjection, add_rows, project_reference

CALIBRATION_FILE = METRICS / "plan_calibration.json"
PLAN_JSON = REPORTS / "plan.json"



# --- wall time -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    tok_per_s: float
    startup_s: float | None
    source: str
    includes_writes: bool = True  # measured until the last shard was written; False: an engine rate (--tok-per-s)


def measured_throughput(layer_ids: list[int], dtype: str) -> Throughput | None:
    """tok/s of the last extraction on this machine (metrics/extract.json), else of the last calibration."""
    host = socket.gethostname()
    for path, what in ((METRICS / "extract.json", "the last extraction"), (CALIBRATION_FILE, "the last calibration run")):
        if not path.is_file():
            continue
        m = json.loads(path.read_text())
        if not m.get("tok_per_s") or m.get("host", host) != host:
            continue
        note = ""
        if m.get("layer_ids") not in (None, layer_ids) or m.get("dtype") not in (None, dtype):
            note = f", layers {m.get('layer_ids')} {m.get('dtype')}"
        return Throughput(float(m["tok_per_s"]), m.get("engine_load_s"), f"{what} here ({path}{note})")
    return None


def calibrate(params, samples: int) -> Throughput:
    """A real, short extraction of the first `samples` prepared samples into a temporary directory."""
    import time

    from pipeline.atomic import atomic_write_text
    from pipeline.extraction.engine import extract_shards
    from pipeline.extraction.inputs import open_prepared, plan_shards
    from pipeline.hidden_states import format as shards
    from pipeline.params import resolve_layer_ids
    from pipeline.target import load_target

    ext = params.extract
    target = load_target()
    layer_ids = resolve_layer_ids(ext.layer_ids, target.num_layers)
    ds, seq_lens = open_prepared()
    n = min(samples, len(ds))
    plan = plan_shards(n, n, 0, 1)
    out = Path(tempfile.mkdtemp(prefix=".plan-calibration-", dir=HIDDEN_STATES_DIR.parent))
    common = {"layer_ids": layer_ids, "layer_id_convention": shards.LAYER_ID_CONVENTION, "dtype": ext.dtype,
              "hidden_size": target.hidden_size, "model_fingerprint": target.fingerprint["sha256"],
              "run_key": "plan-calibration", "vllm_version": "", "rank": 0}
    t0 = time.monotonic()
    try:
        prog = extract_shards(ext, target, layer_ids, int(max(seq_lens[:n])) + 1, ds, plan, [0], out, common)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {"tok_per_s": round(prog.tokens / prog.seconds, 1), "engine_load_s": round(prog.load_seconds, 2),
              "samples": prog.samples, "tokens": prog.tokens, "wall_s": round(time.monotonic() - t0, 2),
              "layer_ids": layer_ids, "dtype": ext.dtype, "host": socket.gethostname()}
    CALIBRATION_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(CALIBRATION_FILE, json.dumps(result, indent=1) + "\n")
    return Throughput(result["tok_per_s"], result["engine_load_s"], f"a calibration run of {n} samples just now ({CALIBRATION_FILE})")


# --- memory --------------------------------------------------------------------------------------


def gpu_memory_bytes() -> list[int]:
    """Total memory of each NVIDIA GPU here (nvidia-smi), [] when there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [int(float(x)) * 2**20 for x in out.split() if x.strip()]


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int | None:
    """KV-cache bytes per token over all layers: MLA (kv_lora_rank) or grouped-query attention."""
    layers = cfg.get("num_hidden_layers")
    if not layers:
        return None
    if cfg.get("kv_lora_rank"):
        return layers * (cfg["kv_lora_rank"] + cfg.get("qk_rope_head_dim", 0)) * dtype_bytes
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    if not (kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass
class Memory:
    device: str
    weights: int | None
    per_device_total: int | None
    per_device_budget: int | None
    kv_cache: int | None
    kv_tokens: int | None
    notes: list[str] = field(default_factory=list)


def memory(cfg: dict, weights: int | None, ext, gpus: list[int], gpus_here: bool = True) -> Memory:
    dtype_bytes = DTYPE_BYTES[engine_dtype(ext.dtype)]  # the engine's dtype (fp8 is only how states are stored)
    kv_tok = kv_bytes_per_token(cfg, dtype_bytes)
    n = ext.tensor_parallel_size * ext.pipeline_parallel_size
    if not gpus:
        kv = ext.cpu_kvcache_gib * 2**30
        return Memory("CPU (no NVIDIA GPU here)", weights, None, None, kv, kv // kv_tok if kv_tok else None,
                      [f"RAM: the weights + extract.cpu_kvcache_gib ({ext.cpu_kvcache_gib} GiB) of KV cache"])
    total = min(gpus)
    budget = int(total * ext.gpu_memory_utilization)
    share = weights // n if weights is not None else None
    notes = [f"vLLM takes extract.gpu_memory_utilization ({ext.gpu_memory_utilization}) of each of {n} GPU(s) "
             f"(tensor x pipeline parallel)" + (f"; {len(gpus)} here" if gpus_here else "")]
    if gpus_here and n > len(gpus):
        notes.append(f"extract wants {n} GPUs but this machine has {len(gpus)}")
    kv = kv_tokens = None
    if share is not None:
        kv = budget - share
        notes.append("KV cache = budget - weights share; vLLM also keeps the activation peak it measures at start-up "
                     "(typically a few GiB), so the real KV cache is somewhat smaller")
        if kv <= 0:
            notes.append(f"the weights share ({human_bytes(share)} per GPU) does not fit the budget: raise "
                         "extract.tensor_parallel_size / pipeline_parallel_size or gpu_memory_utilization")
        elif kv_tok:
            # tensor parallelism splits GQA's KV heads over the GPUs but replicates MLA's latent cache;
            # pipeline parallelism splits the layers either way
            kv_tokens = kv * (ext.pipeline_parallel_size if cfg.get("kv_lora_rank") else n) // kv_tok
    return Memory(f"{n} x GPU of {human_bytes(total)}", weights, total, budget, kv, kv_tokens, notes)


# --- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    model: str
    projection: Projection
    layer_ids: list[int]
    need: DiskNeed
    throughput: Throughput | None
    memory: Memory
    notes: list[str]
    todo_tokens: int  # tokens of the shards not extracted yet (all of them unless a run is resumed)
    reference: ReferenceProjection | None = None  # verify's reference forward at this scale
    largest_shard_bytes: int = 0  # of the shards still to write: the drain after the last request
    write_gb_per_s: float = 1.0  # plan.write_gb_per_s

    @property
    def time(self) -> ExtractionTime | None:
        if not self.throughput:
            return None
        tp = self.throughput
        return extraction_time(self.todo_tokens, tp.tok_per_s, tp.includes_writes, self.need.shard_bytes,
                               self.largest_shard_bytes, self.write_gb_per_s, tp.startup_s)

    @property
    def seconds(self) -> float | None:
        if not self.throughput:
            return None
        if not self.todo_tokens:
            return 0.0  # the stage finds every shard done and starts no engine
        return self.time.seconds

    def to_json(self) -> dict:
        d = asdict(self)
        d["projection"]["bytes"] = self.projection.bytes
        d["projection"]["bytes_per_token"] = self.projection.bytes_per_token
        d["need"].update(required=self.need.required, available=self.need.available, fits=self.need.fits)
        d["seconds"] = self.seconds
        t = self.time
        d["time"] = None if t is None else {"compute_s": t.compute_s, "write_s": t.write_s, "drain_s": t.drain_s,
                                            "startup_s": t.startup_s, "write_bytes_per_s": t.write_bytes_per_s, "bound": t.bound}
        return d


def weights_bytes(target) -> int | None:
    sizes = target.fingerprint.get("weights", {})
    if sizes:
        return sum(sizes.values())
    if target.path.is_dir():
        return sum(p.stat().st_size for p in target.path.iterdir() if p.suffix == ".safetensors") or None
    return None


def build_plan(params, *, tokens: float | None = None, samples: int | None = None, config: dict | None = None,
               hidden_size: int | None = None, num_layers: int | None = None, layer_ids: list[int] | None = None,
               dtype: str | None = None, weights_gib: float | None = None, tok_per_s: float | None = None,
               out: Path = HIDDEN_STATES_DIR, do_calibrate: bool | None = None, gpus: list[int] | None = None,
               tensor_parallel_size: int | None = None) -> Plan:
    """The projection for params.yaml's project, with any shape or size given as options overriding it.

    Without overrides everything comes from the project: artifacts/model/target.json (config,
    weight sizes), the prepared dataset (exact token counts) and the extract section."""
    from pipeline.params import resolve_layer_ids

    ext = params.extract
    if dtype:
        ext = ext.model_copy(update={"dtype": dtype})
    if tensor_parallel_size:
        ext = ext.model_copy(update={"tensor_parallel_size": tensor_parallel_size})
    hypothetical = tokens is not None or config is not None or hidden_size is not None
    notes: list[str] = []
    target = None
    cfg: dict = dict(config or {})
    model = "config given on the command line" if config else "shape given on the command line"
    if not (config or hidden_size):
        from pipeline.target import load_target

        try:
            target = load_target()
        except PipelineError as e:
            raise PipelineError(f"{e}\n(or project a model that is not here: --hidden-size, --num-layers or --config, with --tokens)") from None
        tc = target.config
        cfg = tc.get("text_config", tc)
        model = f"{target.path}" + (" (embedded)" if target.embedded else "")
    if hidden_size:
        cfg["hidden_size"] = hidden_size
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    if "hidden_size" not in cfg or "num_hidden_layers" not in cfg:
        raise PipelineError("the model config needs hidden_size and num_hidden_layers (or pass --hidden-size and --num-layers)")
    ids = resolve_layer_ids(layer_ids if layer_ids is not None else ext.layer_ids, int(cfg["num_hidden_layers"]))

    # tokens and samples: this rank's shards of the prepared dataset, or the options
    seq_lens = None
    if tokens is None:
        from pipeline.extraction.inputs import open_prepared, plan_shards

        ds, seq_lens = open_prepared()
        sp = plan_shards(len(ds), ext.samples_per_shard, ext.rank, ext.world_size)
        mine = [i for k in sp.shards for i in range(*sp.bounds(k))]
        tokens, samples = int(seq_lens[mine].sum()) if mine else 0, len(mine)
        if ext.world_size > 1:
            notes.append(f"rank {ext.rank} of {ext.world_size}: {len(sp.shards)} of the shards")
    elif samples is None:
        per_sample = params.data.seq_len
        samples = max(1, int(tokens // per_sample))
        notes.append(f"{samples:,} samples assumed: --tokens / data.seq_len ({per_sample}); pass --samples to change")
    tokens = int(tokens)

    overhead = measure_overhead(None if hypothetical else out, len(ids), int(cfg["hidden_size"]), ext.dtype, ext.samples_per_shard)
    proj = Projection(samples, tokens, len(ids), int(cfg["hidden_size"]), ext.dtype, overhead)
    if hypothetical:
        kept, kept_bytes, reclaimed = set(), 0, 0
    else:
        from pipeline.extraction.inputs import dataset_hash, run_key_fields
        from pipeline.target import sha256_json

        run_key = sha256_json(run_key_fields(target, dataset_hash(), ids, ext))
        kept, kept_bytes, reclaimed = existing_work(out, run_key)
    todo_tokens, todo_samples = tokens, samples
    if seq_lens is not None:  # the prepared dataset: each shard still to write, as the stage cuts them
        from pipeline.extraction.inputs import plan_shards

        sp = plan_shards(len(seq_lens), ext.samples_per_shard, ext.rank, ext.world_size)
        todo_shards = [range(*sp.bounds(k)) for k in sp.shards if k not in kept]
        shard_tokens = [int(seq_lens[r.start:r.stop].sum()) for r in todo_shards]
        shard_samples = [len(r) for r in todo_shards]
    else:  # --tokens: samples of the mean length, samples_per_shard to a shard
        per_shard = min(samples, ext.samples_per_shard)
        shard_tokens, shard_samples = [tokens * per_shard // max(samples, 1)], [per_shard]
    if kept:
        done = [i for k in kept for i in range(*sp.bounds(k))]
        todo_tokens -= int(seq_lens[done].sum())
        todo_samples -= len(done)
        notes.append(f"{len(kept)} shards of this run already extracted ({human_bytes(kept_bytes)}): only the rest is projected as new")
    need = disk_need(out, proj, todo_tokens, todo_samples, kept_bytes, reclaimed, ext.samples_per_shard,
                     ext.max_num_batched_tokens, ext.free_space_margin)

    # wall time
    tp = None
    if tok_per_s:
        tp = Throughput(tok_per_s, None, "--tok-per-s (given: the engine's rate; the plan adds the shard writes)", includes_writes=False)
    elif not hypothetical:
        tp = measured_throughput(ids, ext.dtype)
        if tp is None and do_calibrate is not False:
            tp = calibrate(params, params.plan.calibration_samples)
        elif tp is not None and do_calibrate:
            tp = calibrate(params, params.plan.calibration_samples)
    if tp is None:
        notes.append("wall time unknown: pass --tok-per-s (e.g. from an extraction of a similar model on the same hardware)")

    weights = int(weights_gib * 2**30) if weights_gib is not None else (weights_bytes(target) if target else None)
    gpu_list = gpu_memory_bytes() if gpus is None else gpus
    mem = memory(cfg, weights, ext, gpu_list, gpus_here=gpus is None)
    if weights is None:
        mem.notes.append("weights unknown: pass --weights-gib (the checkpoint's size on disk)")
    reference = project_reference(cfg, params.verify, engine_dtype(ext.dtype), params.data.seq_len, gpu_list)
    biggest = largest_shard(shard_tokens, shard_samples, proj.bytes_per_token, overhead.per_sample)
    return Plan(model, proj, ids, need, tp, mem, notes, todo_tokens, reference, biggest, params.plan.write_gb_per_s)


def render(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    p, need, mem = plan.projection, plan.need, plan.memory
    t = Table(title=f"extraction plan: {plan.model}", show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_column("how", overflow="fold")
    t.add_row("samples / tokens", f"{p.samples:,} / {p.tokens:,}", "")
    t.add_row("layers captured", str(plan.layer_ids), f"hidden {p.hidden_size}, {p.dtype} ({DTYPE_BYTES[p.dtype]} B)")
    scales = f" + {p.num_layers} x 4 (fp32 scales)" if p.dtype == "float8_e4m3" else ""
    t.add_row("bytes per token", f"{p.bytes_per_token:,}", f"{p.num_layers} x {p.hidden_size} x {DTYPE_BYTES[p.dtype]}{scales} + {IDS_MASK_BYTES} (ids, mask)")
    t.add_row("format overhead", f"{p.overhead.per_sample:,.0f} B/sample", p.overhead.source)
    t.add_row("[bold]extraction writes", f"[bold]{human_bytes(p.bytes)}", f"{p.bytes:,} bytes")
    if need.kept_bytes or need.reclaimed_bytes:
        t.add_row("already there", human_bytes(need.kept_bytes), f"kept; {human_bytes(need.reclaimed_bytes)} of another run deleted first")
    t.add_row("scratch peak (bound)", human_bytes(need.scratch_bytes), "vLLM's per-request files until their shard is written")
    t.add_row("needed with margin", human_bytes(need.required), f"(new shards + scratch) x {1 + need.margin:g} (extract.free_space_margin)")
    t.add_row("free space", human_bytes(need.available), need.filesystem)
    t.add_row("[bold]fits", "[bold green]yes" if need.fits else "[bold red]NO", "" if need.fits else "the extract stage will refuse to start")
    if plan.throughput:
        t.add_row("throughput", f"{plan.throughput.tok_per_s:,.0f} tok/s", plan.throughput.source)
        todo = "tokens" if plan.todo_tokens == p.tokens else f"{plan.todo_tokens:,} tokens still to extract"
        how = plan.time.how(todo) if plan.todo_tokens else "every shard is already written"
        t.add_row("[bold]wall time", f"[bold]{human_seconds(plan.seconds)}", how)
    else:
        t.add_row("wall time", "unknown", "")
    t.add_row("engine on", mem.device, "")
    t.add_row("weights", human_bytes(mem.weights) if mem.weights is not None else "unknown", "checkpoint size on disk")
    if mem.per_device_budget is not None:
        t.add_row("GPU memory taken", f"{human_bytes(mem.per_device_budget)} per GPU", "estimate: utilization x GPU memory")
    if mem.kv_cache is not None:
        kv = human_bytes(mem.kv_cache) + (" per GPU" if mem.per_device_budget is not None else "")
        t.add_row("KV cache", kv, f"~{mem.kv_tokens:,} tokens (estimate)" if mem.kv_tokens else "estimate")
    add_rows(t, plan.reference)
    console = Console()
    console.print(t)
    for note in plan.notes + mem.notes:
        console.print(f"- {note}")
