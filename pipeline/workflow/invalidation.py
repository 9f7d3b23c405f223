"""Which DVC stages each params.yaml key re-runs, and why: the one table dvc.yaml's `params:` lists follow.

A key belongs to a stage when a different value gives different bytes in that stage's outputs by
design: which model, which data, which layers, which dtype, which shard layout, which seed, which
hyperparameter, which check. DVC then re-runs that stage, and after it every stage whose inputs
came out different. Keys that only choose *how* the same outputs are computed (batch sizes,
memory, parallel layout, Ray placement and retries, worker counts, free-space margin, where a
stage runs) belong to no stage: changing one re-runs nothing, and the next run for another reason
uses the new value. On a GPU a different batch or parallel layout can change low-order bits of
bf16 arithmetic, as a different machine does; that is not a reason to throw a finished output away.

What a run used for those keys goes to its metrics (a record of the run, like its wall time),
never into an output another stage reads: extract_meta.json records only the keys below that
define the shards (`output_params`), and regenerate.json only those that define the data.

Every stage also depends on the `check` stage, whose `params:` is all of params.yaml: any edit runs
it first (seconds); a valid edit leaves its output as it was, so nothing else runs for it, and an
invalid one stops `dvc repro` before DVC deletes any stage's outputs (pipeline/stages/check.py, pipeline/workflow/input_checks.py).

tests/test_dvc_invalidation.py holds this table against the schema (every key classified), against
dvc.yaml (every list exactly this table) and against real DVC runs; docs/ARCHITECTURE.md shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

STAGES = ("model", "regenerate", "prepare", "extract", "verify", "train", "eval")


@dataclass(frozen=True)
class Rule:
    stages: tuple[str, ...]  # the stages whose dvc.yaml params list this key (empty: none)
    why: str


def reruns(*stages: str, why: str) -> Rule:
    return Rule(tuple(stages), why)


def tuning(why: str) -> Rule:
    return Rule((), why)


_EMBEDDED = "builds the embedded target: its weights or tokenizer, so every output after it"
_ENGINE = "engine tuning: the same requests give the same outputs"
_PARALLEL = "parallel layout: which device computes what, not what is computed"
_WATCHDOG = "how long a silent engine is waited for before the stage fails; a run that finishes wrote the same bytes"
_VERIFY = "what verify checks or how strictly: its report and metrics (the verdict stays the same while it passes)"
_TRAIN = "a training input or hyperparameter: the draft's weights"

RERUNS: dict[str, Rule] = {
    "model.path": reruns("model", why="which target: target.json and everything after it"),
    "model.trust_remote_code": reruns("model", why="recorded in target.json; how the target loads everywhere"),
    **{f"model.embedded.{k}": reruns("model", why=_EMBEDDED) for k in (
        "architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
        "max_position_embeddings", "train_steps", "train_batch_size", "train_seq_len", "lr", "seed",
        "quantization", "quantization_group_size")},
    **{f"model.embedded.deepseek_v3.{k}": reruns("model", why=_EMBEDDED) for k in (
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
        "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")},
    "data.path": reruns("regenerate", "prepare", why="which chat data (its content is a dependency too)"),
    "data.seq_len": reruns("regenerate", "prepare", why="truncation of samples; regenerate's generation budget"),
    "data.max_samples": reruns("prepare", why="how many samples"),
    "data.heldout_fraction": reruns("prepare", why="the train / held-out split"),
    "data.on_error": reruns("regenerate", "prepare", why="which malformed lines are skipped or refused"),
    "data.on_overlong": reruns("prepare", why="which long samples are truncated or skipped"),
    "data.seed": reruns("prepare", why="the held-out split's shuffle"),
    "data.regenerate.enabled": reruns("regenerate", "prepare", why="on-policy data or the data as it is"),
    "data.regenerate.max_tokens": reruns("regenerate", why="the regenerated turns (nothing when regeneration is off)"),
    "data.regenerate.temperature": reruns("regenerate", why="the regenerated turns (nothing when regeneration is off)"),
    "data.regenerate.top_p": reruns("regenerate", why="the regenerated turns (nothing when regeneration is off)"),
    "data.regenerate.seed": reruns("regenerate", why="the regenerated turns when sampled (nothing when off)"),
    "data.regenerate.dtype": reruns("regenerate", why="the target's numerics, so its responses (nothing when off)"),
    "data.regenerate.conversations_per_chunk": tuning(
        "checkpoint granularity; sampling seeds are per conversation, not per chunk"),
    "data.regenerate.max_num_seqs": tuning(_ENGINE),
    "data.regenerate.tensor_parallel_size": tuning(_PARALLEL),
    "data.regenerate.gpu_memory_utilization": tuning(_ENGINE),
    "data.regenerate.cpu_kvcache_gib": tuning(_ENGINE),
    "data.regenerate.engine_start_timeout_s": tuning(_WATCHDOG),
    "data.regenerate.engine_stall_timeout_s": tuning(_WATCHDOG),
    "extract.layer_ids": reruns("extract", why="which hidden states are captured (run key)"),
    "extract.samples_per_shard": reruns("extract", why="the shard layout (run key)"),
    "extract.dtype": reruns("extract", why="the engine's and the shards' dtype (run key)"),
    "extract.rank": reruns("extract", why="which shards this machine writes"),
    "extract.world_size": reruns("extract", why="which shards this machine writes (run key)"),
    "extract.max_num_seqs": tuning(_ENGINE),
    "extract.max_num_batched_tokens": tuning(_ENGINE),
    "extract.tensor_parallel_size": tuning(_PARALLEL),
    "extract.pipeline_parallel_size": tuning(_PARALLEL),
    "extract.expert_parallel": tuning(_PARALLEL),
    "extract.gpu_memory_utilization": tuning(_ENGINE),
    "extract.cpu_kvcache_gib": tuning(_ENGINE),
    "extract.engine": tuning("local or Ray replicas write the same shards (tests/test_ray_extract.py)"),
    "extract.ray_address": tuning("which cluster runs the engines"),
    "extract.replicas": tuning(_PARALLEL),
    "extract.max_retries": tuning("how often a lost shard is retried; a shard is written whole or not at all"),
    "extract.free_space_margin": tuning("a refusal threshold before the run; never in an output"),
    "extract.engine_start_timeout_s": tuning(_WATCHDOG),
    "extract.engine_stall_timeout_s": tuning(_WATCHDOG),
    **{f"verify.{k}": reruns("verify", why=_VERIFY) for k in (
        "reference_samples", "seed", "fp32_max_abs_error", "bf16_error_ratio", "min_argmax_agreement",
        "argmax_disagreement_ratio", "min_accuracy_ratio", "audit_fraction", "audit_min_shards",
        "final_state_positions_per_shard", "hash_all_shards",
        "sample_stride", "sample_window", "sample_false_alarm", "coherence_fit_tokens")},
    "verify.reference_memory_gib": tuning(
        "memory budget: the whole-model and the streamed reference compute the same states (bit-equal, "
        "tests/test_streamed_reference.py); only the report's line on which one ran differs"),
    "verify.workers": tuning("threads scanning shards; the same shards give the same findings"),
    **{f"train.{k}": reruns("train", why=_TRAIN) for k in (
        "epochs", "lr", "ttt_steps", "draft_layers", "draft_vocab_size", "max_len", "val_fraction", "seed",
        "optimizer", "hidden_states_dtype", "loss_implementation", "nproc_per_node", "nnodes")},  # the per-step batch: nproc x nnodes x max_len
    "train.master_addr": tuning("where the torchrun ranks meet; not in the run key"),
    "train.master_port": tuning("where the torchrun ranks meet; not in the run key"),
    "train.node_rank": tuning("which node this is; each node of a run has its own"),
    "eval.num_speculative_tokens": reruns("eval", why="what is measured: tau at k draft tokens"),
    "eval.compare_speculative_tokens": reruns("eval", why="what is measured: tau and speed at more k"),
    "eval.decode_batch_sizes": reruns("eval", why="what is measured: decode speed at these batch sizes"),
    "eval.num_prompts": reruns("eval", why="what is measured: the prompts"),
    "eval.max_tokens": reruns("eval", why="what is measured: tokens generated per prompt"),
    "eval.max_acceptance_gap": reruns("eval", why="the flags in reports/eval.md and metrics/eval.json"),
    "eval.dtype": reruns("eval", why="the serving numerics, so the acceptance measured"),
    "eval.tensor_parallel_size": tuning(_PARALLEL),
    "eval.gpu_memory_utilization": tuning(_ENGINE),
    "eval.cpu_kvcache_gib": tuning(_ENGINE),
    "eval.engine_start_timeout_s": tuning(_WATCHDOG),
    "eval.engine_stall_timeout_s": tuning(_WATCHDOG),
    "eval.enforce_eager": tuning("engine tuning: the same greedy outputs, compiled or not; its tokens/s are a record "
                                 "of the run, like the machine's"),
    "plan.calibration_samples": tuning("read by `python -m pipeline plan` only; no stage"),
    "plan.write_gb_per_s": tuning("read by `python -m pipeline plan` only; no stage"),
    "runtime.image": reruns(*STAGES, why="the container's vLLM, torch and speculators run every stage"),
    "runtime.mode": tuning("native and docker run the same code on the same data (byte-identical shards, docs/CONTAINER.md)"),
    "runtime.recipe": tuning("which recipe builds the container: gpu's base differs from the others' (a new "
                             "runtime.image, which every stage lists); cpu and gpu-debian share the Debian base, so a "
                             "switch between those two re-runs nothing, as a change of the native environment would not"),
    "runtime.network": tuning("the container's network (none: nothing downloads at run time); not the data"),
    "runtime.gpus": tuning("which devices the container sees"),
    "runtime.shm_size": tuning("the container's shared memory"),
    "runtime.model_cache": tuning("where the container finds the Hugging Face cache"),
    "runtime.env": tuning("environment passed into the container (engine knobs such as VLLM_*)"),
}


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the schema that holds a value (sections are walked, not listed)."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += leaf_keys(sub, f"{key}.")
        else:
            keys.append(key)
    return keys


def stage_keys(stage: str) -> list[str]:
    """The keys `stage`'s dvc.yaml params list must name, in table order."""
    return [k for k, rule in RERUNS.items() if stage in rule.stages]


