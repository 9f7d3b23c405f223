"""Fault injection: each fault is planted into a copy of a clean, real vLLM extraction and verify
must fail naming the right check (and where); clean data must raise no alarm."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.hidden_states import stats as shard_stats
from pipeline.hidden_states.format import complete_shards, manifest_path, read_meta, write_meta
from pipeline.params import VerifyParams
from pipeline.stages.verify import audit_selection
from pipeline.target import load_target, sha256_file
from pipeline.verification.reference.model import ReferenceModel
from tests.conftest import build_tiny_llama, copy_project, run_stage

pytestmark = pytest.mark.slow
VERIFY = {"reference_samples": 4}
# how values are judged: from the manifests' records only (no shard read in full), or every shard
# re-derived from its bytes; a planted fault must be caught with the same message either way
RECORDS_ONLY = {"audit_fraction": 0.0, "audit_min_shards": 0}
AUDIT_ALL = {"audit_fraction": 1.0}


@pytest.fixture
def project(extracted: Path, project_root: Path, tmp_path: Path) -> Path:
    """A private copy of the clean extraction project."""
    return copy_project(project_root, tmp_path, layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)


def verify(root: Path, **params) -> dict:
    run_stage(root, "verify", **{**VERIFY, **params})
    return json.loads((root / layout.METRICS / "verify.json").read_text())


def verify_fails(root: Path, check: str, *words: str, params: dict | None = None) -> str:
    with pytest.raises(PipelineError) as err:
        run_stage(root, "verify", **{**VERIFY, **(params or {})})
    message = str(err.value)
    assert f"[{check}]" in message, message
    for word in words:
        assert word in message, message
    assert not (root / layout.VERIFY_VERDICT).exists()
    metrics = json.loads((root / layout.METRICS / "verify.json").read_text())
    assert metrics["passed"] is False and metrics["checks"][check] == "fail"
    return message


def shards(root: Path) -> list[Path]:
    return complete_shards(root / layout.HIDDEN_STATES_DIR)


def rewrite(shard: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> None:
    """Change a shard's tensors the way a buggy extractor would: content and manifest consistent
    (size, sha256, and the per-layer statistics recorded from the tensors it wrote)."""
    tensors = load_file(str(shard))
    manifest = json.loads(manifest_path(shard).read_text())
    edit(tensors, manifest)
    save_file(tensors, str(shard), metadata={"format": manifest["format"]})
    manifest["bytes"] = shard.stat().st_size
    manifest["sha256"] = sha256_file(shard)
    records = {}
    for sid in manifest["sample_ids"]:
        hs = tensors.get(f"{sid}/hidden_states")
        if hs is not None and hs.dim() == 3:
            records[str(sid)] = shard_stats.to_record(shard_stats.sample_stats(hs))
    manifest["layer_stats"]["samples"] = records
    manifest_path(shard).write_text(json.dumps(manifest))


def audited(root: Path, **params) -> set[str]:
    return set(audit_selection([p.stem for p in shards(root)], VerifyParams(**{**VERIFY, **params})))


def edit_states(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict, dict], None]:
    def edit(tensors: dict, manifest: dict) -> None:
        for sid in manifest["sample_ids"]:
            tensors[f"{sid}/hidden_states"] = fn(tensors[f"{sid}/hidden_states"]).contiguous()

    return edit


def relabel(root: Path, layer_ids: list[int]) -> None:
    hs_dir = root / layout.HIDDEN_STATES_DIR
    meta = read_meta(hs_dir)
    write_meta(hs_dir, {**meta, "layer_ids": layer_ids})
    for shard in shards(root):
        m = json.loads(manifest_path(shard).read_text())
        manifest_path(shard).write_text(json.dumps({**m, "layer_ids": layer_ids}))


def test_clean_extraction_passes(project: Path):
    metrics = verify(project)
    assert metrics["passed"] and metrics["num_failures"] == 0
    assert all(v == "pass" for v in metrics["checks"].values())
    assert json.loads((project / layout.VERIFY_VERDICT).read_text())["passed"] is True
    layers = metrics["layers"]
    assert set(layers) == {str(i) for i in metrics["layer_ids"]}
    assert all(row["closest_reference"] == lid for lid, row in layers.items())
    assert metrics["argmax_agreement"] >= 0.99
    report = (project / layout.REPORTS / "verify" / "report.md").read_text()
    assert "PASSED" in report and (project / layout.REPORTS / "verify" / "layer_identity.png").is_file()
    # only the seeded audit sample is read in full and re-hashed
    assert set(metrics["audited_shards"]) == audited(project) and 0 < len(audited(project)) < len(shards(project))
    assert metrics["hashed_shards"] == len(audited(project))


def test_scan_leaves_the_process_settings_as_it_found_them(project: Path):
    """The threaded scan shares the cores among its threads and hands the GIL over more often, for its own duration:
    a process that runs verify (the bench, a notebook) keeps its torch threads and switch interval. In a process of its
    own: vLLM's CPU worker, run in this one by the extraction fixture, makes torch.set_num_threads a no-op here."""
    code = (
        "import sys, torch; from pipeline.params import VerifyParams; from pipeline.stages import verify; "
        "torch.set_num_threads(2); sys.setswitchinterval(0.004); "
        f"verify.run(VerifyParams(workers=2, **{VERIFY!r})); "
        "print('SETTINGS', torch.get_num_threads(), sys.getswitchinterval())"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("SETTINGS"))
    assert line.split()[1:] == ["2", "0.004"], line


