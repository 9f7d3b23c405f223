"""CPU cost of verify's per-sample scoring (`Coherence.score_samples`: a shard's samples in one batch), this tree
against an older commit's pipeline/verification/samples/scores.py (or pipeline/verify_samples.py), on random layer-coherent data of a given shape: predictors fitted
by each, then the same samples scored by both (the scores are compared, not judged; compute in fp32, and in bf16 as on
a GPU with --bf16; states stored as F32 or, as an 8B extraction stores them, --stored BF16).

    python bench/verify_sample_scoring.py --rev 43cf16e --hidden 1024 --layers 4 --tokens 640 --samples 16

--device cuda: the tree alone (no --rev) scored on a GPU, each batch timed to its end; with --profile, the batch's
kernels (torch.profiler), the GPU's own time per operation, on one stream and nothing else running: an 8B shard's batch
is `--hidden 4096 --layers 4 --tokens 512 --samples 20 --stored BF16`.

--traffic: what a GPU would run of a batch's scoring, counted from the operations themselves (torch's dispatch, on the
CPU): per operation its calls and the bytes it reads and writes, in units of one [n, L, H] fp32 tensor (n judged
rows), the products apart with their flops. On an H200 the passes outside the products were 40% of the scan's GPU time
(kernel profile of the 8B shape's scan, 2026-12-04): this is how a change to them is weighed without one.
"""

import argparse
import collections
import importlib.util
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.verification.host_staging import HostStaging
from pipeline.verification.samples.scores import INDICES_PER_ROW

PRODUCTS = {"mm", "bmm", "addmm", "baddbmm"}


