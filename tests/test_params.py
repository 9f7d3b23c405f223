"""Bad params fail on load, before any model loads, naming the key and the fix."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.params import ParamsError, load_params, resolve_layer_ids

ROOT = Path(__file__).resolve().parents[1]


def write_params(tmp_path: Path, **overrides) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        params[section][key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_shipped_params_are_valid():
    load_params(ROOT / "params.yaml")


def test_the_schema_defaults_are_params_yaml():
    """A key left out of a project's params.yaml means what the shipped params.yaml says, one story everywhere."""
    from pipeline.params import Params

    shipped = _leaves(yaml.safe_load((ROOT / "params.yaml").read_text()))
    defaults = _leaves(Params().model_dump())
    assert {k: (defaults.get(k), v) for k, v in shipped.items() if defaults.get(k) != v} == {}


@pytest.mark.parametrize(
    "override, words",
    [
        ({"extract__layer_idz": [1, 2]}, ["extract.layer_idz", "unknown key"]),
        ({"data__seq_len": 0}, ["data.seq_len", "greater than 0"]),
        ({"data__seq_len": -5}, ["data.seq_len"]),
        ({"extract__layer_ids": [4, 2]}, ["extract.layer_ids", "sorted"]),
        ({"extract__layer_ids": [2, 2, 4]}, ["extract.layer_ids", "duplicates"]),
        ({"extract__layer_ids": [3]}, ["extract.layer_ids", "at least two"]),
        ({"extract__layer_ids": [-1, 3]}, ["extract.layer_ids", ">= 0"]),
        ({"extract__rank": 2}, ["extract.rank", "world_size"]),
        ({"data__on_error": "ignore"}, ["data.on_error", "fail", "skip"]),
        ({"extract__expert_parallel": True}, ["extract.expert_parallel", "extract.tensor_parallel_size is 1"]),
    ],
)
def test_bad_params_name_the_key(tmp_path, override, words):
    with pytest.raises(ParamsError) as err:
        load_params(write_params(tmp_path, **override))
    for word in words:
        assert word in str(err.value)


def test_expert_parallel_reaches_vllm_only_when_set(tmp_path):
    """extract.expert_parallel (default off) becomes vLLM's enable_expert_parallel, with TP > 1."""
    from pipeline.extraction.vllm_compat import engine_kwargs
    from pipeline.params import ExtractParams

    assert load_params(ROOT / "params.yaml").extract.expert_parallel is False
    params = load_params(write_params(tmp_path, extract__expert_parallel=True, extract__tensor_parallel_size=2)).extract
    assert params.expert_parallel and params.tensor_parallel_size == 2
    (tmp_path / "config.json").write_text("{}")
    args = dict(model=tmp_path, layer_ids=[1, 2], scratch_dir=tmp_path / "s", dtype="bfloat16", max_model_len=64,
                max_num_seqs=2, max_num_batched_tokens=64, tensor_parallel_size=2)
    assert "enable_expert_parallel" not in engine_kwargs(**args)
    assert engine_kwargs(**args, expert_parallel=True)["enable_expert_parallel"] is True
    assert ExtractParams(expert_parallel=True, tensor_parallel_size=2).expert_parallel


def test_unknown_section_is_rejected(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"extrakt": {"layer_ids": [1, 2]}}))
    with pytest.raises(ParamsError, match="extrakt: unknown key"):
        load_params(path)


def test_layer_ids_default_and_range():
    assert resolve_layer_ids(None, 8) == [2, 4, 5, 8]
    assert resolve_layer_ids(None, 61) == [2, 30, 58, 61]
    assert resolve_layer_ids([0, 8], 8) == [0, 8]
    with pytest.raises(ParamsError, match=r"extract.layer_ids: \[9\] out of range.*8 layers"):
        resolve_layer_ids([2, 9], 8)


def test_cli_reports_bad_params_without_traceback(tmp_path):
    params = write_params(tmp_path, data__seq_len=0)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--params", str(params), "run", "prepare"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "data.seq_len" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_path_fails_before_loading(tmp_path):
    """A model.path that is not a model directory fails in the model stage with the fix."""
    params = write_params(tmp_path, model__path=str(tmp_path / "nope"))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--params", str(params), "run", "model"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "model.path" in proc.stderr and "not a directory" in proc.stderr


