"""The typed schema of params.yaml: one field per tunable, validated on load.

Every stage reads only its own section (the CLI passes it `params.extract`, etc.); a bad value fails here,
before any model loads, with an error that names the key and says what to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.errors import PipelineError

EMBEDDED = "embedded"
PARAMS_FILE = Path("params.yaml")


class ParamsError(PipelineError):
    """A params.yaml problem, worded for the user: which key, what is wrong, what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# vLLM's CPU MLA attention supports only these head sizes (kv_lora_rank + qk_rope_head_dim); real
# DeepSeek-V3 / Kimi-K2 use 512 + 64 = 576.
MLA_HEAD_SIZES = (320, 512, 576)


class DeepseekV3Params(_Section):
    """The DeepSeek-V3 / Kimi-K2-specific shape of the embedded target (architecture: deepseek_v3).

    Shared with the Llama shape: num_layers, hidden_size, num_heads, intermediate_size (the dense
    layers' MLP), vocab_size, max_position_embeddings; num_kv_heads does not apply (MLA).
    """

    n_routed_experts: int = Field(8, ge=2, description="Routed experts per MoE layer.")
    num_experts_per_tok: int = Field(2, ge=1, description="Experts each token is routed to (top-k, sigmoid scores, noaux_tc).")
    n_shared_experts: int = Field(1, ge=0, description="Always-on shared experts per MoE layer.")
    moe_intermediate_size: int = Field(64, ge=8)
    first_k_dense_replace: int = Field(1, ge=0, description="The first k layers have a dense MLP instead of MoE.")
    q_lora_rank: int = Field(48, ge=8, description="MLA query compression rank.")
    kv_lora_rank: int = Field(512, ge=8, description="MLA key/value compression rank; + qk_rope_head_dim must be 320, 512 or 576.")
    qk_rope_head_dim: int = Field(64, ge=2)
    qk_nope_head_dim: int = Field(32, ge=1)
    v_head_dim: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _shape(self) -> DeepseekV3Params:
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"model.embedded.deepseek_v3.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        head = self.kv_lora_rank + self.qk_rope_head_dim
        if head not in MLA_HEAD_SIZES:
            raise ValueError(
                f"model.embedded.deepseek_v3.kv_lora_rank + qk_rope_head_dim = {head}, but vLLM's CPU MLA attention "
                f"supports only head sizes {list(MLA_HEAD_SIZES)}: e.g. kv_lora_rank {576 - self.qk_rope_head_dim}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError("model.embedded.deepseek_v3.qk_rope_head_dim must be even (rotary pairs)")
        return self


class EmbeddedModelParams(_Section):
    """The tiny target the project builds and trains itself (model.path: embedded)."""

    architecture: Literal["llama", "deepseek_v3"] = Field(
        "llama", description="llama = dense Llama; deepseek_v3 = DeepSeek-V3 / Kimi-K2 shape (MLA + MoE with shared experts)."
    )
    num_layers: int = Field(8, ge=4, description="Decoder layers (>= 8 keeps the default EAGLE-3 layers distinct).")
    hidden_size: int = Field(128, ge=16)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(384, ge=16)
    vocab_size: int = Field(1024, ge=300, description="Byte-level BPE vocabulary trained on the shipped corpus.")
    max_position_embeddings: int = Field(2048, ge=64)
    train_steps: int = Field(300, ge=0, description="Optimizer steps of the brief pre-training on the corpus.")
    train_batch_size: int = Field(8, ge=1, description="Windows per step; many small steps beat few large ones here.")
    train_seq_len: int = Field(256, ge=16)
    lr: float = Field(3e-3, gt=0)
    seed: int = 0
    deepseek_v3: DeepseekV3Params = Field(DeepseekV3Params(), description="Only used when architecture is deepseek_v3.")
    quantization: Literal["none", "w4a16"] = Field(
        "none", description="w4a16 = write the trained target as INT4 weight-only, compressed-tensors pack-quantized "
        "(the Kimi-K2.5 INT4 format: routed experts where there are any, else every decoder Linear; the rest bf16).",
    )
    quantization_group_size: int = Field(32, ge=8, description="Weights sharing one scale (Kimi-K2.5 INT4: 32).")

    @model_validator(mode="after")
    def _heads_divide(self) -> EmbeddedModelParams:
        if self.architecture == "deepseek_v3":
            if self.deepseek_v3.first_k_dense_replace >= self.num_layers:
                raise ValueError(
                    f"model.embedded.deepseek_v3.first_k_dense_replace ({self.deepseek_v3.first_k_dense_replace}) must be < "
                    f"model.embedded.num_layers ({self.num_layers}), or the target has no MoE layer"
                )
            return self  # MLA: head dims are explicit, num_kv_heads does not apply
        if self.hidden_size % self.num_heads:
            raise ValueError("model.embedded.hidden_size must be a multiple of model.embedded.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.embedded.num_heads must be a multiple of model.embedded.num_kv_heads")
        return self


class ModelParams(_Section):
    path: str = Field(EMBEDDED, description="'embedded' builds the tiny target; else a local HF model directory.")
    trust_remote_code: bool = False
    embedded: EmbeddedModelParams = EmbeddedModelParams()

    @property
    def is_embedded(self) -> bool:
        return self.path == EMBEDDED


def _engine_start_timeout(section: str):
    return Field(1200.0, gt=0, description=f"Seconds the {section} engine may spend starting without a new line in its log "
                 "(weights loading, compiling and graph capture print them) before the stage fails, naming the wait "
                 "(pipeline/watchdog.py); raise it for a very large model on a slow disk. Re-runs nothing.")


def _engine_stall_timeout(section: str, moves: str):
    return Field(600.0, gt=0, description=f"Seconds the running {section} engine may go without {moves} before the "
                 "stage fails, naming the wait (pipeline/watchdog.py); complete work is kept and a re-run resumes. "
                 "Re-runs nothing.")


class RegenerateParams(_Section):
    """On-policy data: the target rewrites every assistant turn before prepare (the regenerate stage)."""

    enabled: bool = Field(False, description="Replace each assistant turn with the target's own response, as EAGLE-3 trains on.")
    max_tokens: int = Field(256, gt=0, description="Tokens generated per assistant turn at most (the turn ends at the target's end-of-turn token otherwise).")
    temperature: float = Field(0.0, ge=0, description="0 = greedy, the target's most likely response (what greedy serving will see).")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, description="Per-request sampling seed base (temperature > 0): the same params give the same data.")
    conversations_per_chunk: int = Field(256, gt=0, description="Conversations between checkpoints; a killed run resumes after the last complete chunk.")
    max_num_seqs: int = Field(64, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kvcache_gib: int = Field(1, ge=1)
    engine_start_timeout_s: float = _engine_start_timeout("regenerate")
    engine_stall_timeout_s: float = _engine_stall_timeout("regenerate", "a finished request")


class DataParams(_Section):
    path: str = Field("data/chat.jsonl", description="Chat JSONL: OpenAI 'messages' or ShareGPT 'conversations'.")
    seq_len: int = Field(512, gt=0, description="Tokens per sample after the chat template; longer ones are handled per on_overlong.")
    max_samples: int | None = Field(None, gt=0)
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="Conversations kept out of training, used as eval prompts.")
    on_error: Literal["fail", "skip"] = "fail"
    on_overlong: Literal["truncate", "skip"] = "truncate"
    seed: int = 0
    regenerate: RegenerateParams = RegenerateParams()


