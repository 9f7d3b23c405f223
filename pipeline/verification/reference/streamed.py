"""verify's reference forward streamed from the checkpoint one unit at a time, its memory bounded by
`verify.reference_memory_gib` whatever the target's size; and the choice between it and the whole model.

Units, in order (pipeline/verification/reference/cost.py): the embedding; per decoder layer its dense part, then its routed
experts in chunks sized to the budget (all at once where they fit); the final norm + lm_head. Each
unit's tensors are read by name (INT4 pack-quantized ones dequantized, per-expert ones stacked into
transformers' fused expert tensors) into the target's own transformers modules, built from its config
on the meta device, applied to every reference sample, then dropped. A background thread reads the
next unit while the current one computes; every tensor is read once. The fp32 run and, for a
low-precision capture, the run in the capture's dtype advance together on the same read. All N+1
states per sample are kept on the host (the layer-identity check compares against each), in vLLM's
convention (pipeline/verification/reference/model.py). A layer whose experts are chunked runs twice: once recording what its
experts module is called with, once with the chunks' summed outputs in its place.
"""

from __future__ import annotations

import copy
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import int4
from pipeline.errors import PipelineError
from pipeline.hidden_states.format import read_header
from pipeline.verification.reference.cost import (
    BUDGET_PARAM,
    GIB,
    LayerCost,
    ModelCost,
    Unit,
    stream_plan,
    whole_model_bytes,
)
from pipeline.verification.reference.model import (
    DTYPES,
    FinalHeadModel,
    FinalLogits,
    References,
    checkpoint_float_elements,
    tensor_locations,
)

FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # transformers' fused -> per-expert names


def sequence_key(ids: torch.Tensor) -> bytes:
    return ids.to(torch.int64).cpu().numpy().tobytes()


@dataclass
class StreamedStates(FinalLogits):
    """One run's states of the reference samples, as ReferenceModel gives them (`states(ids)` on
    `device`, `final_norm`, `final_logits`), computed in the stream."""

    by_sequence: dict[bytes, torch.Tensor]
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    dtype: torch.dtype
    device: torch.device

    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.by_sequence[sequence_key(input_ids)].to(self.device)