def test_missing_dataset_fails_with_path(tmp_path):
    """prepare names data.path when the dataset file is missing (before loading the tokenizer)."""
    params = write_params(tmp_path, data__path=str(tmp_path / "missing.jsonl"))
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--params", str(params), "run", "prepare"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "data.path" in proc.stderr and "missing.jsonl" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "embedded, words",
    [
        ({"architecture": "mamba"}, ["model.embedded.architecture", "llama", "deepseek_v3"]),
        ({"architecture": "deepseek_v3", "deepseek_v3": {"kv_lora_rank": 500}},
         ["model.embedded.deepseek_v3.kv_lora_rank + qk_rope_head_dim = 564", "[320, 512, 576]", "kv_lora_rank 512"]),
        ({"architecture": "deepseek_v3", "deepseek_v3": {"num_experts_per_tok": 9}},
         ["model.embedded.deepseek_v3.num_experts_per_tok (9)", "n_routed_experts (8)"]),
        ({"architecture": "deepseek_v3", "deepseek_v3": {"first_k_dense_replace": 8}},
         ["model.embedded.deepseek_v3.first_k_dense_replace (8)", "num_layers (8)"]),
        ({"deepseek_v3": {"n_experts": 4}}, ["model.embedded.deepseek_v3.n_experts", "unknown key"]),
    ],
)
def test_deepseek_v3_embedded_params(tmp_path, embedded, words):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in embedded.items():
        if isinstance(value, dict):
            params["model"]["embedded"][key].update(value)
        else:
            params["model"]["embedded"][key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_deepseek_v3_is_selectable_and_llama_stays_the_default(tmp_path):
    assert load_params(ROOT / "params.yaml").model.embedded.architecture == "llama"
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["embedded"]["architecture"] = "deepseek_v3"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    ds = load_params(path).model.embedded
    assert ds.architecture == "deepseek_v3" and ds.deepseek_v3.kv_lora_rank + ds.deepseek_v3.qk_rope_head_dim == 576
    params["model"]["embedded"]["deepseek_v3"]["kv_lora_rank"] = 256  # 256 + 64 = 320: also a head size vLLM runs
    path.write_text(yaml.safe_dump(params))
    assert load_params(path).model.embedded.deepseek_v3.kv_lora_rank == 256


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


# the GPU profile: what it changes against params.yaml, and nothing else
GPU_PROFILE = {
    "model.embedded.num_layers": 16, "model.embedded.hidden_size": 2048, "model.embedded.num_heads": 16,
    "model.embedded.num_kv_heads": 8, "model.embedded.intermediate_size": 5632, "model.embedded.train_steps": 200,
    "model.embedded.train_batch_size": 64, "model.embedded.train_seq_len": 512, "model.embedded.lr": 0.0003,
    "data.regenerate.enabled": True, "data.regenerate.dtype": "bfloat16", "extract.dtype": "bfloat16",
    "train.hidden_states_dtype": "bfloat16", "eval.compare_speculative_tokens": [5], "eval.decode_batch_sizes": [1, 32],
    "eval.dtype": "bfloat16", "eval.enforce_eager": False,
    "train.epochs": 20, "train.lr": 0.0003, "train.max_len": 2048,
}


def test_the_gpu_profile_is_checked_and_differs_from_params_yaml_only_where_meant():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--params", "params.gpu.yaml", "check-params"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "params.gpu.yaml: ok" in proc.stdout, proc.stdout + proc.stderr
    base = _leaves(yaml.safe_load((ROOT / "params.yaml").read_text()))
    gpu = _leaves(yaml.safe_load((ROOT / "params.gpu.yaml").read_text()))
    assert set(gpu) == set(base)
    assert {k: v for k, v in gpu.items() if v != base[k]} == GPU_PROFILE
    p = load_params(ROOT / "params.gpu.yaml")
    assert p.extract.layer_ids is None and p.eval.num_speculative_tokens == 3 and p.model.embedded.vocab_size == 1024
