"""extract.engine: ray on a real local Ray cluster (a head and one worker node, 1 CPU each) with two
real vLLM CPU replicas on the tiny model: same bytes as the local run, verify passes, and a replica
killed mid-shard is replaced by the other one without losing or repeating a sample.

One cluster for the module (each vLLM CPU engine takes ~20-40 s to start, the cluster ~10 s);
it is always torn down, and the test checks that none of its processes are left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction import ray as ray_extract
from pipeline.extraction import ray_fit
from pipeline.hidden_states import format as shards
from pipeline.params import ExtractParams
from pipeline.target import sha256_file
from tests.conftest import EXTRACT_PARAMS, NUM_PREPARED, copy_project, run_stage

pytestmark = pytest.mark.slow
RAY_PARAMS = {**EXTRACT_PARAMS, "engine": "ray", "replicas": 2}
# the kill test's engine: one request and 32 tokens a step (tuning, no byte changes between its own
# runs), so a shard lasts long enough on free cores for a replica to be caught computing one
SLOW_PARAMS = {**EXTRACT_PARAMS, "max_num_seqs": 1, "max_num_batched_tokens": 32}


def _processes_with(text: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if text in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def ray_cluster():
    """Address of a local cluster: head + one worker node, 1 CPU each, in its own short temp dir."""
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", temp)  # all of Ray's files, the address file included, go there
        mp.setenv("TMPDIR", temp)  # and the replicas' scratch dirs (a killed one leaves its own)
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            if cluster is not None:
                cluster.shutdown()
        deadline = time.monotonic() + 30
        while (left := _processes_with(temp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


def fresh_project(project_root: Path, dst: Path) -> Path:
    return copy_project(project_root, dst, layout.TARGET_JSON, layout.PREPARED_DATASET)


def shard_files(hs_dir: Path) -> dict[str, str]:
    """Every shard and manifest file by name -> sha256: the data *and* the manifests must match."""
    return {p.name: sha256_file(p) for p in sorted(hs_dir.glob("shard-*"))}


def metrics(root: Path) -> dict:
    return json.loads((root / layout.METRICS / "extract.json").read_text())


def sample_ids(hs_dir: Path) -> list[int]:
    return sorted(sid for p in shards.complete_shards(hs_dir) for sid in shards.read_manifest(p)["sample_ids"])


def test_same_shards_as_local_run_and_verify_passes(extracted: Path, project_root: Path, tmp_path: Path, ray_cluster):
    proj = fresh_project(project_root, tmp_path / "p")
    run_stage(proj, "extract", **RAY_PARAMS, ray_address=ray_cluster)

    hs = proj / layout.HIDDEN_STATES_DIR
    assert shard_files(hs) == shard_files(extracted)  # 3 shards + 3 manifests, byte for byte
    assert len(shard_files(hs)) == 6
    m = metrics(proj)
    assert m["engine"] == "ray" and m["replicas"] == 2
    # which replica wrote which shard depends on load times (on 2 busy cores the first one ready may
    # write all 3 before the other has loaded): only the total is fixed
    assert sum(m["shards_per_replica"].values()) == 3
    assert (m["samples"], m["shards_written"], m["replicas_lost"], m["shard_retries"]) == (NUM_PREPARED, 3, 0, 0)
    assert shards.read_meta(hs)["complete"] and not list(hs.glob("*.tmp-*"))

    run_stage(proj, "verify", reference_samples=4)
    assert json.loads((proj / layout.VERIFY_VERDICT).read_text())["passed"] is True


def replica_requests(ray_tmp: str) -> dict[int, set[int]]:
    """Live replica pid -> the sample ids vLLM has scheduled on it. Each replica keeps vLLM's
    per-request files in its own scratch dir, `$TMPDIR/eagle3-extract-scratch/<its pid>`, and vLLM
    creates `<request id>.safetensors.lock` there when it schedules a request (ids `s<sample id>`,
    perhaps with a suffix vLLM adds). Dirs of replicas that are gone are left out."""
    root = Path(ray_tmp) / "eagle3-extract-scratch"
    out: dict[int, set[int]] = {}
    for d in root.iterdir() if root.is_dir() else []:
        if not d.name.isdigit() or not Path(f"/proc/{d.name}").exists():
            continue
        try:
            names = os.listdir(d)
        except OSError:  # removed meanwhile
            continue
        out[int(d.name)] = {int(m.group(1)) for n in names if (m := re.match(r"s(\d+)\b", n))}
    return out


@contextlib.contextmanager
def kill_a_replica_mid_shard(
    hs: Path, shard_samples: dict[str, list[int]], after_a_new_shard: bool, timeout_s: float = 300
) -> Iterator[list[int]]:
    """From outside the driver, as a crash or a lost node would: SIGKILL a replica that has just
    started a shard, i.e. vLLM has scheduled on it one of the first half of the samples of a shard
    that is not complete (`shard_samples`: shard file name -> its sample ids). With one request at
    a time the rest of that shard is still to compute, so the kill lands with the shard in flight
    however fast or loaded the machine is. With `after_a_new_shard`, only once a shard of this run
    is complete (a manifest the output did not hold before). Only replicas started after entering: yields the list the
    killed pid is put in."""
    ray_tmp = os.environ["RAY_TMPDIR"]  # the ray_cluster fixture's; TMPDIR, where replicas keep scratch, too
    before = {p.name for p in shards.complete_shards(hs)} if hs.is_dir() else set()
    # replicas an earlier run ended may still be listed (ray.kill returns before the process is gone, and a killed
    # process stays in /proc until it is reaped: slower on a loaded machine), with files of the samples they had in
    # flight: "killing" one is no loss to this run (the likeliest cause of a CI run beside `make repro` that killed a
    # process and lost no replica; not reproduced)
    earlier = set(replica_requests(ray_tmp))
    killed: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            complete = {p.name for p in shards.complete_shards(hs)} if hs.is_dir() else set()
            if not after_a_new_shard or complete - before:
                starting = {sid for name, sids in shard_samples.items() if name not in complete
                            for sid in sids[: max(1, len(sids) // 2)]}
                for pid, sids in replica_requests(ray_tmp).items():
                    if pid not in earlier and sids & starting:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                        return
            stop.wait(0.02)  # a poll interval; a shard's first half lasts seconds on one request a time

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join(timeout=10)


def test_killed_replica_retries_run_out_then_resume_completes(
    extracted: Path, project_root: Path, tmp_path: Path, ray_cluster
):
    local = fresh_project(project_root, tmp_path / "local")  # what the same engine settings write locally
    run_stage(local, "extract", **SLOW_PARAMS)
    extracted = local / layout.HIDDEN_STATES_DIR  # (the shared extraction's fixture built the inputs)
    slow_ray = {**SLOW_PARAMS, "engine": "ray", "replicas": 2}
    proj = fresh_project(project_root, tmp_path / "p")
    hs = proj / layout.HIDDEN_STATES_DIR
    samples_of = {p.name: shards.read_manifest(p)["sample_ids"] for p in shards.complete_shards(extracted)}

    # no retries allowed: once the first shard is done a replica starting another is killed (of 3
    # shards on 2 replicas one is still to do then); the run stops with a report; the complete
    # shards stay on disk
    with pytest.raises(PipelineError) as err, kill_a_replica_mid_shard(hs, samples_of, after_a_new_shard=True) as killed:
        run_stage(proj, "extract", **slow_ray, ray_address=ray_cluster, max_retries=0)
    assert killed, "no replica started a shard after the first one was done"
    msg = str(err.value)
    assert "more than extract.max_retries (0)" in msg and "Lost replicas" in msg and "re-run extract" in msg, msg
    kept = shard_files(hs)
    assert kept and all(kept[name] == h for name, h in shard_files(extracted).items() if name in kept)
    assert not list(hs.glob("*.tmp-*"))

    # keep one complete shard, so two are left for the two replicas of the re-run
    first = shards.complete_shards(hs)[0]
    for p in shards.complete_shards(hs)[1:]:
        p.unlink()
        shards.manifest_path(p).unlink()

    # re-run with a retry: the complete shard is kept, a replica is killed again with a shard in
    # flight, the shard is re-run on the other one; every sample lands exactly once, same bytes as local.
    # (Not waiting for a new shard here: with 2 shards on 2 replicas both may finish together.)
    with kill_a_replica_mid_shard(hs, samples_of, after_a_new_shard=False) as killed:
        run_stage(proj, "extract", **slow_ray, ray_address=ray_cluster, max_retries=1)
    assert killed
    m = metrics(proj)
    assert (m["shards_resumed"], m["shards_written"]) == (1, 2)
    assert m["replicas_lost"] == 1 and m["shard_retries"] == 1, m
    assert sample_ids(hs) == list(range(NUM_PREPARED))
    assert shard_files(hs) == shard_files(extracted)
    assert first.is_file() and not list(hs.glob("*.tmp-*"))


def _nodes(*spec: tuple[float, float]) -> list[ray_fit.Node]:
    return [ray_fit.Node(f"n{i}", cpus, gpus) for i, (cpus, gpus) in enumerate(spec)]


@pytest.mark.parametrize(
    ("params", "nodes", "words"),
    [
        ({"replicas": 3}, [(1, 0), (1, 0)], ["extract.replicas (3)", "2"]),
        ({"tensor_parallel_size": 2}, [(8, 0)], ["extract.tensor_parallel_size (2)", "no GPUs"]),
        ({"replicas": 2, "tensor_parallel_size": 8, "pipeline_parallel_size": 2}, [(64, 8)] * 2,
         ["extract.replicas (2) x extract.tensor_parallel_size (8) x extract.pipeline_parallel_size (2) = 32 GPUs"]),
        ({"tensor_parallel_size": 16}, [(64, 8)] * 2, ["extract.tensor_parallel_size (16)", "pipeline_parallel_size"]),
        ({"replicas": 3, "tensor_parallel_size": 4}, [(64, 6)] * 2, ["must each fit one node", "only 2"]),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 4}, [(64, 6)] * 3,
         ["extract.pipeline_parallel_size (4) = 4 tensor-parallel groups", "only 3 fit"]),
    ],
)
def test_cluster_too_small_fails_before_loading(params: dict, nodes: list, words: list[str]):
    p = ExtractParams(engine="ray", **params)
    with pytest.raises(PipelineError) as err:
        ray_fit.replica_shape(p, _nodes(*nodes), "auto")
    for w in words:
        assert w in str(err.value), str(err.value)


def test_worked_example_two_nodes_of_8_gpus():
    """docs/SCALING.md: TP=8 x PP=2 on 2 nodes x 8 GPUs is one replica on vLLM's Ray executor."""
    p = ExtractParams(engine="ray", replicas=1, tensor_parallel_size=8, pipeline_parallel_size=2)
    shape = ray_fit.replica_shape(p, _nodes((64, 8), (64, 8)), "auto")
    assert shape == ray_fit.ReplicaShape(num_cpus=1, num_gpus=0, executor_backend="ray", on_gpu=True)
    p = ExtractParams(engine="ray", replicas=4, tensor_parallel_size=4)
    assert ray_fit.replica_shape(p, _nodes((64, 8), (64, 8)), "auto").num_gpus == 4


