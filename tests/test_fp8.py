"""fp8 shards (extract.dtype float8_e4m3, format version 2): the quantizer's error bound, the format (version 2
written, version 1 still read, a newer version refused by name), a real vLLM extraction stored in fp8, and verify on
it: clean passes with tolerances derived from the quantization's bound, and the fault suite's classes, planted
through the project's own writer (`format.write_shard` on `format.stored` samples: sizes, sha256 and recorded
statistics agree with the wrong data), are caught as on bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction.capacity import IDS_MASK_BYTES
from pipeline.hidden_states import format as shard_format
from pipeline.hidden_states import fp8
from pipeline.hidden_states.format import Sample, complete_shards, load_sample, read_manifest, read_meta, write_shard
from pipeline.hidden_states.storage import state_bytes_per_token
from pipeline.params import ModelParams
from pipeline.target import load_target
from pipeline.verification.reference.model import ReferenceModel
from tests.conftest import EXTRACT_PARAMS, copy_project, run_stage
from tests.layer_scale import scale_layer, verify_names_the_scale

FP8 = fp8.STORAGE_DTYPE
VERIFY = {"reference_samples": 4}


# --- the quantizer and the format (no engine) ----------------------------------------------------


def test_quantization_error_is_within_its_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 1] = 0  # an all-zero row: scale 1, zeros back
    x[1, 2, :64] *= 1e-6  # values far below the row's largest: e4m3's subnormals
    q, scale = fp8.quantize(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64, 4)
    back = fp8.dequantize(q, scale)
    err = (back - x.to(torch.bfloat16).float()).abs()
    assert (err <= fp8.error_bound(back, scale)).all()
    assert (back[0, 1] == 0).all()
    # the row's largest magnitude is stored as +-448 exactly
    assert torch.allclose(q.float().abs().amax(-1)[1:], torch.full((63, 4), 448.0))


def test_rounding_variance_predicts_the_rounding_energy():
    """Summed over rows, `rounding_variance` is the squared error quantization leaves, to 2% (Gaussian rows of
    H 4096 and H 64 at scales 1e-3..1e3), recovered from the dequantized values alone or given their scales."""
    g = torch.Generator().manual_seed(1)
    for h in (4096, 64):
        x = torch.randn(256, h, generator=g) * torch.logspace(-3, 3, 256)[:, None]
        q, scale = fp8.quantize(x)
        back = fp8.dequantize(q, scale)
        measured = ((back - x) ** 2).sum(-1) / x.pow(2).sum(-1)
        for predicted in (fp8.rounding_variance(back), fp8.rounding_variance(back, scale)):
            share = predicted.sum(-1) / x.pow(2).sum(-1)
            assert abs(float(share.mean() / measured.mean()) - 1) < 0.02, (h, float(share.mean()), float(measured.mean()))
    assert torch.equal(fp8.row_scale(back), scale)


def test_rounding_gains_are_made_in_bounded_chunks():
    """The per-sample tests' rounding gains (`RoundingFloor._noise_gains`), made GAIN_CHUNK_ELEMENTS of [rows, L, H]
    at a time, equal the whole [LH, L, H] product's: at L 2 x H 2304 the rows take two chunks, the last one partial."""
    from pipeline.verification.samples.rounding import GAIN_CHUNK_ELEMENTS, RoundingFloor

    L, H, C = 2, 2304, 16
    LH = L * H
    assert GAIN_CHUNK_ELEMENTS // LH < LH < 2 * (GAIN_CHUNK_ELEMENTS // LH)
    g = torch.Generator().manual_seed(2)
    floor = RoundingFloor()
    floor.layer_ids, floor.embedding, floor._compute_cache = [4, 8], torch.zeros(1, H), {}
    floor.weights = {0: torch.randn(LH + 8, LH, generator=g) / LH**0.5}
    floor.whiteners = {(0, 0): (torch.randn(L, H, C, generator=g), torch.rand(L, C, generator=g))}
    whole = torch.eye(LH, dtype=torch.float64) - floor.weights[0][:LH].double()  # [LH, LH]: row k, column (j, h)
    vectors, w = floor.whiteners[(0, 0)]
    plain = whole.view(LH, L, H).square().sum(-1)
    whitened = torch.einsum("kjh,jhc->kjc", whole.view(LH, L, H), (vectors * w[:, None, :]).double()).square().sum(-1)
    torch.testing.assert_close(floor._noise_gains(0), plain.float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(floor._noise_gains(0, 0), whitened.float(), rtol=1e-4, atol=0)


def test_non_finite_values_stay_non_finite():
    x = torch.ones(2, 2, 8)
    x[0, 1, 3], x[1, 0, 0] = float("nan"), float("inf")
    back = fp8.dequantize(*fp8.quantize(x))
    assert back[0, 1, 3].isnan() and back[1, 0].isnan().all() and back[0, 0].eq(1).all()


def test_bytes_per_token_is_at_most_052_of_bf16_for_the_embedded_default():
    """L x (H + 4) + 9 <= 0.52 (2 L H + 9) holds for H >= 100 + 108 / L; the embedded default (4 layers captured,
    H 128) is just inside."""
    H = ModelParams().embedded.hidden_size
    L = 4  # [2, N//2, N-3, N]
    fp8_bytes = state_bytes_per_token(L, H, FP8) + IDS_MASK_BYTES
    bf16_bytes = state_bytes_per_token(L, H, "bfloat16") + IDS_MASK_BYTES
    assert H >= 100 + 108 / L and fp8_bytes / bf16_bytes <= 0.52, (H, fp8_bytes, bf16_bytes)


def sample(sid: int, T: int = 5, dtype=torch.bfloat16) -> Sample:
    g = torch.Generator().manual_seed(sid)
    return Sample(sid, torch.arange(T), torch.ones(T, dtype=torch.uint8), torch.randn(T, 3, 16, generator=g).to(dtype))


def test_version_2_written_for_fp8_only_and_both_versions_read(tmp_path: Path):
    m1 = write_shard(tmp_path, 0, [sample(0)], {})
    m2 = write_shard(tmp_path, 1, [shard_format.stored(sample(1), FP8)], {})
    assert (m1["format_version"], m2["format_version"]) == (1, 2)
    raw = load_file(str(tmp_path / m2["file"]))
    assert set(raw) == {"1/hidden_states_fp8", "1/hidden_states_scale", "1/input_ids", "1/loss_mask"}
    s1, s2 = load_sample(tmp_path / m1["file"], 0), load_sample(tmp_path / m2["file"], 1)
    assert s1.hidden_states.dtype == torch.bfloat16 and torch.equal(s1.hidden_states, sample(0).hidden_states)
    assert s2.hidden_states.dtype == torch.float32 and s2.scale is not None
    assert torch.equal(s2.hidden_states, fp8.dequantize(raw["1/hidden_states_fp8"], raw["1/hidden_states_scale"]))
    # the record is of the dequantized values
    assert m2["layer_stats"]["samples"]["1"][0][3] == float(s2.hidden_states[:, 0].max())


def test_a_newer_format_version_is_refused_naming_the_file(tmp_path: Path):
    m = write_shard(tmp_path, 0, [shard_format.stored(sample(0), FP8)], {})
    path = shard_format.manifest_path(tmp_path / m["file"])
    path.write_text(json.dumps({**m, "format_version": shard_format.FORMAT_VERSION + 1}))
    with pytest.raises(PipelineError, match=rf"{path.name}.*version {shard_format.FORMAT_VERSION + 1}.*re-run extract"):
        read_manifest(tmp_path / m["file"])


# --- a real extraction stored in fp8, and verify on it --------------------------------------------


@pytest.fixture(scope="module")
def fp8_root(extracted: Path, project_root: Path, tmp_path_factory) -> Path:
    """The shared project's target and prepared data, extracted by vLLM (bf16) and stored as fp8."""
    root = copy_project(project_root, tmp_path_factory.mktemp("fp8"), layout.TARGET_JSON, layout.PREPARED_DIR)
    run_stage(root, "extract", **{**EXTRACT_PARAMS, "dtype": FP8})
    return root


@pytest.fixture
def project(fp8_root: Path, tmp_path: Path) -> Path:
    return copy_project(fp8_root, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)


def shards(root: Path) -> list[Path]:
    return complete_shards(root / layout.HIDDEN_STATES_DIR)


def replant(shard: Path, edit) -> None:
    """Rewrite `shard` as the extractor would have, with `edit(sid, dequantized states [T, L, H]) -> new states or
    None` applied: edited samples quantized by `format.stored`, the others' stored bytes kept."""
    manifest = read_manifest(shard)
    raw = load_file(str(shard))
    extra = {k: v for k, v in manifest.items() if k not in
             ("format", "format_version", "shard_index", "file", "bytes", "sha256", "sample_ids", "num_tokens", "layer_stats")}
    samples = []
    for sid in manifest["sample_ids"]:
        s = load_sample(shard, sid)
        new = edit(sid, s.hidden_states.clone())
        if new is None:
            s = Sample(sid, s.input_ids, s.loss_mask, raw[f"{sid}/hidden_states_fp8"], None, raw[f"{sid}/hidden_states_scale"])
        else:
            s = shard_format.stored(Sample(sid, s.input_ids, s.loss_mask, new.contiguous()), FP8)
        samples.append(s)
    write_shard(shard.parent, manifest["shard_index"], samples, extra)


def verify(root: Path, **params) -> dict:
    run_stage(root, "verify", **{**VERIFY, **params})
    return json.loads((root / layout.METRICS / "verify.json").read_text())


def verify_fails(root: Path, check: str, *words: str, **params) -> str:
    with pytest.raises(PipelineError) as err:
        run_stage(root, "verify", **{**VERIFY, **params})
    message = str(err.value)
    assert f"[{check}]" in message, message
    for word in words:
        assert word in message, message
    assert not (root / layout.VERIFY_VERDICT).exists()
    return message


@pytest.mark.slow
def test_fp8_extraction_writes_version_2_at_half_the_bytes(fp8_root: Path, extracted: Path):
    meta = shard_format.read_meta(fp8_root / layout.HIDDEN_STATES_DIR)
    assert meta["dtype"] == FP8 and meta["format_version"] == 2 and meta["run_key_fields"]["dtype"] == FP8
    bf16_like = shard_format.read_meta(extracted)
    L, H = len(meta["layer_ids"]), meta["hidden_size"]
    metrics = json.loads((fp8_root / layout.METRICS / "extract.json").read_text())
    assert metrics["bytes_per_token"] <= L * (H + 4) + IDS_MASK_BYTES + 20  # + the format's per-sample overhead
    for shard in shards(fp8_root):
        m = read_manifest(shard)
        assert m["format_version"] == 2
        for sid in m["sample_ids"]:
            s = load_sample(shard, sid)
            ref = load_sample(extracted / shard.name, sid) if bf16_like["dtype"] == "float32" else None
            if ref is not None:  # the fp32 extraction of the same samples: within the engine's bf16 error + the bound
                err = (s.hidden_states - ref.hidden_states).norm() / ref.hidden_states.norm()
                assert err < 2 * fp8.REL_ERROR, (sid, float(err))


@pytest.mark.slow
def test_fp8_states_are_the_engines_bf16_states_quantized(fp8_root: Path, project_root: Path, tmp_path_factory):
    """The connector quantizes what the engine captured, with the project's quantizer, before the states leave the
    engine's process: an fp8 run stores exactly `fp8.quantize` of a bf16 run's states, sample for sample."""
    bf16 = copy_project(project_root, tmp_path_factory.mktemp("bf16"), layout.TARGET_JSON, layout.PREPARED_DIR)
    run_stage(bf16, "extract", **{**EXTRACT_PARAMS, "dtype": "bfloat16"})
    compared = 0
    for shard in shards(fp8_root):
        stored, ref = load_file(str(shard)), load_file(str(bf16 / layout.HIDDEN_STATES_DIR / shard.name))
        for sid in read_manifest(shard)["sample_ids"]:
            q, scale = fp8.quantize(ref[f"{sid}/hidden_states"])
            assert torch.equal(stored[f"{sid}/hidden_states_fp8"].view(torch.uint8), q.view(torch.uint8)), sid
            assert torch.equal(stored[f"{sid}/hidden_states_scale"], scale), sid
            compared += 1
    assert compared == sum(len(read_manifest(p)["sample_ids"]) for p in shards(fp8_root)) > 0


@pytest.mark.slow
def test_clean_fp8_extraction_passes_with_derived_tolerances(project: Path):
    metrics = verify(project, audit_fraction=1.0)
    assert metrics["passed"] and metrics["dtype"] == FP8, metrics
    for row in metrics["layers"].values():
        # allowed = bf16_error_ratio x the independent bf16 reference's error + the quantization's bound
        assert 2**-5 < row["quantization_bound"] < 2**-4  # between half and all of e4m3's relative step
        assert row["rel_rms_error"] <= row["allowed"]
        assert row["allowed"] == pytest.approx(4.0 * row["calibration_rel_rms_error"] + row["quantization_bound"])
    assert "calibration_argmax_agreement" in metrics


def _edit_all(fn):
    return lambda sid, h: fn(h)


@pytest.mark.slow
@pytest.mark.parametrize("fault, check, words", [
    ("nan", "values", ("NaN",)),
    ("inf", "values", ("NaN",)),  # e4m3fn has no Inf: the row's scale is Inf and the row dequantizes to NaN
    ("zero_layer", "values", ("all zeros",)),
    ("layers_swapped", "reference", ()),
    ("shifted", "reference", ("position t-1",)),
    ("final_norm", "reference", ("layer=8", "final norm was applied")),
    ("noise_10pct", "reference", ("relative error", "fp8 quantization's bound")),
])
def test_fault_is_caught_on_fp8(project: Path, fault: str, check: str, words: tuple):
    target = load_target(project / layout.TARGET_JSON)

    @torch.no_grad()
    def plant(h: torch.Tensor) -> torch.Tensor:
        if fault in ("nan", "inf"):
            h[3, 2, 5] = float(fault)
        elif fault == "zero_layer":
            h[:, 1] = 0
        elif fault == "layers_swapped":
            h[:, [1, 2]] = h[:, [2, 1]]
        elif fault == "shifted":
            h[1:] = h[:-1].clone()
        elif fault == "final_norm":
            h[:, -1] = ReferenceModel.load(target.path, "float32").final_norm(h[:, -1])
        elif fault == "noise_10pct":  # 10% relative noise on every value: over the bound the check allows
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(h.shape, generator=g)
            h = h + noise * h.abs() * 0.10
        return h

    victims = shards(project) if check == "reference" else shards(project)[2:3]
    for shard in victims:
        replant(shard, _edit_all(plant))
    verify_fails(project, check, *words)


@pytest.mark.slow
def test_a_layer_scaled_by_2pct_is_caught_on_fp8(project: Path):
    """Inside the quantization's per-element tolerance, but not inside the projection ratio's bound."""
    scale_layer(project, 1, 1.02)
    verify_names_the_scale(project, read_meta(project / layout.HIDDEN_STATES_DIR)["layer_ids"][1], **VERIFY)


@pytest.mark.slow
def test_changed_recorded_statistics_and_hash_are_caught_on_fp8(project: Path):
    shard = shards(project)[0]
    m = json.loads(shard_format.manifest_path(shard).read_text())
    m["layer_stats"]["samples"][str(m["sample_ids"][0])][1][3] *= 2
    shard_format.manifest_path(shard).write_text(json.dumps(m))
    verify_fails(project, "structure", "recorded statistics differ from the bytes", audit_fraction=1.0)
    m["sha256"] = "0" * 64
    shard_format.manifest_path(shard).write_text(json.dumps(m))
    verify_fails(project, "structure", "sha256", audit_fraction=1.0)


@pytest.mark.slow
def test_a_bf16_shard_in_an_fp8_run_is_caught(project: Path):
    shard = shards(project)[0]
    manifest = read_manifest(shard)
    extra = {k: v for k, v in manifest.items() if k not in
             ("format", "format_version", "shard_index", "file", "bytes", "sha256", "sample_ids", "num_tokens", "layer_stats")}
    samples = [load_sample(shard, sid) for sid in manifest["sample_ids"]]
    for s in samples:
        s.hidden_states, s.scale = s.hidden_states.to(torch.bfloat16), None
    write_shard(shard.parent, manifest["shard_index"], samples, extra)
    verify_fails(project, "structure", "dtype torch.bfloat16", "float8_e4m3fn")


def test_plan_knows_the_fp8_bytes_per_token():
    """What `make plan` projects (pipeline/extraction/capacity.py, the planner's bytes): L x (H + 4) + 9 per token, the
    format's overhead measured on a shard the real writer wrote in fp8."""
    from pipeline.extraction.capacity import Projection, measure_overhead

    got = {d: Projection(1000, 1_000_000, 4, 7168, d, measure_overhead(None, 4, 7168, d, 64)) for d in ("bfloat16", FP8)}
    assert got[FP8].bytes_per_token == 4 * (7168 + 4) + IDS_MASK_BYTES
    assert got[FP8].bytes_per_token / got["bfloat16"].bytes_per_token <= 0.52
    assert 0 < got[FP8].overhead.per_sample and got[FP8].bytes < 0.52 * got["bfloat16"].bytes


@pytest.mark.slow
def test_export_of_fp8_shards_is_dequantized_and_says_so(fp8_root: Path, tmp_path: Path):
    import contextlib

    from speculators.train.data import ArrowDataset

    from pipeline.hidden_states.export import EXPORT_META, export

    out = tmp_path / "spec09"
    with contextlib.chdir(fp8_root):
        side = export("speculators-0.9", out)
    assert side["dtype"] == FP8 and side["exported_dtype"] == "float32" and side["source_format_version"] == 2
    assert json.loads((out / EXPORT_META).read_text())["exported_dtype"] == "float32"
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32)
    shard = shards(fp8_root)[0]
    s = load_sample(shard, read_manifest(shard)["sample_ids"][0])
    assert torch.equal(ds[s.sample_id]["verifier_last_hidden_states"], s.hidden_states[:, -1])