class ExtractParams(_Section):
    layer_ids: list[int] | None = Field(
        None, description="vLLM convention: id k = state entering layer k, id N = last layer's output before the final norm. null -> [2, N//2, N-3, N]."
    )
    samples_per_shard: int = Field(64, gt=0)
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3"] = Field(
        "float32",
        description="How the hidden states are computed and stored. float32/bfloat16/float16: vLLM computes in it and the "
        "shards hold it (format version 1). float8_e4m3: vLLM computes in bfloat16 and the shards hold e4m3 values with "
        "one fp32 scale per token and layer (format version 2, docs/FORMAT.md): L x (H + 4) bytes per token, <= 0.52x "
        "of bf16 where H >= 100 + 108/L; quantized where the engine computed it (on the GPU there); every reader dequantizes.",
    )
    max_num_seqs: int = Field(64, gt=0, description="Requests batched per engine step.")
    max_num_batched_tokens: int = Field(2048, gt=0)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    expert_parallel: bool = Field(
        False,
        description="MoE targets: spread the routed experts over the tensor-parallel GPUs instead of splitting "
        "every expert (vLLM's enable_expert_parallel); needs tensor_parallel_size > 1. Not in the run key: like "
        "the parallel sizes it changes only which GPU computes what (bf16 rounding may differ slightly).",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kvcache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU.")
    rank: int = Field(0, ge=0, description="This machine's rank when several machines split the shards.")
    world_size: int = Field(1, ge=1)
    engine: Literal["local", "ray"] = Field(
        "local", description="local = one engine in this process; ray = extract.replicas engines on a Ray cluster (docs/SCALING.md)."
    )
    ray_address: str = Field("auto", description="engine: ray: the cluster to join (ray.init address); auto = the one `ray start` runs on this node.")
    replicas: int = Field(1, ge=1, description="engine: ray: engine actors, each with tensor_parallel_size x pipeline_parallel_size GPUs (1 CPU on CPU).")
    max_retries: int = Field(2, ge=0, description="engine: ray: times a shard whose replica was lost is re-run on another replica.")
    free_space_margin: float = Field(
        0.1, ge=0, description="Refuse to start unless the output's filesystem has the projected bytes x (1 + this) free (pipeline/planning/plan.py)."
    )
    engine_start_timeout_s: float = _engine_start_timeout("extract")
    engine_stall_timeout_s: float = _engine_stall_timeout("extract", "a finished request or a written shard")

    @field_validator("layer_ids")
    @classmethod
    def _layer_ids_shape(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) < 2:
            raise ValueError("extract.layer_ids needs at least two ids (auxiliary layers + the final layer)")
        if len(set(v)) != len(v):
            raise ValueError(f"extract.layer_ids has duplicates: {v}")
        if v != sorted(v):
            raise ValueError(f"extract.layer_ids must be sorted ascending (vLLM sorts them silently): {v} -> {sorted(v)}")
        if v[0] < 0:
            raise ValueError(f"extract.layer_ids must be >= 0: {v}")
        return v

    @model_validator(mode="after")
    def _rank_in_world(self) -> ExtractParams:
        if self.rank >= self.world_size:
            raise ValueError(f"extract.rank ({self.rank}) must be < extract.world_size ({self.world_size})")
        if self.engine == "ray" and self.world_size != 1:
            raise ValueError(
                "extract.engine: ray hands shards to its replicas itself: set extract.world_size: 1 and extract.rank: 0 "
                "(use extract.replicas for more engines), or extract.engine: local to split by rank"
            )
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError(
                "extract.expert_parallel spreads a MoE target's experts over the tensor-parallel GPUs, but "
                f"extract.tensor_parallel_size is {self.tensor_parallel_size}: set it to 2 or more, or "
                "extract.expert_parallel: false"
            )
        return self


class PlanParams(_Section):
    """Read by `python -m pipeline plan` only (capacity planning; no DVC stage)."""

    calibration_samples: int = Field(
        32, ge=1, description="Samples of the short extraction `plan` runs for tokens/s when no extraction ran on this machine yet."
    )
    write_gb_per_s: float = Field(
        1.0, gt=0, description="The host's shard-writing rate (vLLM's per-request files read, checked, written as shards, "
        "hashed) in GB/s, for a plan at an engine rate (--tok-per-s): the time is the longer of compute and writes, plus "
        "the last shard's write. 1.0: the H200 host's fresh-machine runs, 0.89-1.17 GB/s (docs/BENCHMARKS.md, 'The plan's "
        "time model'); a warm host reached 1.32."
    )


class VerifyParams(_Section):
    reference_samples: int = Field(8, ge=1, description="Samples re-run through a transformers reference forward.")
    seed: int = 0
    fp32_max_abs_error: float = Field(1e-4, gt=0, description="Allowed max |captured - reference| for fp32 extraction.")
    bf16_error_ratio: float = Field(4.0, gt=0, description="bf16: captured error may be this many times an independent bf16 reference's error.")
    min_argmax_agreement: float = Field(0.99, ge=0, le=1, description="Final-state check: share of masked positions whose lm_head argmax must match the reference's.")
    argmax_disagreement_ratio: float = Field(2.0, gt=0, description="bf16/fp16: argmax disagreement with the fp32 reference may be this many times an independent same-dtype reference's.")
    min_accuracy_ratio: float = Field(0.5, ge=0, le=1, description="Final-state check: a shard's next-token accuracy must be at least this share of the reference forward's.")
    workers: int | None = Field(None, ge=1, description="Shards scanned in parallel; null = the usable CPU cores, at most 8 with a GPU and 4 without (8 scanned the 8B shape ~12% faster than 4 on an H100, 2026-12-05: docs/ARCHITECTURE.md, 'Per-sample tests: what is caught, what cannot be').")
    audit_fraction: float = Field(
        0.02, ge=0, le=1,
        description="Share of shards (seeded) read in full: sha256 and per-layer statistics re-derived from the bytes and "
        "compared with the manifest's record; 1 = every shard.",
    )
    audit_min_shards: int = Field(2, ge=0, description="Audit at least this many shards (all if there are fewer).")
    final_state_positions_per_shard: int | None = Field(
        2048, ge=1,
        description="A seeded sample of this many masked positions per shard (of those the per-sample tests judge) goes "
        "through lm_head for the per-shard next-token check; null = every one (lm_head is ~5% of an 8B target's FLOPs per token: at every position about a "
        "quarter of verify's data pass on the H200, 2026-12-03, commit 4e552fa). Per-sample faults are the per-sample tests' job.",
    )
    reference_memory_gib: float | None = Field(
        None, gt=0,
        description="Memory the reference forward may use on its device; the whole model is loaded where it fits (and is "
        "not INT4), else it is streamed from the checkpoint a layer (or a chunk of routed experts) at a time within it. "
        "null = 90% of the device's free memory.",
    )
    hash_all_shards: bool = Field(
        False, description="Re-compute every shard's sha256, not only the audited ones' (reads every byte; its cost: docs/BENCHMARKS.md, 'Verify's cost')."
    )
    sample_stride: int = Field(
        4, ge=1, description="Per-sample tests: every this-many-th position of every sample (seeded offset) is read in all "
        "captured layers and judged (pipeline/verification/samples/scores.py); 1 = every position (most sensitive, reads every byte)."
    )
    sample_window: int = Field(
        16, ge=1, description="Per-sample tests: a fault is judged over runs of this many consecutive positions "
        "(sample_window // sample_stride judged positions per window)."
    )
    sample_false_alarm: float = Field(
        1e-6, gt=0, lt=1, description="Per-sample tests: false-alarm probability for the whole run, Bonferroni-corrected "
        "over every window of every test (under a normal law of clean window scores)."
    )
    coherence_fit_tokens: int = Field(
        65536, ge=1, description="Per-sample tests: sampled token rows (seeded samples) the cross-layer predictors are fitted on."
    )


class TrainParams(_Section):
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)
    ttt_steps: int = Field(3, ge=1, description="Test-time-training (draft unroll) steps.")
    draft_layers: int = Field(1, ge=1)
    draft_vocab_size: int | None = Field(None, gt=0, description="null = the target's vocabulary.")
    max_len: int = Field(512, gt=0, description="Tokens packed per training batch.")
    val_fraction: float = Field(0.1, gt=0, lt=1)
    seed: int = 0
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="speculators optimizer; muon = Muon on 2D weights + AdamW on the rest.")
    hidden_states_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Training compute dtype; auto = float32 on CPU (bf16 is ~4x slower there), bfloat16 on GPU."
    )
    loss_implementation: Literal["eager", "fused"] = Field(
        "eager", description="speculators' loss kernels: eager (PyTorch ops, CPU and GPU) or fused (its Triton "
        "kernels, GPU only). fused failed on the H200 under torch 2.11, vLLM 0.26's torch: dynamo 'ListVariable is "
        "already tracked for mutation' in the fused KL kernel's backward, a Triton autotuner's configs tracked twice "
        "in one trace (PyTorch issue pytorch/pytorch#177600 and PyTorch PR #177874; docs/BENCHMARKS.md, 'The whole pipeline on one H200').",
    )
    nproc_per_node: int = Field(
        1, ge=1, description="Training processes per node, one per GPU; more than 1 (or nnodes > 1) runs speculators' "
        "trainer under torchrun (DDP). max_len is per process: a step trains on nproc_per_node x nnodes x max_len tokens.",
    )
    nnodes: int = Field(1, ge=1, description="Nodes training together; > 1: run the stage on every node (docs/SCALING.md).")
    master_addr: str | None = Field(None, description="nnodes > 1: node 0's address (the rendezvous); null = $MASTER_ADDR.")
    master_port: int | None = Field(None, ge=1, le=65535, description="nnodes > 1: rendezvous port; null = $MASTER_PORT, else 29500.")
    node_rank: int | None = Field(None, ge=0, description="nnodes > 1: this node's rank, 0 writes the draft; null = $NODE_RANK.")

    @model_validator(mode="after")
    def _node_in_nodes(self) -> TrainParams:
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank ({self.node_rank}) must be < train.nnodes ({self.nnodes})")
        return self