def test_no_cluster_is_a_clear_error(tmp_path: Path):
    """No silent fallback to a local Ray: an address with no cluster fails, naming the key."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    code = (
        "from pipeline.extraction import ray as ray_extract\nfrom pipeline.params import ExtractParams\n"
        "with ray_extract.connect(ExtractParams(engine='ray', ray_address='127.0.0.1:1')):\n    pass\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "extract.ray_address='127.0.0.1:1'" in r.stderr and "ray start --head" in r.stderr, r.stderr


def test_ray_engine_refuses_a_rank_split():
    with pytest.raises(ValueError, match="extract.world_size: 1"):
        ExtractParams(engine="ray", world_size=2, rank=1)


def test_next_batch_hands_several_shards_while_many_are_pending():
    from collections import deque

    assert ray_extract.next_batch(deque(range(40)), 2) == [0, 1, 2, 3]  # capped at MAX_SHARDS_PER_CALL
    assert ray_extract.next_batch(deque(range(6)), 1) == [0, 1, 2]  # half of what is left per replica
    assert ray_extract.next_batch(deque(range(3)), 2) == [0]  # near the end: one at a time


def test_batches_of_shards_give_the_same_bytes_as_a_local_run(prepared: Path, project_root: Path, tmp_path: Path, ray_cluster):
    """10 shards on 2 replicas: calls of several shards (each replica's engine streams from one
    shard into the next) write what a local run writes."""
    params = {**EXTRACT_PARAMS, "samples_per_shard": 2}
    local = fresh_project(project_root, tmp_path / "local")
    run_stage(local, "extract", **params)
    proj = fresh_project(project_root, tmp_path / "ray")
    run_stage(proj, "extract", **params, engine="ray", replicas=2, ray_address=ray_cluster)
    ray_files = shard_files(proj / layout.HIDDEN_STATES_DIR)
    assert len(ray_files) == 20 and ray_files == shard_files(local / layout.HIDDEN_STATES_DIR)
    m = metrics(proj)
    assert (m["shards_written"], sum(m["shards_per_replica"].values()), m["samples"]) == (10, 10, NUM_PREPARED)
    assert m["replica_calls"] < 10  # some calls carried several shards
