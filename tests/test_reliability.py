"""Reliability cases not covered elsewhere (docs/RELIABILITY.md lists them all):

- two extract runs on one output: the second is refused by the lock, the first completes;
- the output disk fills up mid-run: a clear error, no truncated shard at a final name, a rerun completes;
- untrusted files: a malicious pickle (as a shard, or as model weights) is refused, never executed;
  `trust_remote_code` is off unless model.trust_remote_code turns it on.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import SafetensorError

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction.output import no_space_reason
from pipeline.hidden_states import format as shards
from pipeline.target import sha256_file
from pipeline.workflow.output_guard import lock_path
from tests.conftest import EXTRACT_PARAMS, NUM_PREPARED, TINY, copy_project, run_stage

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_SHARD = 3
NUM_SHARDS = -(-NUM_PREPARED // SAMPLES_PER_SHARD)


def extract_cmd(proj: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "--params", "params.yaml", "run", "extract"],
        cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def run_extract(proj: Path, **popen) -> subprocess.CompletedProcess:
    p = extract_cmd(proj, **popen)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def new_project(project_root: Path, dst: Path) -> Path:
    proj = copy_project(project_root, dst, layout.TARGET_JSON, layout.PREPARED_DATASET)
    section = {**EXTRACT_PARAMS, "samples_per_shard": SAMPLES_PER_SHARD}
    (proj / "params.yaml").write_text(yaml.safe_dump({"extract": section, "runtime": {"mode": "native"}}))
    return proj


def assert_complete_and_verified(proj: Path) -> None:
    hs = proj / layout.HIDDEN_STATES_DIR
    assert not hs.is_symlink() and not (proj / "artifacts" / ".partial").exists()
    meta = shards.read_meta(hs)
    assert meta["complete"] and meta["num_shards"] == NUM_SHARDS
    ids = [sid for p in shards.complete_shards(hs) for sid in shards.read_manifest(p)["sample_ids"]]
    assert sorted(ids) == list(range(NUM_PREPARED)), "a sample is missing or duplicated"
    run_stage(proj, "verify", reference_samples=2)
    assert json.loads((proj / layout.VERIFY_VERDICT).read_text())["passed"] is True


# ------------------------------------------------------------------------------------ concurrent runs


@pytest.mark.slow
def test_second_concurrent_extract_is_refused_by_the_lock(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = new_project(project_root, tmp_path / "p")
    lock = lock_path(proj / layout.HIDDEN_STATES_DIR)
    first = extract_cmd(proj)
    try:
        deadline = time.monotonic() + 120
        while not (lock.is_file() and f"pid {first.pid} " in lock.read_text()):
            assert first.poll() is None, f"the first run ended early: {first.communicate()}"
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        second = run_extract(proj)
        still_running = first.poll() is None
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert still_running, "the first run ended before the second was refused: the test proved nothing"
    assert second.returncode == 1, f"{second.stdout[-2000:]}\n{second.stderr[-2000:]}"
    msg = second.stderr
    assert "[extract] error: another extract run is writing artifacts/hidden_states" in msg, msg
    assert str(Path("artifacts") / "hidden_states.lock") in msg and f"pid {first.pid}" in msg, msg
    assert "Wait for it to finish" in msg and "Traceback" not in msg, msg
    assert "[extract]" not in second.stdout, "the refused run must not start the stage"
    assert first.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    metrics = json.loads((proj / layout.METRICS / "extract.json").read_text())
    assert (metrics["shards_written"], metrics["shards_resumed"]) == (NUM_SHARDS, 0)
    assert_complete_and_verified(proj)
    # the kernel released the lock with its holder: the next run takes it (and resumes everything)
    again = run_extract(proj)
    assert again.returncode == 0, again.stderr[-3000:]


def test_lock_is_exclusive_and_released(tmp_path: Path, monkeypatch) -> None:
    from pipeline.workflow.output_guard import output_locks

    monkeypatch.chdir(tmp_path)
    out = Path("artifacts/hidden_states")
    with output_locks("extract", [out]):
        assert f"pid {os.getpid()} " in lock_path(out).read_text()
        with pytest.raises(PipelineError, match=r"another extract run .*/hidden_states\.lock \(holder: pid \d+"):
            with output_locks("extract", [out]):
                pass
        assert not out.exists(), "the refused run touched the output"
    assert not lock_path(out).exists(), "the holder removes its lock file when it is done"
    with output_locks("extract", [out]):  # released on exit
        pass


# ------------------------------------------------------------------------------------ disk full


def _limit_file_size(limit: int):
    def preexec() -> None:  # in the child before exec; CPython ignores SIGXFSZ, so writes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.mark.slow
def test_output_disk_full_fails_clearly_and_rerun_completes(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = new_project(project_root, tmp_path / "p")
    meta = shards.read_meta(extracted)
    per_token = len(meta["layer_ids"]) * meta["hidden_size"] * 4 + 9  # fp32 states + int64 id + uint8 mask
    # vLLM's per-request files (one sample of <= 300 tokens) fit; a 3-sample shard holding the
    # 300-token sample 0 and the 20-token sample 1 (tests/conftest.py) does not
    limit = 310 * per_token + 4096
    r = run_extract(proj, preexec_fn=_limit_file_size(limit))
    assert r.returncode == 1, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    msg = r.stderr
    assert "[extract] error: writing to artifacts/hidden_states" in msg, msg[-3000:]
    assert "file size limit" in msg and "free space there" in msg and "Traceback" not in msg, msg[-3000:]

    hs = proj / layout.HIDDEN_STATES_DIR
    names = sorted(p.name for p in hs.iterdir())
    for p in hs.glob("shard-*.safetensors"):  # nothing half-written at a final name
        m = shards.read_manifest(p)  # every data file has its manifest (written after it)
        assert (m["bytes"], m["sha256"]) == (p.stat().st_size, sha256_file(p)), names
    assert 0 not in {int(p.stem.split("-")[1]) for p in shards.complete_shards(hs)}, names
    assert not shards.read_meta(hs)["complete"]

    r = run_extract(proj)  # space again
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert_complete_and_verified(proj)


def test_shard_write_on_a_full_tmpfs_leaves_nothing(tmp_path: Path) -> None:
    """A real ENOSPC: a shard bigger than a 1 MiB tmpfs (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        sample = shards.Sample(0, torch.zeros(300, dtype=torch.int64), torch.zeros(300, dtype=torch.uint8),
                               torch.zeros(300, 4, 256))  # 1.2 MB of states
        with pytest.raises(Exception) as err:
            shards.write_shard(mnt, 0, [sample], {})
        assert no_space_reason(err.value) == "disk full", repr(err.value)
        assert list(mnt.iterdir()) == [], "a temp or a truncated shard was left behind"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_no_space_reason() -> None:
    import errno

    assert no_space_reason(OSError(errno.ENOSPC, "No space left on device")) == "disk full"
    assert no_space_reason(OSError(errno.EFBIG, "File too large")) == "file size limit"
    assert no_space_reason(SafetensorError("Error while serializing: I/O error: File too large (os error 27)")) == (
        "file size limit"
    )
    assert no_space_reason(ValueError("bad")) is None


# ------------------------------------------------------------------------------------ untrusted files


class Exploit:
    """Unpickling this creates the marker file: proof that the pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def malicious_pickle(path: Path, marker: Path) -> Path:
    torch.save({"weights": Exploit(marker)}, path)
    return path


@pytest.mark.slow
def test_pickle_shard_is_refused_by_verify_not_executed(extracted: Path, project_root: Path, tmp_path: Path) -> None:
    proj = copy_project(project_root, tmp_path / "p", layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
    marker = tmp_path / "pwned"
    shard = shards.complete_shards(proj / layout.HIDDEN_STATES_DIR)[0]
    malicious_pickle(shard, marker)  # a pickle renamed to .safetensors ...
    manifest = shards.read_manifest(shard)  # ... with a manifest that vouches for it
    manifest.update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    shards.manifest_path(shard).write_text(json.dumps(manifest))

    with pytest.raises(SafetensorError, match="deserializing header"):
        shards.load_sample(shard, manifest["sample_ids"][0])
    with pytest.raises(PipelineError) as err:
        run_stage(proj, "verify", reference_samples=2)
    assert "[structure]" in str(err.value) and "unreadable safetensors file" in str(err.value), str(err.value)
    assert shard.stem in str(err.value)
    assert not marker.exists(), "the pickle was executed"


def test_pickle_model_weights_are_not_executed(tmp_path: Path) -> None:
    """A model dir whose weights are a malicious pytorch_model.bin: transformers loads .bin with
    torch.load(weights_only=True), which refuses the pickle's code."""
    from transformers import LlamaConfig

    from pipeline.verification.reference.model import ReferenceModel

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=TINY["hidden_size"], intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=TINY["vocab_size"]).save_pretrained(model_dir)
    marker = tmp_path / "pwned"
    malicious_pickle(model_dir / "pytorch_model.bin", marker)
    with pytest.raises(Exception, match="(?i)weights_only|unpickl"):
        ReferenceModel.load(model_dir, "float32")
    assert not marker.exists(), "the pickle was executed"


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")