def test_clean_extraction_passes_on_records_only_and_every_shard_audited(project: Path):
    """The records the extractor wrote agree with the bytes (every shard audited), and judged
    alone (no shard read in full) give the same statistics."""
    def shard_table() -> str:
        report = (project / layout.REPORTS / "verify" / "report.md").read_text()
        return report[report.index("## Per-layer statistics per shard") : report.index("Verify took")]

    full = verify(project, **AUDIT_ALL, hash_all_shards=True)
    assert full["passed"] and full["hashed_shards"] == len(shards(project)) == len(full["audited_shards"])
    from_bytes = shard_table()
    records = verify(project, **RECORDS_ONLY)
    assert records["passed"] and records["audited_shards"] == [] and records["hashed_shards"] == 0
    assert shard_table() == from_bytes
    assert records["final_state_next_token_acc"] == full["final_state_next_token_acc"]


def test_final_state_on_a_seeded_sample_of_positions(project: Path):
    """With verify.final_state_positions_per_shard set, each shard sends that many of its masked
    positions through lm_head (the same ones on every run); null sends all of them."""
    every = verify(project, final_state_positions_per_shard=None)
    assert every["final_state_positions"] == every["masked_positions"] > 3 * 50
    sampled = verify(project, final_state_positions_per_shard=50)
    assert sampled["passed"] and sampled["final_state_positions"] == 3 * 50
    assert sampled["masked_positions"] == every["masked_positions"]
    again = verify(project, final_state_positions_per_shard=50)
    assert again["final_state_next_token_acc"] == sampled["final_state_next_token_acc"]
    assert "of the" in (project / layout.REPORTS / "verify" / "report.md").read_text()


def test_shard_without_records_is_read_in_full(project: Path):
    """Shards written before the extractor recorded statistics are verified from their bytes."""
    shard = next(p for p in shards(project) if p.stem not in audited(project))
    m = json.loads(manifest_path(shard).read_text())
    del m["layer_stats"]
    manifest_path(shard).write_text(json.dumps(m))
    metrics = verify(project)
    assert metrics["passed"] and shard.stem in metrics["audited_shards"]


# one scan thread reads an audited shard in full itself; more read it in threads of their own, ahead of the scan
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("where", ["audited", "not audited by default, audit_fraction 1"])
def test_recorded_statistics_differ_from_bytes(project: Path, where: str, workers: int):
    """A record that does not describe its shard's bytes is caught where the shard is audited."""
    if where == "audited":
        shard, params = next(p for p in shards(project) if p.stem in audited(project)), {"workers": workers}
    else:  # a wrong record on a shard the audit skips is caught when every shard is audited
        shard, params = next(p for p in shards(project) if p.stem not in audited(project)), {**AUDIT_ALL, "workers": workers}
    m = json.loads(manifest_path(shard).read_text())
    sid = m["sample_ids"][0]
    m["layer_stats"]["samples"][str(sid)][1][3] *= 2  # layer index 1's max
    manifest_path(shard).write_text(json.dumps(m))
    verify_fails(project, "structure", "recorded statistics differ from the bytes", shard.stem, params=params)


def test_verdict_is_deterministic(project: Path):
    verify(project)
    first = (project / layout.VERIFY_VERDICT).read_bytes()
    verify(project)
    assert (project / layout.VERIFY_VERDICT).read_bytes() == first


def test_layer_ids_off_by_one(project: Path):
    ids = read_meta(project / layout.HIDDEN_STATES_DIR)["layer_ids"]
    relabel(project, [i - 1 for i in ids[:-1]] + ids[-1:])  # content is one layer later than declared
    verify_fails(project, "reference", "off by +1", "speculators 0.3.0")


