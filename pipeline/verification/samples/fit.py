"""What the per-sample tests need before the scan: the target's input embedding and the coherence predictors
fitted on a seeded subset of the run's rows (pipeline/verification/samples/scores.py scores with them)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError
from pipeline.hidden_states.format import read_header, read_manifest
from pipeline.verification.reference.model import tensor_locations
from pipeline.verification.samples.scores import Coherence
from pipeline.verification.shard_view import ShardView


def load_embedding(path: Path, trust_remote_code: bool = False, device: str | None = None) -> torch.Tensor:
    """The target's input embedding matrix [V, H] (as stored), read from the checkpoint by the
    name the model's own input-embedding module has (built on the meta device)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    weight = skeleton.get_input_embeddings().weight
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    locations = tensor_locations(path)
    found = next((n for n in names if n in locations), None)
    if found is None:
        raise FileNotFoundError(f"{path}: the input embedding {names} is not in the checkpoint")
    with safe_open(str(locations[found]), framework="pt", device=str(device)) as f:
        return f.get_tensor(found)


def fit_coherence(files: list[Path], layer_ids: list[int], hidden_size: int, embedding: torch.Tensor, prepared, params,
                  quantized: bool = False) -> Coherence:
    """Fit the predictors on up to `coherence_fit_tokens` sampled rows of seeded samples (samples of
    the wrong shape are left to the structure check)."""
    coherence = Coherence(layer_ids, embedding, params.sample_stride, params.seed, quantized)
    want = (len(prepared), len(layer_ids), hidden_size)
    order = sorted(files)
    random.Random(params.seed).shuffle(order)

    def chunks():
        taken = 0
        for path in order:
            try:
                manifest = read_manifest(path)
                header, start = read_header(path)
            except (OSError, ValueError, KeyError, PipelineError):  # a newer format version: the scan reports it
                continue
            view = ShardView(np.memmap(path, dtype=np.uint8, mode="r"), header, start)
            for sid in manifest.get("sample_ids", []):
                entry = view.header.get(f"{sid}/hidden_states")  # fp8 states under this name too (logical header)
                ids_entry = header.get(f"{sid}/input_ids")
                if entry is None or ids_entry is None or not 0 <= sid < want[0] or len(entry["shape"]) != 3 \
                        or tuple(entry["shape"][1:]) != want[1:] or entry["shape"][0] != ids_entry["shape"][0]:
                    continue
                if entry["shape"][0] < 2:
                    continue
                ids = view.tensor(f"{sid}/input_ids")
                rows = np.array(view.numpy(f"{sid}/hidden_states")[1:])  # every position but the first: more rows per sample
                _, x = coherence.inputs(rows, view.kind(f"{sid}/hidden_states"), ids[1:].clamp(0, len(embedding) - 1))
                if not torch.isfinite(x).all():
                    continue  # left to the values check
                yield coherence.fold(sid), sid, x
                taken += x.shape[0]
                if taken >= params.coherence_fit_tokens:
                    return

    coherence.fit(chunks())
    return coherence