class EvalParams(_Section):
    num_speculative_tokens: int = Field(3, ge=1)
    compare_speculative_tokens: list[int] = Field(
        [], description="More k values, each in an engine of its own: tau, acceptance per position and tokens/s beside "
        "num_speculative_tokens' (whose figures stay the headline and the reconciliation's flags); [] = none."
    )
    decode_batch_sizes: list[int] = Field(
        [], description="Batch sizes whose decode throughput every engine (each k, and the plain one) times after the "
        "held-out batch: all held-out prompts, cycled to whole batches, in generate calls of that many; [] = none."
    )
    num_prompts: int = Field(64, ge=1)
    max_tokens: int = Field(64, ge=1)
    max_acceptance_gap: float = Field(
        0.15, gt=0, le=1, description="Flag |training full_acc_k - vLLM acceptance at position k| above this in reports/eval.md."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Serving dtype of target and draft; auto = vLLM's choice (on CPU it downcasts float32 to bfloat16)."
    )
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kvcache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU.")
    enforce_eager: bool = Field(
        True, description="vLLM without CUDA graphs or torch.compile (fast start-up; on CPU the tested path). false: the "
        "compiled, graph-captured engine a GPU serves with, whose small-batch decode speed is the one to compare."
    )
    engine_start_timeout_s: float = _engine_start_timeout("eval")
    engine_stall_timeout_s: float = _engine_stall_timeout("eval", "a finished request")

    @field_validator("compare_speculative_tokens", "decode_batch_sizes")
    @classmethod
    def _positive_distinct(cls, v: list[int], info) -> list[int]:
        if any(x < 1 for x in v) or len(set(v)) != len(v):
            raise ValueError(f"eval.{info.field_name} must hold distinct values >= 1: {v}")
        return v

    @model_validator(mode="after")
    def _k_once(self) -> EvalParams:
        if self.num_speculative_tokens in self.compare_speculative_tokens:
            raise ValueError(
                f"eval.compare_speculative_tokens holds eval.num_speculative_tokens ({self.num_speculative_tokens}), "
                "which is always measured: remove it from the list"
            )
        return self


