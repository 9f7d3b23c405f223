"""Start the train stage's ranks with torch's own launcher, torchrun (torch.distributed.run), and
turn a dead rank into a PipelineError that names it and shows its last log lines.

The stage process is the torchrun agent of its node: `torchrun_argv` is the command line it
runs (the same as `torchrun <argv>` typed by hand), `run_ranks` runs it in-process, so the
agent's structured failure report (which global rank, exit code, signal) is at hand. One node:
`--standalone` (a local rendezvous on a free port). Several nodes: the static rendezvous at
node 0 (MASTER_ADDR:MASTER_PORT) with an explicit node rank, so global rank 0, the one that
writes, is local rank 0 of node 0.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from pipeline.errors import PipelineError
from pipeline.params import TrainParams

WORKER_MODULE = "pipeline.training.worker"
DEFAULT_MASTER_PORT = 29500  # torchrun's own default
# where the endpoint lives, not what is trained: left out of the run key (and DVC's train params)
RENDEZVOUS_FIELDS = frozenset({"master_addr", "master_port", "node_rank"})
LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    nproc_per_node: int
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _env_int(environ: Mapping[str, str], name: str, param: str) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise PipelineError(f"${name}={value!r} is not an integer; fix it or set train.{param} in params.yaml") from None


def rendezvous(params: TrainParams, environ: Mapping[str, str] = os.environ) -> Rendezvous:
    """This node's place in the run: params first, then torchrun's usual environment variables
    (MASTER_ADDR, MASTER_PORT, NODE_RANK, as schedulers and cluster scripts export them)."""
    if params.nnodes == 1:
        return Rendezvous(1, params.nproc_per_node)
    addr = params.master_addr or environ.get("MASTER_ADDR") or None
    port = params.master_port or _env_int(environ, "MASTER_PORT", "master_port") or DEFAULT_MASTER_PORT
    node_rank = params.node_rank if params.node_rank is not None else _env_int(environ, "NODE_RANK", "node_rank")
    if not addr:
        raise PipelineError(f"train.nnodes is {params.nnodes}: set train.master_addr (or $MASTER_ADDR) to node 0's "
                            "address, the same on every node (docs/SCALING.md)")
    if node_rank is None:
        raise PipelineError(f"train.nnodes is {params.nnodes}: set $NODE_RANK (or train.node_rank) on each node: "
                            f"0 on {addr}, then 1 .. {params.nnodes - 1} (docs/SCALING.md)")
    if not 0 <= node_rank < params.nnodes:
        raise PipelineError(f"node rank {node_rank} (train.node_rank or $NODE_RANK) must be in 0 .. {params.nnodes - 1}")
    if not 0 < port < 65536:
        raise PipelineError(f"master port {port} (train.master_port or $MASTER_PORT) must be in 1 .. 65535")
    return Rendezvous(params.nnodes, params.nproc_per_node, node_rank, addr, port)


def torchrun_argv(rdzv: Rendezvous, job_dir: Path, log_dir: Path) -> list[str]:
    """torchrun's arguments for this node. Every rank's stdout/stderr goes to its own file under
    `log_dir` (what a failure report quotes), and is tee'd to this console."""
    if rdzv.nnodes == 1:
        where = ["--standalone", "--nnodes=1"]
    else:
        where = [f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.node_rank}", "--rdzv-backend=static",
                 f"--master-addr={rdzv.master_addr}", f"--master-port={rdzv.master_port}"]
    return [*where, f"--nproc-per-node={rdzv.nproc_per_node}", "--max-restarts=0",
            f"--log-dir={log_dir}", "--redirects=3", "--tee=3", "-m", WORKER_MODULE, str(job_dir)]


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


def _rank_logs(log_dir: Path, local_rank: int) -> list[Path]:
    # torchrun's layout: <log_dir>/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log
    return sorted(log_dir.glob(f"*/attempt_*/{local_rank}/std*.log"))


def failure_report(rdzv: Rendezvous, failures: Mapping[int, object], log_dir: Path) -> str:
    """Which rank died and how, with its last log lines (from torchrun's ProcessFailure records)."""
    parts = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        parts.append(f"rank {rank} (node {rdzv.node_rank}, local rank {failure.local_rank}, pid {failure.pid}) died: {how}")
        for log in _rank_logs(log_dir, failure.local_rank):
            if lines := _tail(log):
                parts.append(f"  last lines of {log}:")
                parts += [f"    {line}" for line in lines]
    return "\n".join(parts)


def run_ranks(rdzv: Rendezvous, job_dir: Path, log_dir: Path) -> None:
    """Run this node's ranks to completion, as torchrun does; a dead rank -> PipelineError."""
    os.environ["EAGLE3_TRAIN_AGENT_PID"] = str(os.getpid())  # the workers exit if this process dies
    try:
        run(parse_args(torchrun_argv(rdzv, job_dir, log_dir)))
    except ChildFailedError as e:
        raise PipelineError(
            f"training failed on {len(e.failures)} of {rdzv.world_size} ranks:\n{failure_report(rdzv, e.failures, log_dir)}\n"
            "Complete epochs are kept: re-run to resume after the last one."
        ) from None
    except SignalException as e:
        raise PipelineError(f"training stopped by {e.sigval.name}; the ranks were stopped too; re-run to resume") from None