class Checkpoint:
    """A safetensors checkpoint read by tensor name, every read counted (each tensor is read once)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        self.scheme = int4.scheme_of(self.config)
        self.locations = tensor_locations(self.path)
        self.nbytes: dict[str, int] = {}
        for file in set(self.locations.values()):
            for name, entry in read_header(file)[0].items():
                begin, end = entry["data_offsets"]
                self.nbytes[name] = end - begin
        self.bytes_read = 0
        self.seconds_reading = 0.0

    def sources(self, name: str) -> list[str]:
        """The stored tensors a model tensor is made of: itself, or a quantized Linear's packed triple."""
        if name in self.locations:
            return [name]
        packed = int4.packed_names(name.removesuffix(".weight"), self.locations) if name.endswith(".weight") else []
        if not packed:
            raise PipelineError(f"{name} is not in the checkpoint at {self.path}: the streamed reference cannot build this target")
        return packed

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        started = time.perf_counter()
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.locations[name], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out |= {name: f.get_tensor(name) for name in group}
        self.bytes_read += sum(self.nbytes[n] for n in names)
        self.seconds_reading += time.perf_counter() - started
        return out

    def weight(self, name: str, raw: dict[str, torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """A model tensor from the read tensors; a quantized one dequantized on `device` (default: where it
        was read): on a GPU, a seed-shape layer's 1152 expert Linears take seconds, not minutes on the host."""
        if name in raw:
            return raw[name]
        prefix = name.removesuffix(".weight")
        packed = {n: raw[n] if device is None or n.endswith(".weight_shape") else raw[n].to(device)
                  for n in (prefix + s for s in int4.PACKED_SUFFIXES) if n in raw}
        return int4.dequantize(prefix, packed, self.scheme)

    def unit(self, names: list[str], elements: int) -> Unit:
        return Unit(elements, sum(self.nbytes[s] for n in names for s in self.sources(n)))


class Skeleton:
    """The target's transformers model on the meta device, and where each tensor comes from."""

    def __init__(self, ckpt: Checkpoint, trust_remote_code: bool):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(ckpt.path), trust_remote_code=trust_remote_code)
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config  # float modules: INT4 weights are dequantized into them
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
        self.config, self.ckpt = config, ckpt
        self.layers = self.model.model.layers
        self.layers_prefix = next(n for n, m in self.model.named_modules() if m is self.layers)
        keep = set(getattr(self.model, "_keep_in_fp32_modules_strict", None) or ())
        self.keep_fp32 = keep
        self.names_of: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            self.names_of.setdefault(id(p), []).append(name)

    def stored_name(self, tensor: torch.Tensor) -> str:
        """The checkpoint's name for a model tensor (a tied lm_head's is the embedding's)."""
        names = self.names_of[id(tensor)]
        for n in names:
            if n in self.ckpt.locations or (n.endswith(".weight") and int4.packed_names(n.removesuffix(".weight"), self.ckpt.locations)):
                return n
        raise PipelineError(f"none of {names} is in the checkpoint at {self.ckpt.path}")

    def experts(self, layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """A layer's routed-expert modules in transformers' fused layout ([E, 2I, H] gate_up, [E, H, I] down)."""
        found = {}
        for local, m in layer.named_modules():
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and hasattr(m, "num_experts"):
                if getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True) or getattr(m, "has_bias", False):
                    raise PipelineError(f"{type(m).__name__}: an expert layout the streamed reference does not read")
                found[local] = m
        return found

    def expert_names(self, prefix: str, expert: int) -> list[str]:
        return [f"{prefix}.{expert}.{part}.weight" for parts in FUSED.values() for part in parts]

    def dense_names(self, index: int) -> tuple[dict[str, str], list[str]]:
        """Layer `index`'s dense part: local name -> stored name, and the stored tensors to read."""
        layer, prefix = self.layers[index], f"{self.layers_prefix}.{index}"
        skip = tuple(f"{e}." for e in self.experts(layer))
        local = {k: f"{prefix}.{k}" for k in layer.state_dict(keep_vars=True) if not k.startswith(skip)}
        return local, [s for n in local.values() for s in self.ckpt.sources(n)]

    def cost(self) -> ModelCost:
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings().weight
        layers = []
        for i, layer in enumerate(self.layers):
            local, _ = self.dense_names(i)
            sd = layer.state_dict(keep_vars=True)
            dense = self.ckpt.unit(list(local.values()), sum(sd[k].numel() for k in local))
            experts = self.experts(layer)
            if not experts:
                layers.append(LayerCost(dense))
                continue
            (name, m), = experts.items()
            prefix = f"{self.layers_prefix}.{i}.{name}"
            one = self.ckpt.unit(self.expert_names(prefix, 0), sum(p[0].numel() for p in m.parameters()))
            layers.append(LayerCost(dense, m.num_experts, one))
        c = self.config.get_text_config()
        inter = max(getattr(c, "intermediate_size", 0) or 0, getattr(c, "moe_intermediate_size", 0) or 0)
        return ModelCost(self.ckpt.unit([self.stored_name(embed)], embed.numel()), self.ckpt.unit([self.stored_name(head)], head.numel()),
                         layers, c.hidden_size, inter, c.num_attention_heads)

    def tensor_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if any(k in name.split(".") for k in self.keep_fp32) else dtype


@dataclass
class Choice:
    streamed: bool
    why: str
    budget_bytes: int
    cost: ModelCost | None = None
    max_tokens: int = 0
    on_gpu: bool = False  # the budget is of a GPU's memory (the checkpoint's bytes as read stay on the host)


def device_free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def choose_reference(path: Path, captured_dtype: str, memory_gib: float | None, max_tokens: int,
                     trust_remote_code: bool = False, device: str | None = None) -> Choice:
    """Whole model where it fits the budget and is float, else streamed; a budget the streamed
    reference cannot work in is an error here, before anything loads."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = int(memory_gib * GIB) if memory_gib is not None else int(0.9 * device_free_bytes(dev))
    given = f"{memory_gib} GiB" if memory_gib is not None else f"{budget / GIB:.3g} GiB (90% of free {dev.type} memory)"
    said = f"{BUDGET_PARAM} {given}"
    ckpt = None
    try:
        ckpt = Checkpoint(path)
        cost = Skeleton(ckpt, trust_remote_code).cost()
    except (AttributeError, KeyError, TypeError, ValueError, PipelineError) as e:
        # laid out otherwise (no model.layers, another expert layout or quantization): the whole model, as before
        if ckpt is not None and ckpt.scheme is not None:
            raise PipelineError(f"model.path: {path} is INT4, which only the streamed reference reads, and it cannot lay out this target: {e}") from None
        return Choice(False, f"the streamed reference cannot lay out this target ({type(e).__name__}: {e})", budget)
    on_gpu = dev.type == "cuda"
    plan = stream_plan(cost, budget, max_tokens, captured_dtype, given, on_gpu)  # raises on a budget too small
    whole = whole_model_bytes(cost, max_tokens, captured_dtype)
    if ckpt.scheme is not None:
        why = f"the checkpoint is INT4 ({ckpt.scheme.format}, group {ckpt.scheme.weights.group_size}): dequantized unit by unit"
        return Choice(True, why, budget, cost, max_tokens, on_gpu)
    if whole > budget:
        why = f"the whole model needs ~{whole / GIB:.3g} GiB, over the budget {said}; streamed peak ~{plan.peak_bytes / GIB:.3g} GiB"
        return Choice(True, why, budget, cost, max_tokens, on_gpu)
    return Choice(False, f"the whole model (~{whole / GIB:.3g} GiB) fits the budget {said}", budget, cost, max_tokens, on_gpu)


def shard_sequences(sample_ids: list[int], sample_to_shard: dict[int, Path]) -> list[torch.Tensor]:
    """The reference samples' token ids, read from their shards as the reference check reads them."""
    from safetensors import safe_open

    out = []
    for sid in sample_ids:
        with safe_open(str(sample_to_shard[sid]), framework="pt", device="cpu") as f:
            out.append(f.get_tensor(f"{sid}/input_ids"))
    return out


class Run:
    """One dtype's pass: each sample's current state on the host, every state kept."""

    def __init__(self, dtype: torch.dtype, sequences: list[torch.Tensor]):
        self.dtype = dtype
        self.kept: list[list[torch.Tensor]] = [[] for _ in sequences]


def stream_references(path: Path, captured_dtype: str, sequences: list[torch.Tensor], choice: Choice,
                      head: FinalHeadModel | None = None, trust_remote_code: bool = False, device: str | None = None) -> References:
    """Both runs of the reference over `sequences`, streamed; the same `References` the whole model gives."""
    started = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = Checkpoint(path)
    sk = Skeleton(ckpt, trust_remote_code)
    plan = stream_plan(choice.cost, choice.budget_bytes, choice.max_tokens, captured_dtype, on_gpu=choice.on_gpu)
    runs = [Run(torch.float32, sequences)] + ([] if captured_dtype == "float32" else [Run(DTYPES[captured_dtype], sequences)])
    with torch.device("cpu"):  # built as from_pretrained builds it: inv_freq computed in fp32
        rotary = type(sk.model.model.rotary_emb)(config=sk.config).to(dev)
    from transformers.masking_utils import create_causal_mask

    def apply(layer, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=dev)[None]
        mask = create_causal_mask(config=sk.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
        out = layer(h, attention_mask=mask, position_ids=pos, past_key_values=None, use_cache=False,
                    position_embeddings=rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out

    def build(module, local_to_stored: dict[str, str], raw, dtype):
        built = copy.deepcopy(module)
        state = {}
        for local, stored in local_to_stored.items():
            t = ckpt.weight(stored, raw)
            state[local] = t.to(dev, sk.tensor_dtype(stored, dtype))
        built.load_state_dict(state, strict=False, assign=True)
        return built.eval()

    def stacked(prefix: str, experts: range, raw, dtype) -> dict[str, torch.Tensor]:
        # filled expert by expert, dequantized on the device: one expert's transient beside the stack
        out = {}
        for fused, parts in FUSED.items():
            for k, e in enumerate(experts):
                one = torch.cat([ckpt.weight(f"{prefix}.{e}.{p}.weight", raw, dev).to(dev) for p in parts])
                if k == 0:
                    out[fused] = torch.empty((len(experts), *one.shape), dtype=dtype, device=dev)
                out[fused][k] = one
        return out

    # the work, as (what to read, what to do with it) in order; reads run one ahead in a thread
    steps: list[tuple[list[str], object]] = []
    embed = sk.model.get_input_embeddings()
    embed_name = sk.stored_name(embed.weight)

    def do_embed(raw):
        for run in runs:
            module = build(embed, {"weight": embed_name}, raw, run.dtype)
            for i, ids in enumerate(sequences):
                run.kept[i].append(module(ids.to(dev))[None].cpu())

    steps.append(([embed_name], do_embed))
    for index, layer in enumerate(sk.layers):
        local, dense_reads = sk.dense_names(index)
        experts = sk.experts(layer)
        chunk = plan.experts_per_chunk[index]
        prefix = {name: f"{sk.layers_prefix}.{index}.{name}" for name in experts}
        whole = not experts or chunk >= max(m.num_experts for m in experts.values())
        if whole:
            reads = dense_reads + [s for n, m in experts.items() for e in range(m.num_experts)
                                   for x in sk.expert_names(prefix[n], e) for s in ckpt.sources(x)]
            steps.append((reads, LayerStep(index, layer, local, experts, prefix, runs, build, stacked, apply).whole))
            continue
        step = LayerStep(index, layer, local, experts, prefix, runs, build, stacked, apply)
        steps.append((dense_reads, step.record))
        (name, m), = experts.items()
        for first in range(0, m.num_experts, chunk):
            part = range(first, min(first + chunk, m.num_experts))
            reads = [s for e in part for x in sk.expert_names(prefix[name], e) for s in ckpt.sources(x)]
            steps.append((reads, lambda raw, step=step, part=part: step.chunk(raw, part)))
        steps.append(([], step.finish))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-prefetch") as reader:
        pending = reader.submit(ckpt.read, steps[0][0])
        for i, (_, do) in enumerate(steps):
            raw = pending.result()
            if i + 1 < len(steps):
                pending = reader.submit(ckpt.read, steps[i + 1][0])
            with torch.inference_mode():
                do(raw)
            del raw

    if head is None:  # the final norm and lm_head, read last (verify passes the fp32 ones it already has)
        modules = {"norm": sk.model.model.norm, "lm": sk.model.get_output_embeddings()}
        maps = {k: {n: sk.stored_name(p) for n, p in m.named_parameters()} for k, m in modules.items()}
        raw = ckpt.read(sorted({stored for names in maps.values() for stored in names.values()}))
        norm, lm = (build(modules[k], maps[k], raw, torch.float32) for k in ("norm", "lm"))
    else:
        norm, lm = head.final_norm, head.lm_head
    out = []
    for run in runs:
        n, h = (norm, lm) if run.dtype == torch.float32 else (copy.deepcopy(norm).to(run.dtype), copy.deepcopy(lm).to(run.dtype))
        by_sequence = {sequence_key(ids): torch.cat(kept)  for ids, kept in zip(sequences, run.kept, strict=True)}
        out.append(StreamedStates(by_sequence, n, h, run.dtype, dev))
    stored = checkpoint_float_elements(path)
    how = (f"streamed unit by unit ({choice.why}); {ckpt.bytes_read / GIB:.3g} GiB read once "
           f"({ckpt.seconds_reading:.1f} s reading, one unit ahead), peak estimate {plan.peak_bytes / GIB:.3g} GiB, "
           f"experts per chunk {sorted(set(plan.experts_per_chunk))}; checkpoint floats {sorted(stored)}")
    return References(out[0], out[1] if len(out) > 1 else None, how, time.perf_counter() - started)


class ChunkedExperts(torch.nn.Module):
    """Stands in for a layer's routed experts while they are applied a chunk at a time: first records
    each call (state, routed ids, weights), then returns, call by call, the chunks' summed outputs.
    Records and sums wait on the host, so the device holds one call at a time whatever the samples."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.sums: list[torch.Tensor] | None = None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.sums is None:
            self.calls.append((hidden_states.cpu(), top_k_index.cpu(), top_k_weights.cpu()))
            return torch.zeros_like(hidden_states)
        return self.sums.pop(0).to(hidden_states.device)


@dataclass
class LayerStep:
    index: int
    layer: torch.nn.Module
    local: dict[str, str]
    experts: dict[str, torch.nn.Module]
    prefix: dict[str, str]
    runs: list[Run]
    build: object
    stacked: object
    apply: object

    def advance(self, run: Run, module) -> None:
        for kept in run.kept:
            kept.append(self.apply(module, kept[-1].to(next(module.parameters()).device)).cpu())

    def whole(self, raw) -> None:
        for run in self.runs:
            module = self.build(self.layer, self.local, raw, run.dtype)
            for name, m in self.experts.items():
                fused = self.stacked(self.prefix[name], range(m.num_experts), raw, run.dtype)
                target = module.get_submodule(name)
                for k, v in fused.items():
                    setattr(target, k, torch.nn.Parameter(v, requires_grad=False))
            self.advance(run, module)

    def record(self, raw) -> None:
        (name, _), = self.experts.items()
        self.modules = []
        for run in self.runs:
            module = self.build(self.layer, self.local, raw, run.dtype)
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, ChunkedExperts())
            for kept in run.kept:
                self.apply(module, kept[-1].to(next(module.parameters()).device))
            self.modules.append(module)
            slot = module.get_submodule(name)
            slot.totals = [torch.zeros_like(h) for h, _, _ in slot.calls]

    def chunk(self, raw, part: range) -> None:
        (name, meta), = self.experts.items()
        for run, module in zip(self.runs, self.modules, strict=True):
            experts = copy.deepcopy(meta)
            for k, v in self.stacked(self.prefix[name], part, raw, run.dtype).items():
                setattr(experts, k, torch.nn.Parameter(v, requires_grad=False))
            # a slice of the experts with out-of-slice ids as sentinels: transformers' expert-parallel case
            experts.num_experts, experts._is_expert_parallel = len(part), True
            slot = module.get_submodule(name)
            dev = next(experts.parameters()).device
            for i, (h, ids, w) in enumerate(slot.calls):
                ids = ids.to(dev)
                inside = (ids >= part.start) & (ids < part.stop)
                local_ids = torch.where(inside, ids - part.start, len(part))  # outside: the skipped sentinel
                slot.totals[i] += experts(h.to(dev), local_ids, w.to(dev)).cpu()

    def finish(self, _raw) -> None:
        (name, _), = self.experts.items()
        for run, module in zip(self.runs, self.modules, strict=True):
            slot = module.get_submodule(name)
            slot.sums, slot.calls = slot.totals, []
            self.advance(run, module)
        self.modules = []