def test_no_unsafe_deserialization_in_the_pipeline() -> None:
    """No pickle, and every torch.load (none today) passes weights_only=True: shards, vLLM's
    per-request files and checkpoints are read with safetensors."""
    bad = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib") for n in names):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} imports pickle")
        for node, name in _calls(tree):
            if name == "load" and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} torch.load without weights_only=True")
    assert not bad, bad


# the vllm_compat builders of LLM(...) arguments: each takes trust_remote_code (tested below)
ENGINE_KWARGS = ("engine_kwargs(", "vllm_compat.engine_kwargs(", "generation_kwargs(", "vllm_compat.generation_kwargs(")


def test_trust_remote_code_comes_from_the_target_only() -> None:
    """Every from_pretrained / LLM( call in pipeline/ passes trust_remote_code, never a literal True;
    the only `**` spread into LLM (directly, or through vllm_compat.start_llm, which passes its
    keywords on to LLM unchanged) is engine_kwargs / generation_kwargs (tested below)."""
    bad = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node, name in _calls(ast.parse(path.read_text())):
            if name not in ("from_pretrained", "LLM", "start_llm"):
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            kw = {k.arg: k.value for k in node.keywords}
            spread = [ast.unparse(v) for a, v in kw.items() if a is None]
            if "trust_remote_code" in kw:
                v = kw["trust_remote_code"]
                if isinstance(v, ast.Constant) and v.value is True:
                    bad.append(f"{where}: trust_remote_code=True hard-coded")
            elif name == "LLM" and path.name == "vllm_compat.py" and spread == ["llm_kwargs"]:
                continue  # start_llm's own call: its callers are checked here as LLM calls
            elif not (name in ("LLM", "start_llm") and spread and all(s.startswith(ENGINE_KWARGS) for s in spread)):
                bad.append(f"{where}: {name}(...) without trust_remote_code")
    assert not bad, bad


def test_trust_remote_code_is_off_by_default(tmp_path: Path) -> None:
    from pipeline.extraction.vllm_compat import engine_kwargs, generation_kwargs
    from pipeline.params import ModelParams
    from pipeline.target import Target

    assert ModelParams().trust_remote_code is False
    assert Target(path=tmp_path, embedded=False, fingerprint={}).trust_remote_code is False
    (tmp_path / "config.json").write_text("{}")
    args = dict(model=tmp_path, layer_ids=[1, 2], scratch_dir=tmp_path / "s", dtype="float32", max_model_len=64,
                max_num_seqs=2, max_num_batched_tokens=64)
    assert engine_kwargs(**args)["trust_remote_code"] is False
    gen = dict(model=tmp_path, dtype="float32", max_model_len=64, max_num_seqs=2)
    assert generation_kwargs(**gen)["trust_remote_code"] is False
    assert generation_kwargs(**gen, trust_remote_code=True)["trust_remote_code"] is True
    assert engine_kwargs(**args, trust_remote_code=True)["trust_remote_code"] is True