# The base image the GPU container builds FROM, pinned by tag and digest (docker/Dockerfile): the
# vLLM release the H200 runs were measured with. The digest is not verified against a registry
# (docs/CONTAINER.md, "What is tested, what is not").
DEFAULT_IMAGE = "vllm/vllm-openai:v0.26.0@sha256:ffb2d59b1c059a5bd8d781320c9f5189de8293693b7d95da54befddaa54abf52"


class RuntimeParams(_Section):
    """Where the stages run; read only by the launcher (pipeline/workflow/launcher.py), never by a stage."""

    mode: Literal["native", "docker"] = Field(
        "native", description="native = this Python environment; docker = inside the image built from runtime.image (make docker-build)."
    )
    image: str = Field(
        DEFAULT_IMAGE,
        description="Base image as name:tag@sha256:<digest>: the vLLM OpenAI image for recipe gpu, a Debian base for recipes cpu and gpu-debian (make docker-base).",
    )
    recipe: Literal["gpu", "cpu", "gpu-debian"] = Field(
        "gpu",
        description="gpu = docker/Dockerfile (FROM the vLLM image); cpu = docker/Dockerfile.cpu (the vllm-cpu stack of requirements/cpu.txt); "
        "gpu-debian = docker/Dockerfile.gpu-debian (the CUDA stack of requirements/gpu-cp311.txt on the Debian base, where the vLLM image cannot be pulled).",
    )
    network: str = Field(
        "none", description="docker run --network: none = nothing downloads at run time; host e.g. for extract.engine: ray."
    )
    gpus: str = Field("all", description="docker run --gpus value: all, 2, or '\"device=0,1\"' (docker wants those quotes); none leaves it out.")
    shm_size: str | None = Field(None, description="null = --ipc=host (what vLLM and NCCL want); else --shm-size, e.g. '16g'.")
    model_cache: str | None = Field(
        None, description="Host Hugging Face cache, mounted at the same path and set as HF_HOME; null = $HF_HOME or ~/.cache/huggingface."
    )
    env: list[str] = Field([], description="More host environment variable names to pass into the container.")

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str) -> str:
        name, _, digest = v.partition("@")
        if not (digest.startswith("sha256:") and len(digest) == 71 and all(c in "0123456789abcdef" for c in digest[7:])):
            raise ValueError("runtime.image must be pinned by digest: name:tag@sha256:<64 hex digits>")
        if ":" not in name.rsplit("/", 1)[-1]:
            raise ValueError("runtime.image needs a tag before the digest (name:tag@sha256:...), so people can read what it is")
        return v


