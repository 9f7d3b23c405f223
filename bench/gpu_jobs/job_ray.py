"""bench step ray: the extract stage with extract.engine: ray on a local Ray cluster the child starts."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from gpu_jobs.common import log
from gpu_jobs.engine_runs import _engine_params, _patch_eager_for_moe


def job_ray(state: dict, name: str) -> dict:
    """extract.engine: ray on a Ray cluster this child starts on the host (one node; each replica
    gets one GPU, or one CPU in smoke mode). The stage finds Ray initialised and uses that cluster
    (pipeline/extraction/ray.connect); the cluster ends with ray.shutdown() before the result is written."""
    import tempfile

    try:
        import ray
    except Exception as e:  # the GPU image may lack Ray: a clean skip, not a failed bench
        return {"summary": {"skipped": f"ray not importable ({type(e).__name__}: {e})"}}
    from pipeline import layout
    from pipeline.extraction import ray as ray_extract
    from pipeline.stages import extract

    _patch_eager_for_moe(state, name)
    params = _engine_params(state, name)
    proj = Path(state[f"project_{name}"])
    shutil.rmtree(proj / layout.HIDDEN_STATES_DIR, ignore_errors=True)
    (proj / layout.METRICS / "extract.json").unlink(missing_ok=True)
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    t = time.monotonic()
    ray.init(
        address="local",  # always a new cluster of this child's own, never one running on the host
        namespace=ray_extract.NAMESPACE,
        num_cpus=params.replicas if state["smoke"] else None,
        include_dashboard=False,
        object_store_memory=200 << 20,  # the replicas write shards to disk, nothing big goes through Ray
        _temp_dir=temp,
        log_to_driver=True,
    )
    ray_init_s = time.monotonic() - t
    resources = ray.cluster_resources()
    log(f"ray: local cluster up in {ray_init_s:.1f} s: {resources}")
    try:
        t = time.monotonic()
        with contextlib.chdir(proj):
            extract.run(params)
        run_s = time.monotonic() - t
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    summary = {
        "stage_tok_s": metrics["tok_per_s"],
        "engine_load_s": metrics["engine_load_s"],
        "wall_s": metrics["wall_s"],
        "run_s": round(run_s, 2),
        "ray_init_s": round(ray_init_s, 2),
        "tokens": metrics["tokens"],
        "replicas": metrics.get("replicas"),
        "shards_per_replica": metrics.get("shards_per_replica"),
        "replicas_lost": metrics.get("replicas_lost"),
        "cluster_resources": resources,
        "extract_params": state.get(f"extract_{name}"),
        "stage_metrics": metrics,
    }
    log(f"ray {name}: {json.dumps({k: v for k, v in summary.items() if k != 'stage_metrics'})}")
    return {"summary": summary}
