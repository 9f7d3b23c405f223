"""Extraction speed: the project's extract stage (vLLM) vs a plain transformers path, same prompts.

    python bench/extract_bench.py --model artifacts/model --samples 256 --seq-len 512

Both paths capture the same layers and write them to disk as safetensors shards; the
transformers path is the obvious alternative (batched forward with output_hidden_states plus a
hook for the pre-norm final state). Prints one JSON line per path and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from pipeline import layout
from pipeline.hidden_states.format import Sample, write_shard
from pipeline.params import ExtractParams, resolve_layer_ids
from pipeline.target import Target, fingerprint_model_dir, write_target
from pipeline.verification.reference.model import ReferenceModel


def make_project(root: Path, model: Path, samples: int, seq_len: int, vocab: int, seed: int) -> list[list[int]]:
    import datasets

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(seq_len)] for _ in range(samples)]
    write_target(Target(path=model.resolve(), embedded=False, fingerprint=fingerprint_model_dir(model)),
                 root / layout.TARGET_JSON)
    datasets.Dataset.from_dict({
        "sample_id": list(range(samples)),
        "source_line": list(range(1, samples + 1)),
        "input_ids": prompts,
        "loss_mask": [[1] * seq_len] * samples,
        "seq_len": [seq_len] * samples,
    }).save_to_disk(str(root / layout.PREPARED_DATASET))
    return prompts


def bench_vllm(root: Path, params: ExtractParams) -> dict:
    from pipeline.stages import extract

    with contextlib.chdir(root):
        extract.run(params)
        metrics = json.loads((layout.METRICS / "extract.json").read_text())
    return {"path": "vllm extract stage", "tok_per_s": metrics["tok_per_s"], "load_s": metrics["engine_load_s"],
            "bytes_per_token": metrics["bytes_per_token"]}


@torch.inference_mode()
def bench_transformers(model: Path, prompts: list[list[int]], layer_ids: list[int], dtype: str,
                       batch_size: int, samples_per_shard: int, out: Path) -> dict:
    t_load = time.perf_counter()
    ref = ReferenceModel.load(model, dtype)
    load_s = time.perf_counter() - t_load
    captured: dict[str, torch.Tensor] = {}
    ref.decoder_layers[-1].register_forward_hook(
        lambda _m, _i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    n_layers = len(ref.decoder_layers)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pending: list[Sample] = []
    shard = 0
    for b in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[b : b + batch_size])
        hs = ref.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        states = [captured["last"] if k == n_layers else hs[k] for k in layer_ids]
        stacked = torch.stack(states, dim=2)  # [B, T, L, H]
        for i in range(ids.shape[0]):
            pending.append(Sample(b + i, ids[i], torch.ones(ids.shape[1], dtype=torch.uint8), stacked[i].clone()))
        while len(pending) >= samples_per_shard:
            write_shard(out, shard, pending[:samples_per_shard], {})
            pending, shard = pending[samples_per_shard:], shard + 1
    if pending:
        write_shard(out, shard, pending, {})
    seconds = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts)
    return {"path": f"transformers forward (batch {batch_size}) + same shard writer", "tok_per_s": round(tokens / seconds, 1),
            "load_s": round(load_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("artifacts/model"))
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=8, help="transformers batch size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    config = json.loads((args.model / "config.json").read_text())
    layer_ids = resolve_layer_ids(None, config["num_hidden_layers"])
    params = ExtractParams(dtype=args.dtype, samples_per_shard=64)
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = make_project(root, args.model, args.samples, args.seq_len, config["vocab_size"], args.seed)
        results = [bench_vllm(root, params),
                   bench_transformers(args.model, prompts, layer_ids, args.dtype, args.batch_size, 64, root / "hf")]
    for r in results:
        print(json.dumps({**r, "samples": args.samples, "seq_len": args.seq_len, "dtype": args.dtype,
                          "layer_ids": layer_ids, "threads": torch.get_num_threads()}))
    print(json.dumps({"vllm_over_transformers": round(results[0]["tok_per_s"] / results[1]["tok_per_s"], 2)}))


if __name__ == "__main__":
    main()