def test_two_layers_swapped(project: Path):
    for shard in shards(project):
        rewrite(shard, edit_states(lambda h: h[:, [1, 0, 2, 3]]))
    verify_fails(project, "reference", "swapped")


def test_states_shifted_by_one_token(project: Path):
    for shard in shards(project):
        rewrite(shard, edit_states(lambda h: torch.cat([h[:1], h[:-1]])))
    verify_fails(project, "reference", "misaligned")


def test_loss_mask_shifted(project: Path):
    def edit(tensors, manifest):
        sid = manifest["sample_ids"][0]
        tensors[f"{sid}/loss_mask"] = torch.roll(tensors[f"{sid}/loss_mask"], 1)

    rewrite(shards(project)[1], edit)
    verify_fails(project, "structure", "loss_mask differs", "shard-00001")


@pytest.mark.parametrize("layout_fault", ["transposed", "per_position"])
def test_bogus_layout(project: Path, layout_fault: str):
    def edit(tensors, manifest):
        for sid in manifest["sample_ids"]:
            h = tensors.pop(f"{sid}/hidden_states")
            if layout_fault == "transposed":
                tensors[f"{sid}/hidden_states"] = h.transpose(0, 1).contiguous()
            else:  # the story's 771 tensors of [512]: one tensor per position
                for t in range(h.shape[0]):
                    tensors[f"{sid}/hidden_states/{t}"] = h[t].flatten().contiguous()

    rewrite(shards(project)[0], edit)
    words = ("expected [T=",) if layout_fault == "transposed" else ("key set differs", "3 per sample")
    verify_fails(project, "structure", *words)


@pytest.mark.parametrize("judged", [RECORDS_ONLY, AUDIT_ALL], ids=["records", "audit"])
@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite(project: Path, value: float, word: str, judged: dict):
    def poison(h):
        h = h.clone()
        h[3, 2, 5] = value
        return h

    rewrite(shards(project)[2], edit_states(poison))
    verify_fails(project, "values", word, "shard-00002", "layer=", params=judged)


@pytest.mark.parametrize("judged", [RECORDS_ONLY, AUDIT_ALL], ids=["records", "audit"])
def test_all_zero_layer(project: Path, judged: dict):
    def zero(h):
        h = h.clone()
        h[:, 1] = 0
        return h

    rewrite(shards(project)[0], edit_states(zero))
    verify_fails(project, "values", "all zeros", "layer=", params=judged)


@pytest.mark.parametrize("judged", [RECORDS_ONLY, AUDIT_ALL], ids=["records", "audit"])
def test_truncated_shard(project: Path, judged: dict):
    shard = shards(project)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    verify_fails(project, "structure", "truncated", "shard-00001", params=judged)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("where", ["audited", "not audited, hash_all_shards"])
def test_manifest_hash_mismatch(project: Path, where: str, workers: int):
    if where == "audited":
        shard, params = next(p for p in shards(project) if p.stem in audited(project)), {"workers": workers}
    else:
        shard, params = next(p for p in shards(project) if p.stem not in audited(project)), {"hash_all_shards": True, "workers": workers}
    m = json.loads(manifest_path(shard).read_text())
    m["sha256"] = "0" * 64
    manifest_path(shard).write_text(json.dumps(m))
    verify_fails(project, "structure", "sha256", shard.stem, params=params)


def test_shard_without_manifest(project: Path):
    manifest_path(shards(project)[-1]).unlink()
    verify_fails(project, "structure", "no manifest")


def test_changed_dtype(project: Path):
    rewrite(shards(project)[0], edit_states(lambda h: h.to(torch.bfloat16)))
    verify_fails(project, "structure", "dtype torch.bfloat16")


def test_missing_sample(project: Path):
    def drop(tensors, manifest):
        sid = manifest["sample_ids"].pop()
        for key in ("hidden_states", "input_ids", "loss_mask"):
            tensors.pop(f"{sid}/{key}")

    rewrite(shards(project)[0], drop)
    verify_fails(project, "structure", "have no hidden states")


def test_duplicated_sample(project: Path):
    first, second = shards(project)[:2]
    source = load_file(str(first))
    sid = json.loads(manifest_path(first).read_text())["sample_ids"][0]

    def dup(tensors, manifest):
        for key in ("hidden_states", "input_ids", "loss_mask"):
            tensors[f"{sid}/{key}"] = source[f"{sid}/{key}"]
        manifest["sample_ids"].append(sid)

    rewrite(second, dup)
    verify_fails(project, "structure", "duplicate sample id")


