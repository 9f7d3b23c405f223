"""extract.engine: ray: the extract stage's shards computed by `extract.replicas` vLLM engines on a Ray cluster.

The driver (the extract stage, pipeline/stages/extract.py) does everything it does for a local
run: plan the shards, keep the complete ones of the same run key (resume), write
`extract_meta.json` and the metrics. Only the shards still to do go to the replicas:

- `connect` joins the cluster at `extract.ray_address` and checks, before any engine loads, that
  `replicas` x `tensor_parallel_size` x `pipeline_parallel_size` fit its GPUs (or, on a CPU
  cluster, `replicas` fit its CPUs, one per replica); the error names the keys and the numbers
  (pipeline/extraction/ray_fit.py).
- Each replica is a Ray actor (pipeline/extraction/ray_replica.py) holding one engine, started with the same engine arguments as a
  local run (`engine.start_engine`), and computes a shard with the local code itself
  (`engine.extract_shards` with the replica's engine), so it checks and writes the shard the same
  way, atomically, into the output directory, which every node must see at the same path (shared
  storage). Same samples, same code: the same bytes as a local run (tests/test_ray_extract.py).
- Work stealing: an idle replica gets the next pending shards, up to `MAX_SHARDS_PER_CALL` at a
  time while many are pending (its engine streams from one shard into the next, so it does not
  wait for a shard's write), one at a time near the end, so a slow node simply does fewer shards.
- A lost replica (its process or node died): the shards of its call that it had not finished go
  back to the front of the queue for another replica, at most `extract.max_retries` times per
  shard; complete shards are on disk and never redone. When the retries of a shard run out, or
  no replica is left, the run stops with a report (which shards, which replicas, why); a re-run
  resumes.
- A shard that fails its checks (a PipelineError: bad data, misaligned tokens) stops the run
  as in a local run: it would fail the same way anywhere.
- One progress bar for the whole job: shards done, tok/s, ETA, live replicas.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.extraction.ray_fit import ReplicaShape, alive_nodes, replica_shape
from pipeline.extraction.ray_replica import ShardReplica, engine_env
from pipeline.hidden_states import format as shards
from pipeline.params import ExtractParams
from pipeline.progress import progress

NAMESPACE = "eagle3-extract"
CLOSE_TIMEOUT_S = 60.0
WAIT_S = 1.0
# Shards handed to a replica per call while many are pending: one shard per call left each GPU idle
# while the shard was written (0.30 of two H200s' throughput, docs/BENCHMARKS.md "Two H200s: tensor parallel,
# expert parallel, Ray replicas").
MAX_SHARDS_PER_CALL = 4


def next_batch(pending, live_replicas: int) -> list[int]:
    """The shards for the next call: several while each replica still has several to do, one at a
    time near the end (a replica left alone with a long batch would be the run's tail)."""
    size = max(1, min(MAX_SHARDS_PER_CALL, len(pending) // (2 * max(live_replicas, 1))))
    return [pending.popleft() for _ in range(min(size, len(pending)))]


def log(msg: str) -> None:
    print(f"[extract:ray] {msg}", flush=True)


class Cluster:
    """The driver's handle on the cluster (from `connect`)."""

    def __init__(self, ray, params: ExtractParams, shape: ReplicaShape) -> None:
        self.ray, self.params, self.shape = ray, params, shape

    def extract_shards(self, params, target, layer_ids, max_model_len, plan, todo, out: Path, manifest_extra):
        """Compute the `todo` shards on `params.replicas` replicas; return the stage's Progress."""
        from pipeline import layout
        from pipeline.atomic import remove_stale_temps
        from pipeline.extraction.engine import Progress

        ray = self.ray
        replica_cls = ray.remote(ShardReplica)
        opts = {"num_cpus": self.shape.num_cpus, "num_gpus": self.shape.num_gpus, "max_restarts": 0,
                "max_task_retries": 0, "runtime_env": {"env_vars": engine_env(self.shape)}}
        target = replace(target, path=Path(target.path).resolve())
        out_abs = out.resolve()  # the launcher's link resolved: the path every node must see
        run_key = manifest_extra["run_key"]
        n = min(params.replicas, len(todo))
        log(f"{len(todo)} shards to compute on {n} replica(s) ({self.shape.num_gpus:g} GPU, "
            f"{self.shape.num_cpus:g} CPU each); output {out_abs}")
        actors = {
            i: replica_cls.options(name=f"replica-{i}", **opts).remote(
                params, target, layer_ids, max_model_len, str(layout.PREPARED_DATASET.resolve()), str(out_abs),
                run_key, manifest_extra, plan, self.shape.executor_backend,
            )
            for i in range(n)
        }
        info: dict[int, dict] = {}
        starting = {actors[i].start.remote(): i for i in actors}
        in_flight: dict = {}  # ObjectRef -> (replica, shard)
        idle: deque[int] = deque()
        pending = deque(todo)
        failures: Counter[int] = Counter()
        per_replica: Counter[int] = Counter()  # shards each replica wrote
        lost: list[str] = []  # one line per lost replica
        prog = Progress()
        done = 0
        calls = 0  # extract calls handed to replicas (each of one or more shards)
        started: float | None = None
        ok = False
        bar = progress(total=len(todo), unit="shard", desc="extract (ray)", mininterval=1.0)

        def finish(i: int, m: dict) -> None:
            """A shard replica `i` wrote (its manifest `m`) counts as done, once the driver sees it."""
            nonlocal done
            path = out / m["file"]
            if not path.is_file() or path.stat().st_size != m["bytes"]:
                raise PipelineError(
                    f"replica {i} on {info[i]['host']} wrote shard {m['shard_index']}, but this driver does not see it at "
                    f"{path.resolve()}: the output must be on storage every node mounts at the same path "
                    "(docs/SCALING.md)"
                )
            done += 1
            per_replica[i] += 1
            bar.update(1)

        def lose(i: int, batch: list[int] | None, why: str) -> None:
            with contextlib.suppress(Exception):
                # an unreachable replica counts as lost too; should it still write its shard, that is
                # the same bytes, renamed into place atomically
                ray.kill(actors.pop(i), no_restart=True)
            where = info.get(i, {}).get("host", "?")
            lost.append(f"replica {i} on {where}: {why}" + (f" (was computing shard(s) {batch})" if batch else ""))
            log(f"lost {lost[-1]}")
            for k in reversed(batch or []):
                path = out / shards.shard_name(k)
                if shards.manifest_path(path).is_file():  # written before the replica was lost: complete
                    m = shards.read_manifest(path)
                    prog.samples += len(m["sample_ids"])
                    prog.tokens += sum(m["num_tokens"])
                    prog.bytes += m["bytes"]
                    finish(i, m)
                    continue
                failures[k] += 1
                if failures[k] > params.max_retries:
                    raise PipelineError(
                        f"shard {k} was lost {failures[k]} time(s), more than extract.max_retries "
                        f"({params.max_retries}); {done} of {len(todo)} shards of this run are complete in {out_abs} "
                        "and kept. Lost replicas:\n  " + "\n  ".join(lost) + "\nFix the nodes (or raise "
                        "extract.max_retries) and re-run extract: only the missing shards are computed"
                    )
                pending.appendleft(k)

        try:
            while pending or in_flight:
                while idle and pending:
                    i = idle.popleft()
                    if i not in actors:
                        continue
                    batch = next_batch(pending, len(actors))
                    in_flight[actors[i].extract.remote(batch)] = (i, batch)
                    calls += 1
                if not in_flight and not starting:
                    raise PipelineError(
                        f"no replica is left and {len(pending)} of {len(todo)} shards are not done ({done} complete "
                        f"in {out_abs}, kept). Lost replicas:\n  " + "\n  ".join(lost) + "\nFix the nodes and re-run "
                        "extract: only the missing shards are computed"
                    )
                ready, _ = ray.wait([*starting, *in_flight], num_returns=1, timeout=WAIT_S)
                for ref in ready:
                    if ref in starting:
                        i = starting.pop(ref)
                        try:
                            info[i] = ray.get(ref)
                        except ray.exceptions.RayActorError as e:
                            lose(i, None, f"died while starting ({_short(e)})")
                            continue
                        except ray.exceptions.RayTaskError as e:
                            raise _cause(e, f"replica {i} could not start its engine") from None
                        log(f"replica {i} ready on {info[i]['host']} (pid {info[i]['pid']}, "
                            f"{info[i]['load_s']:.1f} s to load)")
                        prog.load_seconds = max(prog.load_seconds, info[i]["load_s"])
                        started = started or time.monotonic()
                        idle.append(i)
                        continue
                    i, batch = in_flight.pop(ref)
                    try:
                        res = ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        lose(i, batch, f"died ({_short(e)})")
                        continue
                    except ray.exceptions.RayTaskError as e:
                        if isinstance(e.cause, PipelineError):  # the shard's own checks: fails anywhere
                            raise _cause(e, f"shard(s) {batch} (replica {i} on {info.get(i, {}).get('host')})") from None
                        # an engine error: this replica's engine is in an unknown state; retire it
                        lose(i, batch, f"failed: {_short(e)}")
                        continue
                    prog.samples += res["samples"]
                    prog.tokens += res["tokens"]
                    prog.bytes += res["bytes"]
                    for key, sec in res["time_s"].items():
                        prog.add_time(key, sec)
                    for m in res["manifests"]:
                        finish(i, m)
                    prog.seconds = time.monotonic() - (started or time.monotonic())
                    bar.set_postfix_str(f"{prog.tokens / max(prog.seconds, 1e-9):,.0f} tok/s, "
                                        f"{len(actors)}/{n} replicas", refresh=False)
                    idle.append(i)
            prog.seconds = time.monotonic() - (started or time.monotonic())
            ok = True
        finally:
            bar.close()
            self._close(actors, graceful=ok, loaded=set(info))
            # a replica killed mid-write leaves its shard's temp file: no replica is left to write
            if stale := remove_stale_temps(out):
                log(f"removed {stale} temp file(s) of lost replicas")
        prog.shard_workers = 0
        prog.extra = {"replicas": n, "replicas_lost": len(lost), "shard_retries": sum(failures.values()),
                      "replica_hosts": sorted({v["host"] for v in info.values()}),
                      "replica_nodes": len({v["node_id"] for v in info.values()}),
                      "shards_per_replica": {str(i): per_replica[i] for i in range(n)}, "replica_calls": calls}
        if lost:
            log(f"{len(lost)} replica(s) lost, {sum(failures.values())} shard(s) re-run elsewhere:\n  " + "\n  ".join(lost))
        return prog

    def _close(self, actors: dict, graceful: bool, loaded: set[int]) -> None:
        """Close the loaded engines (after a success, when all are idle), then end the actors; one
        still loading when the work ran out is ended at once."""
        ray = self.ray
        refs = []
        for a in [a for i, a in actors.items() if i in loaded] if graceful else ():
            with contextlib.suppress(Exception):
                refs.append(a.close.remote())
        with contextlib.suppress(Exception):
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for a in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _cause(e, what: str) -> PipelineError:
    cause = getattr(e, "cause", None) or e
    return PipelineError(f"{what}: {type(cause).__name__}: {cause}")


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """An explicit host:port must answer at once: ray.init would otherwise retry for minutes."""
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing answers at {address}: {e}") from None


@contextlib.contextmanager
def connect(params: ExtractParams) -> Iterator[Cluster]:
    """Join the cluster at extract.ray_address and check the replicas fit it; leave it on exit."""
    try:
        import ray
    except ImportError:
        raise PipelineError(
            "extract.engine: ray needs the `ray` package: pip install ray==2.60.0 (pinned in requirements/cpu.txt)"
        ) from None
    owned = not ray.is_initialized()
    if owned:
        try:
            _reachable(params.ray_address)
            ray.init(address=params.ray_address, namespace=NAMESPACE, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PipelineError(
                f"extract.ray_address={params.ray_address!r}: cannot join a Ray cluster there ({_short(e)}). Start "
                "one (`ray start --head` on the head node, `ray start --address <head>:6379` on the others; "
                "docs/SCALING.md) or set extract.ray_address to its address, or set extract.engine: local"
            ) from None
    try:
        shape = replica_shape(params, alive_nodes(ray), params.ray_address)
        yield Cluster(ray, params, shape)
    finally:
        if owned:
            ray.shutdown()
