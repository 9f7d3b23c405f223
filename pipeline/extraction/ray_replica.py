"""One extract replica on a Ray cluster: an actor holding one engine, writing whole shards with the local code."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.extraction.ray_fit import ReplicaShape
from pipeline.hidden_states import format as shards


class ShardReplica:
    """One engine on the cluster (a Ray actor): computes and writes whole shards, one per call."""

    def __init__(self, params, target, layer_ids, max_model_len, dataset: str, out: str, run_key: str,
                 manifest_extra: dict, plan, executor_backend: str | None) -> None:
        self.params, self.target, self.layer_ids, self.max_model_len = params, target, layer_ids, max_model_len
        self.dataset, self.out, self.run_key = Path(dataset), Path(out), run_key
        self.manifest_extra, self.plan, self.executor_backend = manifest_extra, plan, executor_backend
        self.engine = None
        self.scratch: Path | None = None

    def start(self) -> dict:
        """Check this node sees the shared output, load the data and the engine; return where it runs."""
        import ray

        from pipeline.extraction import engine, inputs

        host = socket.gethostname()
        try:
            meta = shards.read_meta(self.out)
        except FileNotFoundError:
            meta = {}
        if meta.get("run_key") != self.run_key:
            raise PipelineError(
                f"replica on {host} does not see this run's {self.out / shards.META_FILE}: the output directory "
                "must be on storage every node mounts at the same path (docs/SCALING.md)"
            )
        t0 = time.monotonic()
        self.scratch = _scratch_dir()
        self.ds, _ = inputs.open_prepared(self.dataset)
        extra = {"distributed_executor_backend": self.executor_backend} if self.executor_backend else {}
        self.engine = engine.start_engine(
            self.params, self.target, self.layer_ids, self.max_model_len, self.scratch, **extra
        )
        return {"host": host, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "load_s": time.monotonic() - t0}

    def extract(self, indices: list[int]) -> dict:
        """Compute shards `indices` with the local stage's code and this replica's engine, streaming
        from one into the next as a local run does (the engine works on the next shard's requests
        while the last one is written); they land in `out`."""
        from pipeline.extraction import engine

        prog = engine.extract_shards(
            self.params, self.target, self.layer_ids, self.max_model_len, self.ds, self.plan, list(indices), self.out,
            self.manifest_extra, engine=self.engine, show_progress=False,
        )
        manifests = [shards.read_manifest(self.out / shards.shard_name(k)) for k in indices]
        return {"indices": list(indices), "manifests": manifests, "samples": prog.samples, "tokens": prog.tokens,
                "bytes": prog.bytes, "seconds": prog.seconds, "time_s": prog.time_s}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _scratch_dir() -> Path:
    """vLLM's per-request files of this replica: node-local, under the system temp dir.

    Named by pid; directories of replicas whose process is gone (killed ones) are removed here.
    """
    root = Path(tempfile.gettempdir()) / "eagle3-extract-scratch"
    root.mkdir(exist_ok=True)
    for d in root.iterdir():
        if d.name.isdigit() and not Path(f"/proc/{d.name}").exists():
            shutil.rmtree(d, ignore_errors=True)
    d = root / str(os.getpid())
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    return d


def engine_env(shape: ReplicaShape) -> dict[str, str]:
    """Environment of a replica's process. On CPU: one OpenMP thread per replica CPU, and no vLLM
    core binding (two replicas on one machine would otherwise pin to the same cores)."""
    if shape.on_gpu:
        return {}
    n = str(int(shape.num_cpus))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
