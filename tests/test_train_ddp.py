"""The train stage with several processes: speculators' trainer under torchrun, DDP over gloo on CPU.

What each rank reads and writes is observed from outside the product: the 2-process runs start
with a sitecustomize.py on PYTHONPATH (written below) that, in torchrun's worker processes only,
wraps the dataset's sample read, the sampler's set_epoch and the writers, and logs each call with
the rank to a file per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.params import TrainParams
from pipeline.stages import train
from pipeline.training import torchrun
from pipeline.training.data import index_shards, split_refs
from tests.tiny_project import make_project

REPO = Path(__file__).resolve().parents[1]
# 48 samples of 48 tokens: 36 train, 12 val. One process packs max_len 192 (4 samples) per step,
# two pack 96 each (2 + 2 samples): the same tokens per optimizer step and the same 9 steps per
# epoch, so a comparable run. max_len is per process (docs/SCALING.md).
ONE = {"epochs": 4, "ttt_steps": 2, "lr": 3e-3, "max_len": 192, "val_fraction": 0.25}
TWO = {**ONE, "max_len": 96, "nproc_per_node": 2}
TRACE_ENV = "EAGLE3_TEST_TRACE"
SITECUSTOMIZE = f'''
import os
if "LOCAL_RANK" in os.environ and os.environ.get("{TRACE_ENV}"):
    import transformers
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler
    from pipeline import atomic
    from pipeline.training import data as train_data

    trace = open(os.environ["{TRACE_ENV}"] + "." + os.environ["RANK"], "a", buffering=1)
    epoch = [None]
    set_epoch, get, write, save = (Sampler.set_epoch, train_data.ShardDataset._get_raw_data,
                                   atomic.atomic_write_text, transformers.PreTrainedModel.save_pretrained)

    def traced_set_epoch(self, e):
        epoch[0] = e
        set_epoch(self, e)

    def traced_get(self, index):
        trace.write(f"read {{epoch[0]}} {{self.refs[index].sample_id}}\\n")
        return get(self, index)

    def traced_write(path, *a, **k):
        trace.write(f"write {{path}}\\n")
        return write(path, *a, **k)

    def traced_save(self, path, *a, **k):
        trace.write(f"write {{path}}\\n")
        return save(self, path, *a, **k)

    Sampler.set_epoch, train_data.ShardDataset._get_raw_data = traced_set_epoch, traced_get
    atomic.atomic_write_text, transformers.PreTrainedModel.save_pretrained = traced_write, traced_save
'''


def stage_env(tmp: Path) -> dict[str, str]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", TRACE_ENV: str(tmp / "trace"),
            "COLUMNS": "250"}  # rich wraps log lines at 80 columns otherwise


def new_project(root: Path, train_params: dict, target: Path) -> Path:
    make_project(root, n_samples=48, target=target)
    (root / "params.yaml").write_text(yaml.safe_dump({"train": train_params}))
    return root


def trace(tmp: Path, rank: int) -> list[list[str]]:
    path = tmp / f"trace.{rank}"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def processes_in(root: Path) -> list[int]:
    """Processes whose working directory is `root` (the stage and its ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == root:
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def rank_pid(root: Path, rank: int) -> int | None:
    for pid in processes_in(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK" in b" ".join(environ):
            return pid
    return None


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.is_file(), f"{path} did not appear (stage exit code {proc.poll()})"


def epoch_metrics(root: Path, epoch: int) -> dict:
    return json.loads((root / layout.DRAFT_DIR / str(epoch) / train.EPOCH_METRICS).read_text())


# --- the command line, the rendezvous (no processes) ---------------------------------------------

JOB, LOGS = Path("artifacts/.train/node0"), Path("artifacts/.train/node0/logs")
TAIL = ["--max-restarts=0", f"--log-dir={LOGS}", "--redirects=3", "--tee=3", "-m", "pipeline.training.worker", str(JOB)]


def test_torchrun_command_one_node_of_8_gpus() -> None:
    rdzv = torchrun.rendezvous(TrainParams(nproc_per_node=8), environ={"MASTER_ADDR": "ignored", "NODE_RANK": "3"})
    assert rdzv == torchrun.Rendezvous(nnodes=1, nproc_per_node=8) and rdzv.world_size == 8
    assert torchrun.torchrun_argv(rdzv, JOB, LOGS) == ["--standalone", "--nnodes=1", "--nproc-per-node=8", *TAIL]


@pytest.mark.parametrize("params,environ", [
    ({}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "NODE_RANK": "1"}),  # a scheduler's variables
    ({"master_addr": "10.0.0.1", "master_port": 29400, "node_rank": 1}, {"MASTER_ADDR": "x", "NODE_RANK": "0"}),  # params win
])
def test_torchrun_command_two_nodes_of_8_gpus(params: dict, environ: dict) -> None:
    rdzv = torchrun.rendezvous(TrainParams(nproc_per_node=8, nnodes=2, **params), environ=environ)
    assert rdzv.world_size == 16
    assert torchrun.torchrun_argv(rdzv, JOB, LOGS) == [
        "--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--master-addr=10.0.0.1", "--master-port=29400",
        "--nproc-per-node=8", *TAIL]
    # node 0 of the same run, torchrun's default port
    rdzv0 = torchrun.rendezvous(TrainParams(nproc_per_node=8, nnodes=2), environ={"MASTER_ADDR": "n0", "NODE_RANK": "0"})
    assert torchrun.torchrun_argv(rdzv0, JOB, LOGS)[:5] == [
        "--nnodes=2", "--node-rank=0", "--rdzv-backend=static", "--master-addr=n0", "--master-port=29500"]


@pytest.mark.parametrize("params,environ,match", [
    ({}, {"NODE_RANK": "0"}, r"set train.master_addr \(or \$MASTER_ADDR\)"),
    ({}, {"MASTER_ADDR": "n0"}, r"set \$NODE_RANK \(or train.node_rank\) on each node"),
    ({}, {"MASTER_ADDR": "n0", "NODE_RANK": "2"}, r"node rank 2 .* must be in 0 \.\. 1"),
    ({}, {"MASTER_ADDR": "n0", "NODE_RANK": "one"}, r"\$NODE_RANK='one' is not an integer"),
])
def test_a_multi_node_run_without_its_rendezvous_is_refused(params: dict, environ: dict, match: str) -> None:
    with pytest.raises(PipelineError, match=match):
        torchrun.rendezvous(TrainParams(nnodes=2, **params), environ=environ)


def test_rendezvous_params_are_not_in_the_run_key() -> None:
    assert torchrun.RENDEZVOUS_FIELDS <= set(TrainParams.model_fields)
    assert {"nproc_per_node", "nnodes"}.isdisjoint(torchrun.RENDEZVOUS_FIELDS)  # they change the result


# --- real runs ----------------------------------------------------------------------------------

STOCK_SETUP = (
    "from speculators.train.distributed import maybe_setup_distributed as setup; setup()"
)


@pytest.mark.slow
def test_stock_distributed_setup_needs_an_accelerator() -> None:
    """Why speculators_cpu.setup_distributed exists: speculators' own set-up fails under torchrun on CPU."""
    if not __import__("pipeline.training.speculators_cpu").training.speculators_cpu.needed():
        pytest.skip("an accelerator is present")
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    out = subprocess.run([sys.executable, "-c", STOCK_SETUP], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "Cannot access accelerator device when none is available" in out.stderr
    ours = "from pipeline.training.speculators_cpu import setup_distributed as s; s(); import torch.distributed as d; print(d.get_backend())"
    out = subprocess.run([sys.executable, "-c", ours], env={**env, "MASTER_PORT": "29531"}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-1] == "gloo", out.stderr[-2000:]


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory: pytest.TempPathFactory, cycle_target: Path) -> tuple[Path, Path, Path]:
    """The same tiny project trained by one process and by two (torchrun, traced), each through the CLI."""
    one = new_project(tmp_path_factory.mktemp("one"), ONE, cycle_target)
    two = Path(shutil.copytree(one, one.parent / "two", symlinks=True))
    (two / "params.yaml").write_text(yaml.safe_dump({"train": TWO}))
    # one thread, as torchrun gives each rank: on 2 shared cores two threads fight (27 s an epoch vs 1.3 s)
    out = subprocess.run([sys.executable, "-m", "pipeline", "train"], cwd=one, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    tmp = tmp_path_factory.mktemp("two-trace")
    out = subprocess.run([sys.executable, "-m", "pipeline", "train"], cwd=two, env=stage_env(tmp),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "torchrun --standalone --nnodes=1 --nproc-per-node=2" in out.stderr + out.stdout
    return one, two, tmp


@pytest.mark.slow
def test_two_processes_train_to_the_accuracy_of_one(one_and_two: tuple[Path, Path, Path]) -> None:
    one, two, _ = one_and_two
    a, b = (json.loads((root / train.TRAIN_METRICS).read_text()) for root in (one, two))
    assert (a["processes"], b["processes"]) == (1, 2) and a["epochs_trained"] == b["epochs_trained"] == ONE["epochs"]
    assert a["steps"] == b["steps"] == 9  # 36 train samples: 4 per step (1 x 192 tokens or 2 x 96)
    # Every sample has 48 tokens, so both runs put the same 4 samples in each optimizer step (the
    # sampler's seed + epoch permutation, packed 4 in one row or 2 + 2 over the ranks), start from
    # the same weights (seed 0; DDP broadcasts rank 0's) and average the same per-token losses:
    # the same training up to float reduction order (gloo's all-reduce of the gradients against
    # one backward over the packed row). Measured: the same val accuracy to the position, loss
    # apart by 5e-7 relative; two seeds of one process are 0.13 apart (docs/BENCHMARKS.md, "The whole
    # pipeline on one H200"). The tolerance, 2 of the 432 masked val positions and 1e-3 of the loss,
    # allows for chaos over 36 steps and nothing a different data order, a lost half or a wrong
    # gradient scale would give.
    for k in range(ONE["ttt_steps"]):
        assert abs(a["val"][f"full_acc_{k}"] - b["val"][f"full_acc_{k}"]) <= 2 / 432, (k, a["val"], b["val"])
    assert abs(a["val"]["loss"] - b["val"]["loss"]) <= 1e-3 * a["val"]["loss"]
    assert b["val"]["full_acc_0"] > 0.5  # both learned (an untrained draft: < 0.1)


@pytest.mark.slow
def test_each_rank_reads_a_disjoint_half_of_each_epoch(one_and_two: tuple[Path, Path, Path]) -> None:
    _, two, tmp = one_and_two
    train_refs, val_refs = split_refs(index_shards(two / layout.HIDDEN_STATES_DIR), TWO["val_fraction"], 0)
    train_ids, val_ids = {r.sample_id for r in train_refs}, {r.sample_id for r in val_refs}
    reads = {rank: [(int(e), int(s)) for kind, e, s in (t for t in trace(tmp, rank) if t[0] == "read")] for rank in (0, 1)}
    halves = []
    for epoch in range(TWO["epochs"]):
        mine = {rank: [s for e, s in reads[rank] if e == epoch and s in train_ids] for rank in (0, 1)}
        assert len(mine[0]) == len(set(mine[0])) == len(mine[1]) == len(set(mine[1])) == len(train_ids) // 2, epoch
        assert set(mine[0]).isdisjoint(mine[1]) and set(mine[0]) | set(mine[1]) == train_ids, epoch
        val = {rank: {s for e, s in reads[rank] if e == epoch and s in val_ids} for rank in (0, 1)}
        assert val[0].isdisjoint(val[1]) and val[0] | val[1] == val_ids, epoch
        halves.append(frozenset(mine[0]))
    assert len(set(halves)) == TWO["epochs"]  # reshuffled every epoch (seed + epoch), not a fixed split


@pytest.mark.slow
def test_only_rank_0_writes(one_and_two: tuple[Path, Path, Path]) -> None:
    _, two, tmp = one_and_two
    writes = {rank: [t[1] for t in trace(tmp, rank) if t[0] == "write"] for rank in (0, 1)}
    assert writes[1] == []
    draft = str(layout.DRAFT_DIR)
    for epoch in range(TWO["epochs"]):
        assert f"{draft}/{epoch}" in writes[0] and f"{draft}/{epoch}/{train.EPOCH_METRICS}" in writes[0]
    assert not (two / train.RUN_DIR).exists()  # the job and the ranks' logs go once the ranks succeeded


@pytest.mark.slow
def test_sigkill_of_the_whole_group_then_rerun_resumes(tmp_path: Path, cycle_target: Path) -> None:
    root = new_project(tmp_path / "p", {**TWO, "epochs": 6}, cycle_target)
    env = stage_env(tmp_path)
    cmd = [sys.executable, "-m", "pipeline", "train"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(root / layout.DRAFT_DIR / "0" / train.EPOCH_METRICS, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while processes_in(root) and time.monotonic() < deadline:  # torchrun's ranks run in sessions of their own
        time.sleep(0.1)
    assert processes_in(root) == [], "ranks outlived the stage that started them"
    done = [e for e in range(6) if (root / layout.DRAFT_DIR / str(e) / train.EPOCH_METRICS).is_file()]
    assert done and done[-1] < 5, f"the kill came too late to test a resume: {done}"
    mtimes = {e: (root / layout.DRAFT_DIR / str(e) / "model.safetensors").stat().st_mtime_ns for e in done}

    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout + out.stderr
    trainer_log = (root / "logs" / "train.log").read_text()  # speculators' own lines (pipeline/console.py)
    assert f"resuming after epoch {done[-1]}" in log and f"Resuming training on epoch {done[-1] + 1}." in trainer_log
    assert "Starting fresh training run" not in trainer_log
    assert {e: (root / layout.DRAFT_DIR / str(e) / "model.safetensors").stat().st_mtime_ns for e in done} == mtimes
    assert [epoch_metrics(root, e)["epoch"] for e in range(6)] == list(range(6))
    assert json.loads((root / train.FINAL_POINTER).read_text())["epoch"] == 5
    # the resumed epochs were again split over both ranks
    epochs_read = {rank: {int(t[1]) for t in trace(tmp_path, rank) if t[0] == "read"} for rank in (0, 1)}
    assert epochs_read[0] == epochs_read[1] == set(range(6))


@pytest.mark.slow
def test_a_dead_rank_fails_the_stage_with_its_last_log_lines(tmp_path: Path, cycle_target: Path) -> None:
    root = new_project(tmp_path / "p", {**TWO, "epochs": 8}, cycle_target)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train"], cwd=root, env=stage_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(root / layout.DRAFT_DIR / "0" / train.EPOCH_METRICS, proc)
    pid = rank_pid(root, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    error = stderr[stderr.index("[train] error:"):]
    assert f"rank 1 (node 0, local rank 1, pid {pid}) died: killed by SIGKILL" in error, error
    assert "last lines of artifacts/.train/node0/logs/" in error and "/1/stdout.log" in error
    assert "Traceback" not in stderr[stderr.index("[train] error:") - 200:stderr.index("[train] error:")]
    assert "re-run to resume" in error
    assert not (root / train.FINAL_POINTER).exists()
