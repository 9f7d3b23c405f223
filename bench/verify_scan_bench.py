"""verify's scan as the stage runs it (`pipeline.verification.scan.scan_shards`, with the stage's fit, audit choice and staging)
on synthetic shards, without a target model or an extraction: layer-coherent random states written by the project's
shard writer, the predictors fitted by `pipeline.verification.samples.fit.fit_coherence`, a random final norm and lm_head. By default
the 8B bench workload's shape (docs/BENCHMARKS.md "Verify's scan, session 12": 104 shards, 8 of 16 x 2,048 tokens and
96 of 16 x 512, 1,048,576 tokens, H 4096, 4 captured layers, vocabulary 128,256, bf16, 34.4 GB), so scan settings
are compared in a minute of a GPU instead of an extraction's five. Settings are compared within one run only; the
budget's ratio needs the extraction measured beside it (bench/gpu_extract_bench.py --jobs verifyall).

    python bench/verify_scan_bench.py --work /dev/shm/scanbench --workers 4,8 --repeat 2

Each scan runs once unmeasured first (the process's first scan: buffers, kernels), then `--repeat` times per setting,
the settings interleaved. The data are random: the per-sample judgement and the final-state rates (the stage's steps
after the scan) are not run; the scan's own structure findings must be none.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pipeline.hidden_states.format import Sample, read_manifest, write_shard
from pipeline.params import VerifyParams
from pipeline.verification.reference.model import FinalHeadModel
from pipeline.verification.samples.fit import fit_coherence
from pipeline.verification.scan import PreparedTokens, ScanContext, scan_shards, scan_threads, staging_for
from pipeline.verification.shards import audit_selection, tf32_matmuls


def write_workload(work: Path, a: argparse.Namespace, device: torch.device) -> tuple[list[Path], list, torch.Tensor]:
    """The shards (through `write_shard`: sha256 and recorded statistics as an extraction writes them), the samples'
    (ids, mask), and the embedding the states were made from (--reuse: the shards already in `work`, their ids and
    masks read back, the embedding drawn again from the seed)."""
    H, L, V = a.hidden, a.layers, a.vocab
    g = torch.Generator(device=device).manual_seed(0)
    embedding = torch.randn(V, H, generator=g, device=device) * 0.5
    if a.reuse and (files := sorted((work / "shards").glob("shard-*.safetensors"))):
        from safetensors import safe_open

        found = {}
        for path in files:
            with safe_open(str(path), framework="np") as f:
                for sid in read_manifest(path)["sample_ids"]:
                    found[sid] = (f.get_tensor(f"{sid}/input_ids"), f.get_tensor(f"{sid}/loss_mask"))
        return files, [found[sid] for sid in sorted(found)], embedding
    mix = [torch.randn(H, H, generator=g, device=device) / H**0.5 for _ in range(L)]
    lengths = [a.big_tokens] * a.big + [a.small_tokens] * a.small
    rows: list = []
    shard_dir = work / "shards"
    shutil.rmtree(shard_dir, ignore_errors=True)
    shard_dir.mkdir(parents=True)

    def shard_samples(index: int, first_id: int, tokens: int) -> list[Sample]:
        samples = []
        for k in range(a.per_shard):
            ids = torch.randint(0, V, (tokens,), generator=g, device=device)
            x, layers = embedding[ids], []
            for j in range(L):  # each layer a noisy function of the one before: the coherence the predictors fit
                x = x + 0.5 * torch.tanh(x @ mix[j]) + 0.05 * torch.randn(tokens, H, generator=g, device=device)
                layers.append(x)
            mask = torch.ones(tokens, dtype=torch.uint8)
            mask[: tokens // 4] = 0  # a prompt, then the answer the loss is on
            samples.append(Sample(first_id + k, ids.cpu(), mask, torch.stack(layers, 1).to(torch.bfloat16).cpu()))
        return samples

    with ThreadPoolExecutor(8) as pool:  # the writer hashes each shard; hashing releases the GIL
        pending, sid = [], 0
        for index, tokens in enumerate(lengths):
            samples = shard_samples(index, sid, tokens)
            rows += [(s.input_ids.numpy(), s.loss_mask.numpy()) for s in samples]
            sid += len(samples)
            pending.append(pool.submit(write_shard, shard_dir, index, samples, {"layer_ids": list(range(L))}))
            if len(pending) > 16:  # at most 16 shards' states held in memory beside those written
                pending.pop(0).result()
        for future in pending:
            future.result()
    return sorted(shard_dir.glob("shard-*.safetensors")), rows, embedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the shards are written (a tmpfs: /dev/shm/...)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--big", type=int, default=8, help="shards of --big-tokens samples (first)")
    ap.add_argument("--big-tokens", type=int, default=2048)
    ap.add_argument("--small", type=int, default=96, help="shards of --small-tokens samples")
    ap.add_argument("--small-tokens", type=int, default=512)
    ap.add_argument("--per-shard", type=int, default=16, help="samples a shard")
    ap.add_argument("--workers", default="4", help="scan threads to compare, comma-separated")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, help="results as JSON")
    ap.add_argument("--reuse", action="store_true", help="the shards already in --work (same shape options): e.g. "
                    "another revision's pipeline/ first on PYTHONPATH, compared with this tree's")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from datasets import Dataset

    t = time.perf_counter()
    files, rows, embedding = write_workload(a.work, a, device)
    written = time.perf_counter() - t
    gigabytes = sum(p.stat().st_size for p in files) / 1e9
    print(f"workload: {len(files)} shards, {sum(len(ids) for ids, _ in rows):,} tokens, {gigabytes:.1f} GB "
          f"{'found' if a.reuse else 'written'} in {written:.1f} s; pipeline from {Path(scan_shards.__code__.co_filename).parent}")
    prepared = Dataset.from_dict({"input_ids": [ids.tolist() for ids, _ in rows], "loss_mask": [m.tolist() for _, m in rows]})
    params = VerifyParams()
    layer_ids = list(range(a.layers))
    t = time.perf_counter()
    coherence = fit_coherence(files, layer_ids, a.hidden, embedding, prepared, params)
    print(f"fit: {time.perf_counter() - t:.1f} s")
    norm = torch.nn.RMSNorm(a.hidden, eps=1e-6, device=device)
    lm_head = torch.nn.Linear(a.hidden, a.vocab, bias=False, device=device)
    torch.nn.init.normal_(lm_head.weight, std=0.02)
    head = FinalHeadModel(final_norm=norm, lm_head=lm_head, device=device, seconds=0.0)
    audit = audit_selection([p.stem for p in files], params)

    def scan(workers: int) -> dict:
        context = ScanContext(layer_ids, a.hidden, torch.bfloat16, PreparedTokens(prepared), lambda: head, audit=audit,
                              final_state_positions=params.final_state_positions_per_shard, seed=params.seed)
        context.coherence = coherence
        context.staging = staging_for(context, scan_threads(workers, len(files)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with tf32_matmuls():
            scans = scan_shards(files, context, workers)
        seconds = time.perf_counter() - t
        findings = [f for s in scans for f in s.findings]
        if findings:
            raise SystemExit(f"the scan found faults in synthetic shards: {findings[:3]}")
        thread_seconds: dict = {}
        for s in scans:
            for key, value in s.seconds.items():
                thread_seconds[key] = round(thread_seconds.get(key, 0.0) + value, 3)
        return {"workers": workers, "scan_seconds": round(seconds, 3), "thread_seconds": thread_seconds,
                "positions": sum(s.counted for s in scans)}

    settings = [int(w) for w in a.workers.split(",")]
    scan(settings[0])  # the process's first scan, unmeasured
    runs = []
    for r in range(a.repeat):
        for workers in settings:
            runs.append(scan(workers))
            print(f"run {r + 1}, {workers} threads: scan {runs[-1]['scan_seconds']:.3f} s; thread-seconds "
                  f"{json.dumps(runs[-1]['thread_seconds'])}", flush=True)
    for workers in settings:
        times = [x["scan_seconds"] for x in runs if x["workers"] == workers]
        print(f"{workers} threads: scan {min(times):.3f} s best, {np.mean(times):.3f} s mean of {len(times)}")
    if a.out:
        a.out.write_text(json.dumps({"workload_gb": round(gigabytes, 2), "shards": len(files), "runs": runs,
                                     "cpus": len(os.sched_getaffinity(0)), "device": str(device)}, indent=1))


if __name__ == "__main__":
    main()