class Params(_Section):
    model: ModelParams = ModelParams()
    data: DataParams = DataParams()
    extract: ExtractParams = ExtractParams()
    verify: VerifyParams = VerifyParams()
    train: TrainParams = TrainParams()
    eval: EvalParams = EvalParams()
    plan: PlanParams = PlanParams()
    runtime: RuntimeParams = RuntimeParams()


def _format_error(err: ValidationError, source: Path) -> str:
    lines = [f"{source}: invalid params"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or fix its spelling")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: not found; run from the project root or pass --params")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections (model, data, extract, ...)")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_error(e, path)) from None


def resolve_layer_ids(layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """The EAGLE-3 layers in vLLM's convention, checked against the target's depth."""
    if layer_ids is None:
        ids = sorted({2, num_layers // 2, num_layers - 3, num_layers})
        if len(ids) != 4:
            raise ParamsError(
                f"extract.layer_ids: the default [2, N//2, N-3, N] collapses for N={num_layers} layers; "
                "set extract.layer_ids explicitly"
            )
        return ids
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ParamsError(
            f"extract.layer_ids: {bad} out of range for a target with {num_layers} layers; "
            f"ids go from 0 (embeddings) to {num_layers} (last layer's output, before the final norm)"
        )
    return list(layer_ids)
