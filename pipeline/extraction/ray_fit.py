"""Whether extract's Ray replicas fit the cluster, and what each one asks Ray for (GPUs, CPUs, executor)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.params import ExtractParams


@dataclass(frozen=True)
class Node:
    host: str
    cpus: float
    gpus: float


def alive_nodes(ray) -> list[Node]:
    return [
        Node(n.get("NodeManagerHostname", n.get("NodeManagerAddress", "?")), n["Resources"].get("CPU", 0.0),
             n["Resources"].get("GPU", 0.0))
        for n in ray.nodes()
        if n.get("Alive")
    ]


@dataclass(frozen=True)
class ReplicaShape:
    """What one replica asks Ray for, and how its engine spreads over devices."""

    num_cpus: float
    num_gpus: float
    executor_backend: str | None  # vLLM's distributed_executor_backend; None = vLLM's default
    on_gpu: bool


def replica_shape(params: ExtractParams, nodes: list[Node], address: str) -> ReplicaShape:
    """Check that `params` fit the cluster's `nodes`; raise a PipelineError naming the keys if not."""
    tp, pp, r = params.tensor_parallel_size, params.pipeline_parallel_size, params.replicas
    world = tp * pp
    gpus = sum(n.gpus for n in nodes)
    where = f"the Ray cluster at extract.ray_address={address!r} ({len(nodes)} node(s): " + ", ".join(
        f"{n.host} {n.cpus:g} CPU/{n.gpus:g} GPU" for n in nodes
    ) + ")"
    if gpus == 0:
        if world != 1:
            raise PipelineError(
                f"extract.tensor_parallel_size ({tp}) x extract.pipeline_parallel_size ({pp}) = {world}, but {where} "
                "has no GPUs: on CPU each replica is one engine on one CPU; set both to 1 and use extract.replicas"
            )
        fit = sum(int(n.cpus) for n in nodes)
        if r > fit:
            raise PipelineError(
                f"extract.replicas ({r}) needs {r} CPUs (one per CPU replica) but {where} has {fit}: "
                f"lower extract.replicas to {max(fit, 1)} or add nodes (`ray start --address ...`)"
            )
        return ReplicaShape(num_cpus=1, num_gpus=0, executor_backend=None, on_gpu=False)
    need = r * world
    if need > gpus:
        raise PipelineError(
            f"extract.replicas ({r}) x extract.tensor_parallel_size ({tp}) x extract.pipeline_parallel_size ({pp}) "
            f"= {need} GPUs, but {where} has {gpus:g}: lower extract.replicas (or the parallel sizes) or add nodes"
        )
    per_node = max(int(n.gpus) for n in nodes)
    if tp > per_node:
        raise PipelineError(
            f"extract.tensor_parallel_size ({tp}) is more than the most GPUs on one node ({per_node}) of {where}: "
            "a tensor-parallel group must stay inside a node; set extract.tensor_parallel_size <= "
            f"{per_node} and spread the model over nodes with extract.pipeline_parallel_size (docs/SCALING.md)"
        )
    if world <= per_node:  # a replica inside one node: Ray gives the actor its GPUs
        fit = sum(int(n.gpus) // world for n in nodes)
        if r > fit:
            raise PipelineError(
                f"extract.replicas ({r}) replicas of {world} GPUs each (extract.tensor_parallel_size x "
                f"extract.pipeline_parallel_size) must each fit one node; only {fit} fit in {where}: "
                f"lower extract.replicas to {fit}"
            )
        return ReplicaShape(num_cpus=1, num_gpus=world, executor_backend="mp" if world > 1 else None, on_gpu=True)
    # a replica larger than a node: vLLM's Ray executor places its TP x PP workers itself (a
    # placement group of `world` GPU bundles); the actor only drives the engine.
    whole = sum(int(n.gpus) // tp for n in nodes)  # TP groups that fit inside nodes
    if r * pp > whole:
        raise PipelineError(
            f"extract.replicas ({r}) x extract.pipeline_parallel_size ({pp}) = {r * pp} tensor-parallel groups of "
            f"{tp} GPUs (extract.tensor_parallel_size), each inside one node, but only {whole} fit in {where}"
        )
    return ReplicaShape(num_cpus=1, num_gpus=0, executor_backend="ray", on_gpu=True)