def output_params(section: BaseModel, prefix: str, stage: str) -> dict:
    """The values of `section` (at `prefix`, e.g. 'extract') that define `stage`'s outputs, flat."""
    out = {}
    for key in stage_keys(stage):
        if key.startswith(f"{prefix}."):
            value = section
            for part in key.removeprefix(f"{prefix}.").split("."):
                value = getattr(value, part)
            out[key.removeprefix(f"{prefix}.")] = value.model_dump() if isinstance(value, BaseModel) else value
    return out


def stages_text(rule: Rule) -> str:
    """How docs/ARCHITECTURE.md names a rule's stages."""
    if rule.stages == STAGES:
        return "all stages"
    return ", ".join(rule.stages) or "none"


def markdown_table() -> str:
    """The table as docs/ARCHITECTURE.md shows it: `python -m pipeline.workflow.invalidation` prints it."""
    rows = ["| key | re-runs (then what its changed outputs feed) | why |", "| --- | --- | --- |"]
    rows += [f"| `{key}` | {stages_text(rule)} | {rule.why} |" for key, rule in RERUNS.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())


def regenerated_params(params: BaseModel) -> dict:
    """data.regenerate's keys that define the regenerated data (pipeline/workflow/invalidation.py): not engine tuning or chunking."""
    flat = output_params(params, "data", "regenerate")
    return {k.removeprefix("regenerate."): v for k, v in flat.items() if k.startswith("regenerate.")}