@pytest.mark.parametrize("times", [1, 2])
def test_final_norm_applied(project: Path, times: int):
    target = load_target(project / layout.TARGET_JSON)
    norm = ReferenceModel.load(target.path, "float32").final_norm

    @torch.no_grad()
    def normed(h):
        h = h.clone()
        for _ in range(times):
            h[:, -1] = norm(h[:, -1])
        return h

    for shard in shards(project):
        rewrite(shard, edit_states(normed))
    message = verify_fails(project, "reference", "layer=8")
    if times == 1:
        assert "final norm was applied" in message


def test_states_from_another_model(project: Path, tmp_path_factory):
    other = ReferenceModel.load(build_tiny_llama(tmp_path_factory.mktemp("other"), seed=1), "float32")
    ids = read_meta(project / layout.HIDDEN_STATES_DIR)["layer_ids"]

    def edit(tensors, manifest):
        for sid in manifest["sample_ids"]:
            tensors[f"{sid}/hidden_states"] = other.states(tensors[f"{sid}/input_ids"])[ids].transpose(0, 1).contiguous()

    for shard in shards(project):
        rewrite(shard, edit)
    verify_fails(project, "reference", "max |captured - reference|")


def test_bf16_extraction_passes_with_calibrated_tolerance(project: Path):
    """A bf16 engine run is judged against an independent bf16 reference, not a fixed threshold."""
    from tests.conftest import EXTRACT_PARAMS

    run_stage(project, "extract", **{**EXTRACT_PARAMS, "dtype": "bfloat16"})
    metrics = verify(project)
    assert metrics["passed"] and metrics["dtype"] == "bfloat16"
    for row in metrics["layers"].values():
        assert 0 < row["rel_rms_error"] <= row["allowed"]
        assert row["calibration_rel_rms_error"] > 0
    assert "calibration_argmax_agreement" in metrics


def test_per_shard_accuracy_alarm_needs_evidence():
    """The per-shard next-token check fires on a real shortfall, never on a target at chance level."""
    from pipeline.params import VerifyParams
    from pipeline.stages.verify import Report, check_final_state_rates

    def failures(ref_acc: float, shards: dict[str, tuple[float, int]]) -> list[str]:
        report = Report(summary={"reference_next_token_acc": ref_acc, "final_layer_id": 8,
                                 "per_shard_next_token_acc": {k: a for k, (a, _) in shards.items()},
                                 "per_shard_positions": {k: n for k, (_, n) in shards.items()}})
        check_final_state_rates(report, VerifyParams())
        return [f.shard for f in report.failures("final_state")]

    # a trained target (80%): a shard at 10% over 5000 positions is a wrong final layer
    assert failures(0.8, {"a": (0.79, 5000), "b": (0.10, 5000)}) == ["b"]
    # random weights (1/512): 0 hits in a shard is chance, not evidence
    assert failures(0.004, {"a": (0.0, 2000), "b": (0.006, 2000)}) == []
    # too few positions to tell
    assert failures(0.8, {"a": (0.1, 20)}) == []


def test_final_rows_read_from_the_memory_map_equal_the_tensors(project: Path):
    """Spans of positions (strided slice copies) and scattered ones (a gather) read the same rows."""
    import numpy as np

    from pipeline.hidden_states.format import read_header
    from pipeline.verification.host_staging import HostStaging
    from pipeline.verification.scan import _ShardView, read_final_rows

    path = shards(project)[0]
    tensors = load_file(path)
    header, start = read_header(path)
    view = _ShardView(np.memmap(path, dtype=np.uint8, mode="r"), header, start)
    names = [k for k in tensors if k.endswith("/hidden_states")][:3]
    spans = torch.cat([torch.arange(2, 9), torch.arange(11, 15)])  # two spans
    scattered = torch.tensor([0, 3, 5, 8, 13, 17])
    chosen = [(names[0], spans, None), (names[1], scattered, None), (names[2], torch.tensor([4]), None)]
    hidden = tensors[names[0]].shape[-1]

    layer = -1 % tensors[names[0]].shape[1]
    rows = read_final_rows(view, chosen, layer=layer, hidden=hidden)
    staging = HostStaging(1, 64 * hidden * rows.element_size(), 0, pinned=False)
    with staging.buffer() as buffer:
        staged = read_final_rows(view, chosen, layer=layer, hidden=hidden, staging=buffer)
        # a second read into the same buffer (the next piece of a shard) overwrites it from the start
        again = read_final_rows(view, chosen[1:], layer=layer, hidden=hidden, staging=buffer)

    expected = torch.cat([tensors[name][positions, -1] for name, positions, _ in chosen])
    assert rows.dtype == expected.dtype and torch.equal(rows, expected)
    assert torch.equal(staged[: len(expected) - len(spans)], expected[len(spans) :])  # `again` wrote over it
    assert torch.equal(again, expected[len(spans) :])
    with pytest.raises(ValueError, match="staging buffer holds"):
        read_final_rows(view, [(names[0], torch.arange(65), None)], layer=layer, hidden=hidden, staging=buffer)