@pytest.mark.slow
def test_fp8_states_without_a_fitting_scale_are_caught(project: Path):
    from safetensors.torch import save_file

    from pipeline.target import sha256_file

    shard = shards(project)[1]
    manifest = read_manifest(shard)
    tensors = load_file(str(shard))
    sid = manifest["sample_ids"][0]
    tensors[f"{sid}/hidden_states_scale"] = tensors[f"{sid}/hidden_states_scale"][:, :1].contiguous()  # [T, 1]
    save_file(tensors, str(shard), metadata={"format": manifest["format"], "format_version": "2"})
    manifest.update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    shard_format.manifest_path(shard).write_text(json.dumps(manifest))
    verify_fails(project, "structure", "hidden_states_scale is F32", f"sample={sid}")


@pytest.mark.slow
def test_train_and_eval_stages_read_fp8_shards(tmp_path: Path, cycle_target: Path):
    """The train stage reads fp8 shards themselves (no dequantized copy on disk) and eval serves its draft: the
    tiny cycle target of tests/tiny_project.py, its states stored as the extract stage stores fp8."""
    from tests.tiny_project import make_project

    root = make_project(tmp_path / "p", n_samples=16, n_heldout=2, dtype=FP8, target=cycle_target)
    assert all(read_manifest(p)["format_version"] == 2 for p in shards(root))
    before = sorted(p.relative_to(root) for p in (root / layout.HIDDEN_STATES_DIR).iterdir())
    run_stage(root, "train", epochs=1, ttt_steps=2, lr=5e-3, max_len=64, val_fraction=0.25)
    assert sorted(p.relative_to(root) for p in (root / layout.HIDDEN_STATES_DIR).iterdir()) == before
    run_stage(root, "eval", num_speculative_tokens=2, num_prompts=2, max_tokens=8)
    trained = json.loads((root / layout.METRICS / "train.json").read_text())
    evaluated = json.loads((root / layout.METRICS / "eval.json").read_text())
    assert trained and evaluated["tau"] >= 1