class Traffic(TorchDispatchMode):
    """Per aten operation: calls, bytes read, bytes written, flops (products). Views move nothing; an `out=` argument
    is written, not read; a broadcast input is read once (its storage, where smaller than the view); a gather or a
    scatter moves its rows, not the whole tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict = collections.defaultdict(lambda: [0, 0, 0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = schema.name.split("::")[-1]
        if name in ("empty", "empty_strided") or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # an allocation or a view: nothing moves
        values = list(args) + [kwargs.get(arg.name) for arg in schema.arguments[len(args):]]
        scattered = name in ("index_put_", "index_add_")  # only the indexed rows of `self` move
        read = sum(size(t) for arg, value in zip(schema.arguments, values, strict=False)
                   if not (arg.alias_info is not None and arg.alias_info.is_write and (arg.kwarg_only or scattered))
                   for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        written = size(values[3 if name == "index_add_" else 2]) if scattered else \
            sum(size(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if name in ("index", "index_select"):  # a gather reads the rows it writes (and its indices), not all of `self`
            read = written + sum(size(t) for t in tree_flatten(values[1:])[0] if isinstance(t, torch.Tensor))
        flops = 0.0
        if name in PRODUCTS:
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
            flops = 2.0 * a.numel() * b.shape[-1]
        row = self.ops[name]
        row[0] += 1
        row[1] += read
        row[2] += written
        row[3] += flops
        return out


class Calls(TorchFunctionMode):
    """Python-level calls into torch (functions, methods, views, indexing), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def size(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def traffic_table(label: str, traffic: Traffic, unit: int) -> None:
    print(f"{label}: {'operation':24s} {'calls':>6s} {'read':>7s} {'written':>8s} {'GFLOP':>8s}   (bytes in [n, L, H] fp32 units)")
    passes = [0, 0.0, 0.0]
    for name, (calls, read, written, flops) in sorted(traffic.ops.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"{'':{len(label) + 2}s}{name:24s} {calls:6d} {read / unit:7.2f} {written / unit:8.2f} {flops / 1e9:8.1f}")
        if name not in PRODUCTS:
            passes = [passes[0] + calls, passes[1] + read / unit, passes[2] + written / unit]
    total = sum(v[3] for v in traffic.ops.values()) / 1e9
    print(f"{label}: outside the products {passes[0]} operations, {passes[1]:.2f} read + {passes[2]:.2f} written = "
          f"{passes[1] + passes[2]:.2f} units; products {total:.1f} GFLOP")


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", help="an older commit to compare with (CPU)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=640)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="score with bf16 predictors, as on a GPU")
    ap.add_argument("--stored", choices=("F32", "BF16"), default="F32", help="the states' dtype in the shards")
    ap.add_argument("--traffic", action="store_true", help="count each operation's bytes and flops (see above)")
    ap.add_argument("--calls", action="store_true", help="count the Python calls into torch a shard's scoring makes (each "
                    "cost a scan thread ~0.25 ms on a GPU host under the scan's 8 threads, mostly outside the GIL)")
    ap.add_argument("--device", default="cpu", help="where the scoring runs (the samples stay on the host, as in shards)")
    ap.add_argument("--profile", action="store_true", help="the batch's kernels on the GPU (--device cuda)")
    ap.add_argument("--torch-threads", type=int, help="torch's intra-op threads (its CPU operations: the rows' gather)")
    ap.add_argument("--threads", type=int, default=1, help="also score from this many threads at once, as the scan does "
                    "(each --repeat batches, a staging buffer each): batches a second against one thread's")
    a = ap.parse_args()
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    modules = {}
    if a.rev:
        for path in ("pipeline/verification/samples/scores.py", "pipeline/verify_samples.py"):  # a commit before the layout
            shown = subprocess.run(["git", "show", f"{a.rev}:{path}"], capture_output=True, text=True)
            if shown.returncode == 0:
                break
        shown.check_returncode()
        old_source = shown.stdout
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "old.py").write_text(old_source)
            modules[a.rev] = load(Path(tmp) / "old.py", "old_verify_samples")
    modules["tree"] = load(Path("pipeline/verification/samples/scores.py"), "tree_verify_samples")
    device = torch.device(a.device)
    done = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    H, L, V = a.hidden, a.layers, 1000
    torch.manual_seed(0)
    embedding = torch.randn(V, H).to(device)
    mix = [(torch.randn(H, H) / H**0.5).to(device) for _ in range(L)]

    def sample(tokens: int) -> tuple[np.ndarray, torch.Tensor]:
        ids = torch.randint(0, V, (tokens,))
        x, layers = embedding[ids.to(device)], []
        for j in range(L):  # each layer a noisy function of the one before: the coherence the predictors fit
            x = x + 0.5 * torch.tanh(x @ mix[j]) + 0.05 * torch.randn(tokens, H).to(device)
            layers.append(x)
        states = torch.stack(layers, 1).cpu()  # on the host, as a shard's rows are
        return (states.to(torch.bfloat16).view(torch.int16) if a.stored == "BF16" else states).numpy(), ids

    samples = [sample(a.tokens) for _ in range(a.samples)]
    items = [(i, h, a.stored, ids) for i, (h, ids) in enumerate(samples)]
    results = {}
    for label, module in modules.items():
        coherence = module.Coherence(list(range(L)), embedding, 4, 0)
        if a.bf16 and hasattr(coherence, "compute_dtype"):  # the GPU's compute dtype, on the CPU
            coherence.compute_dtype = torch.bfloat16
        coherence.fit((coherence.fold(i), i, coherence.inputs(h[1:], a.stored, ids[1:])[1]) for i, (h, ids) in enumerate(samples))
        if a.bf16 and not hasattr(coherence, "compute_dtype"):  # revisions before it: their caches made by hand
            for fold in range(2):
                w = coherence.weights[fold]
                rows = w[: L * H].reshape(L, H, -1)
                coherence._compute_cache[fold] = (w, w.to(torch.bfloat16), (rows[:-1] - rows[1:]).to(torch.bfloat16))
                for half in range(2):
                    vectors, scales = coherence.whiteners[(fold, half)]
                    coherence._compute_cache[(fold, half)] = (vectors, vectors.to(torch.bfloat16), scales)
        coherence.score_samples(items[:2])  # first use
        runs = []
        for _ in range(a.repeat):
            done()
            wall = time.perf_counter()
            results[label] = coherence.score_samples(items)
            done()
            runs.append(time.perf_counter() - wall)
        print(f"{label}: {min(runs):.4f} s per shard batch ({len(items)} samples x {a.tokens} tokens; best of {a.repeat}; "
              f"all {', '.join(f'{r:.4f}' for r in runs)})")
        if a.threads > 1:
            staging = HostStaging(a.threads, items[0][1][1:].nbytes * len(items), INDICES_PER_ROW * a.tokens * len(items),
                                  pinned=device.type == "cuda")

            def scoring_thread(_coherence=coherence, _staging=staging) -> None:
                for _ in range(a.repeat):
                    with _staging.buffer() as buffer:
                        _coherence.score_samples(items, staging=buffer)

            with ThreadPoolExecutor(a.threads) as pool:  # once to warm each thread's stream and buffer, then timed
                list(pool.map(lambda _: scoring_thread(), range(a.threads)))
                done()
                wall = time.perf_counter()
                list(pool.map(lambda _: scoring_thread(), range(a.threads)))
                done()
                wall = time.perf_counter() - wall
            rate = a.threads * a.repeat / wall
            print(f"{label}: {a.threads} threads {rate:.1f} batches/s against one thread's {1 / min(runs):.1f} "
                  f"({rate * min(runs):.2f}x)")
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                coherence.score_samples(items)
                done()
            print(prof.key_averages().table(sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                            row_limit=40, max_name_column_width=60))
        if a.calls:
            calls = Calls()
            with calls:
                coherence.score_samples(items)
            print(f"{label}: {sum(calls.calls.values())} calls into torch for one shard's scoring: "
                  + ", ".join(f"{name} {count}" for name, count in calls.calls.most_common()))
        if a.traffic:
            traffic, rows, scored = Traffic(), [], coherence._score_batch

            def counted(dtype, batch, *staged, _scored=scored, _traffic=traffic, _rows=rows):
                _rows.append(sum(len(item[3]) for item in batch))
                with _traffic:
                    return _scored(dtype, batch, *staged)

            coherence._score_batch = counted
            coherence.score_samples(items)
            traffic_table(label, traffic, sum(rows) * L * H * 4)
    if not a.rev:
        return
    old, new = results[a.rev], results["tree"]
    same = all(torch.equal(o.shares, n.shares) and torch.equal(o.exchange, n.exchange) for o, n in zip(old, new, strict=True))
    diff = max(float((o.shares - n.shares).abs().max() / o.shares.abs().max()) for o, n in zip(old, new, strict=True))
    print(f"scores bit-identical: {same}; largest relative difference {diff:.2e}")


if __name__ == "__main__":
    main()