def test_final_states_kept_by_the_scoring_equal_the_tensors(project: Path):
    """The final-state check takes its rows from the per-sample scoring's batches (sorted by fold and half, not by
    sample): what comes back is each asked sample's final layer at the asked positions, the scores are the same as
    without, and a position the scoring does not judge is refused, not silently read elsewhere."""
    import numpy as np

    from pipeline.verification.samples.fit import load_embedding
    from pipeline.verification.samples.positions import judged_positions
    from pipeline.verification.samples.scores import Coherence

    target = load_target(project / layout.TARGET_JSON)
    layer_ids = read_meta(project / layout.HIDDEN_STATES_DIR)["layer_ids"]
    tensors = load_file(shards(project)[0])
    sids = sorted({int(k.split("/")[0]) for k in tensors})
    stored = {s: tensors[f"{s}/hidden_states"] for s in sids}
    dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}[stored[sids[0]].dtype]

    def as_stored(h: torch.Tensor) -> np.ndarray:
        return (h.view(torch.int16) if h.dtype == torch.bfloat16 else h).numpy()

    samples = [(s, as_stored(stored[s]), dtype, tensors[f"{s}/input_ids"]) for s in sids]
    coherence = Coherence(layer_ids, load_embedding(target.path, target.trust_remote_code), 4, 0)
    coherence.fit((coherence.fold(s), s, coherence.inputs(h[1:], dtype, ids[1:])[1]) for s, h, _, ids in samples)
    rng = np.random.default_rng(0)
    wanted = {}
    for s, h, _, _ in samples[::2]:
        judged = judged_positions(h.shape[0], 4, 0, s)
        if len(judged):
            wanted[s] = np.sort(rng.choice(judged, size=min(5, len(judged)), replace=False))
    assert len(wanted) >= 3 and len({coherence.fold(s) for s in wanted}) == 2

    scores, finals = coherence.score_keeping_final_states(samples, wanted)

    assert list(finals) == list(wanted)
    for s, positions in wanted.items():
        assert finals[s].dtype == stored[s].dtype and torch.equal(finals[s], stored[s][positions, -1])
    plain = coherence.score_samples(samples)
    assert [x.sample for x in scores] == sids and all(torch.equal(a.shares, b.shares) for a, b in zip(scores, plain, strict=True))
    s = next(iter(wanted))
    with pytest.raises(ValueError, match="do not judge"):
        coherence.score_keeping_final_states(samples, {s: wanted[s][:1] + 1})


def test_final_positions_split_into_pieces_a_staging_buffer_holds():
    from pipeline.verification.final_head import split_positions

    chosen = [("a", torch.arange(5), "ids a"), ("b", torch.arange(10, 13), "ids b"), ("c", torch.tensor([7]), "ids c")]
    pieces = split_positions(chosen, 4)

    assert [sum(p.numel() for _, p, _ in piece) for piece in pieces] == [4, 4, 1]
    # in order, every position once, each with its sample's name and ids
    flat = [(name, int(x), ids) for piece in pieces for name, positions, ids in piece for x in positions]
    assert flat == [(name, int(x), ids) for name, positions, ids in chosen for x in positions]
    whole = split_positions(chosen, 100)
    assert len(whole) == 1 and [(n, p.tolist(), i) for n, p, i in whole[0]] == [(n, p.tolist(), i) for n, p, i in chosen]
    assert split_positions([], 4) == []


def test_scoring_batches_never_exceed_their_rows_unless_one_sample_does():
    from pipeline.verification.samples.positions import batch_capacity, batches

    items = [(i, None, None, range(n)) for i, n in enumerate([3, 2, 4, 9, 1, 1])]
    got = [[item[0] for item in batch] for batch in batches(items, 5)]

    assert got == [[0, 1], [2], [3], [4, 5]]  # sample 3 (9 rows) alone: a sample is never split
    assert batch_capacity(longest=100, stride=4) == 4096
    assert batch_capacity(longest=20_001, stride=4) == 5000  # positions 1.. every 4th: at most ceil(20000 / 4)
