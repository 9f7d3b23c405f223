"""Does this machine train the same embedded target as another? Trains it N steps with the model
stage's own code and settings and prints the weights' SHA-256 and the losses.

Usage, from the repo root (needs only torch, transformers, tokenizers and this repo; no vLLM, no DVC):

    PYTHONPATH=. python bench/determinism_probe.py [--steps 40] [--json out.json]
    PYTHONPATH=. python bench/determinism_probe.py --unpinned           # what the machine picks itself
    PYTHONPATH=. python bench/determinism_probe.py --aten default --mkl AUTO --threads 2

By default it runs exactly as `python -m pipeline run model` does: pipeline/training/cpu_determinism.py's
pins (set here before torch is imported, as the stage entry sets them) and its thread count, the
tokenizer, corpus, model and training loop of pipeline/embedded/, params.yaml's
model.embedded section (or --params). Two machines agree when `weights_sha256` is equal; with
--steps 600 (the default params) it is the hash of the stage's own artifacts/model weights
(`--hash-model-dir artifacts/model` prints that one for comparison). `init_sha256` is the
untrained model, `tokenizer_sha256` and `data_sha256` the tokenizer and token stream it trains on:
if one of those already differs, the two machines' transformers, tokenizers or torch build or
initialise differently (another version), and the training arithmetic is not what is compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from pipeline.training import cpu_determinism


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps (the stage: model.embedded.train_steps)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="its model.embedded section is used")
    ap.add_argument("--threads", type=int, default=cpu_determinism.TRAINING_THREADS)
    ap.add_argument("--unpinned", action="store_true", help="no ATEN_CPU_CAPABILITY / MKL_CBWR: the CPU's own choice")
    ap.add_argument("--aten", help="ATEN_CPU_CAPABILITY instead of the pin (default, avx2, avx512)")
    ap.add_argument("--mkl", help="MKL_CBWR instead of the pin (AUTO, COMPATIBLE, AVX2, AVX512, ...)")
    ap.add_argument("--hash-model-dir", type=Path, help="only print the weights hash of a saved model directory")
    ap.add_argument("--json", type=Path, help="also write the result here")
    return ap.parse_args()


def set_environment(args: argparse.Namespace) -> None:
    """Before torch is imported, as the stage entry does (ATen and MKL read these once)."""
    if args.unpinned:
        for name in cpu_determinism.PINNED_ENV:
            os.environ.pop(name, None)
    else:
        cpu_determinism.pin_environment()
    for name, value in (("ATEN_CPU_CAPABILITY", args.aten), ("MKL_CBWR", args.mkl)):
        if value is not None:
            os.environ[name] = value


def weights_sha256(tensors: dict) -> str:
    """SHA-256 over name, dtype, shape and bytes of every tensor, in name order (independent of file layout)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    args = parse_args()
    set_environment(args)
    import torch
    import transformers

    if args.hash_model_dir:
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(args.hash_model_dir.glob("*.safetensors")):
            tensors |= load_file(f)
        print(json.dumps({"model_dir": str(args.hash_model_dir), "weights_sha256": weights_sha256(tensors)}, indent=1))
        return

    from pipeline.embedded import corpus, tiny_deepseek_v3, tiny_llama
    from pipeline.embedded.tokenizer import corpus_texts, train_tokenizer
    from pipeline.params import load_params

    p = load_params(args.params).model.embedded.model_copy(update={"train_steps": args.steps})
    conversations = corpus.generate()
    tok = train_tokenizer(corpus_texts(conversations), p.vocab_size)
    builder = tiny_deepseek_v3 if p.architecture == "deepseek_v3" else tiny_llama
    model = builder.build_model(p, tok)
    init = weights_sha256(model.state_dict())
    ids, mask, starts = tiny_llama.encode(tok, conversations)
    data = weights_sha256({"ids": ids, "mask": mask, "starts": starts})
    t0 = time.perf_counter()
    losses = tiny_llama.train(model, ids, mask, starts, p, threads=args.threads)
    seconds = time.perf_counter() - t0
    tail = losses[-10:]
    result = {
        "weights_sha256": weights_sha256(model.state_dict()),
        "init_sha256": init,
        # the tokenizer (trained here) and the token stream it gives: equal, or the inputs differ, not the arithmetic
        "tokenizer_sha256": hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest(),
        "data_sha256": data,
        "steps": len(losses),
        "last_loss": losses[-1] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,  # the stage's metrics/model.json final_loss
        "architecture": p.architecture,
        "threads": torch.get_num_threads(),
        **cpu_determinism.in_force(),
        "transformers": transformers.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "python": sys.version.split()[0],
        "cpu": cpu_name(),
        "train_seconds": round(seconds, 1),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
