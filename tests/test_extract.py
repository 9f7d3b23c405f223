"""The extract stage against real vLLM (CPU): exactness, resume, invalidation, early errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.hidden_states import format as shards
from pipeline.target import Target, sha256_file
from tests.conftest import EXTRACT_PARAMS, NUM_PREPARED, copy_project, run_stage

pytestmark = pytest.mark.slow
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_target: Target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target.path, dtype=torch.float32).eval()


@torch.no_grad()
def reference(model, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[T, L, H] in vLLM's convention from a transformers forward pass.

    id k < N is hidden_states[k]; id N is the last layer's output *before* the final norm, which
    transformers' hidden_states[N] is not (it is after the norm), hence the hook.
    """
    captured: list[torch.Tensor] = []
    layers = model.model.layers
    hook = layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        hs = model(input_ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = len(layers)
    return torch.stack([captured[0][0] if k == n else hs[k][0] for k in layer_ids], dim=1)


def all_samples(hs_dir: Path) -> list[shards.Sample]:
    return [s for p in shards.complete_shards(hs_dir) for s in shards.iter_samples(p)]


def assert_matches_reference(hs_dir: Path, model, layer_ids: list[int]) -> None:
    samples = all_samples(hs_dir)
    assert [s.sample_id for s in samples] == list(range(NUM_PREPARED))
    for s in samples:
        ref = reference(model, s.input_ids, layer_ids)
        assert s.hidden_states.shape == ref.shape
        err = (s.hidden_states - ref).abs().amax(dim=(0, 2))  # per layer
        assert err.max() <= FP32_TOL, (
            f"sample {s.sample_id}: max abs error per layer {dict(zip(layer_ids, err.tolist(), strict=True))}"
        )


def work_copy(project_root: Path, dst: Path, with_shards: bool = True) -> Path:
    parts = [layout.TARGET_JSON, layout.PREPARED_DATASET] + ([layout.HIDDEN_STATES_DIR] if with_shards else [])
    return copy_project(project_root, dst, *parts)


def test_matches_transformers_reference(extracted: Path, prepared: Path, hf_model) -> None:
    import datasets

    lengths = datasets.load_from_disk(str(prepared))["seq_len"]
    assert EXTRACT_PARAMS["max_num_batched_tokens"] < max(lengths), "the run must exercise chunked prefill"
    meta = shards.read_meta(extracted)
    assert meta["layer_ids"] == [2, 4, 5, 8]  # default [2, N//2, N-3, N] for N = 8
    assert_matches_reference(extracted, hf_model, meta["layer_ids"])


def test_shards_carry_data_and_metadata(extracted: Path, prepared: Path, extract_metrics: dict) -> None:
    import datasets

    ds = datasets.load_from_disk(str(prepared))
    samples = all_samples(extracted)
    for s in samples:
        assert s.input_ids.tolist() == ds[s.sample_id]["input_ids"]
        assert s.loss_mask.tolist() == ds[s.sample_id]["loss_mask"]
        assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.uint8
        assert s.hidden_states.dtype == torch.float32

    meta = shards.read_meta(extracted)
    assert meta["complete"] and meta["num_samples"] == NUM_PREPARED and meta["num_shards"] == 3
    assert meta["layer_id_convention"] == shards.LAYER_ID_CONVENTION
    assert (meta["hidden_size"], meta["num_layers"], meta["dtype"]) == (64, 8, "float32")
    for p in shards.complete_shards(extracted):
        m = shards.read_manifest(p)
        assert m["sha256"] == sha256_file(p) and m["run_key"] == meta["run_key"]
        assert m["layer_ids"] == meta["layer_ids"] and m["format_version"] == shards.format_version(meta["dtype"]) == 1
        with safe_open(str(p), framework="pt") as f:
            assert f.metadata()["format"] == shards.FORMAT_NAME
    assert not (extracted.parent / f"{extracted.name}.scratch").exists()

    assert extract_metrics["samples"] == NUM_PREPARED and extract_metrics["shards_written"] == 3
    assert extract_metrics["tokens"] == sum(ds["seq_len"]) and extract_metrics["tok_per_s"] > 0


def test_resume_recomputes_only_missing_shard(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = work_copy(project_root, tmp_path / "p")
    hs = proj / layout.HIDDEN_STATES_DIR
    before = {p.name: sha256_file(p) for p in hs.glob("shard-*")}
    victim = hs / shards.shard_name(1)
    victim.unlink()
    shards.manifest_path(victim).unlink()
    leftover = hs / (shards.shard_name(2) + ".tmp-crashed")
    leftover.write_bytes(b"half a shard")

    run_stage(proj, "extract", **EXTRACT_PARAMS)

    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    assert (metrics["shards_written"], metrics["shards_resumed"]) == (1, 2)
    assert not leftover.exists()
    after = {p.name: sha256_file(p) for p in hs.glob("shard-*") if p.stem != "shard-00001"}
    assert after == {k: v for k, v in before.items() if not k.startswith("shard-00001")}
    old = {s.sample_id: s for s in shards.iter_samples(extracted / shards.shard_name(1))}
    new = list(shards.iter_samples(victim))
    assert [s.sample_id for s in new] == sorted(old)
    for s in new:
        assert torch.equal(s.hidden_states, old[s.sample_id].hidden_states)
        assert torch.equal(s.input_ids, old[s.sample_id].input_ids)
    assert shards.read_meta(hs)["complete"]


def test_another_engine_schedule_writes_the_same_bytes(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    """Engine tuning changes no byte: a resumed run, or one whose engine is fed at another pace,
    batches and chunks the prompts differently. Here one request at a time, 299 tokens a step: the
    300-token sample 0 ends in a 1-token chunk, the case vLLM-cpu's split-KV attention (its
    default) computed in another order (that row's last bits differed: the container test's
    resumed extraction after `docker kill`)."""
    proj = work_copy(project_root, tmp_path / "p", with_shards=False)
    lengths = [len(s.input_ids) for s in all_samples(extracted)]
    assert lengths[0] % 299 == 1, "sample 0 must end in a 1-token chunk"

    run_stage(proj, "extract", **{**EXTRACT_PARAMS, "max_num_seqs": 1, "max_num_batched_tokens": 299})

    hs = proj / layout.HIDDEN_STATES_DIR
    names = sorted(p.name for p in extracted.iterdir())
    assert sorted(p.name for p in hs.iterdir()) == names
    differ = [n for n in names if (hs / n).read_bytes() != (extracted / n).read_bytes()]
    assert differ == [], f"another schedule wrote other bytes: {differ}"


def test_changed_layer_ids_clear_old_shards(
    extracted: Path, project_root: Path, tmp_path: Path, hf_model, capsys
) -> None:
    proj = work_copy(project_root, tmp_path / "p")
    hs = proj / layout.HIDDEN_STATES_DIR
    layer_ids = [0, 3, 8]  # also covers id 0 (embeddings)

    run_stage(proj, "extract", **EXTRACT_PARAMS, layer_ids=layer_ids)

    assert "changed: layer_ids" in capsys.readouterr().out
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    assert (metrics["shards_written"], metrics["shards_resumed"]) == (3, 0)
    assert shards.read_meta(hs)["layer_ids"] == layer_ids
    assert all(shards.read_manifest(p)["layer_ids"] == layer_ids for p in shards.complete_shards(hs))
    assert_matches_reference(hs, hf_model, layer_ids)


def test_bad_layer_ids_fail_before_engine_loads(
    project_root: Path, prepared: Path, tmp_path: Path, monkeypatch
) -> None:
    proj = work_copy(project_root, tmp_path / "p", with_shards=False)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not load for invalid params")

    monkeypatch.setattr(vllm_compat, "HiddenStatesEngine", no_engine)
    with pytest.raises(PipelineError, match=r"extract\.layer_ids: \[9\] out of range"):
        run_stage(proj, "extract", **EXTRACT_PARAMS, layer_ids=[2, 4, 9])
    assert not (proj / layout.HIDDEN_STATES_DIR).exists()
