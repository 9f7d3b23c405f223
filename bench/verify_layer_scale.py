"""The smallest systematic scale of one captured layer (in every sample) that verify's reference check catches.

    python bench/verify_layer_scale.py --arch llama --dtype bfloat16 --out scale.json

Builds the tests' tiny target of `--arch` (tests/conftest.py: the Llama of 8 layers at hidden 64, or the DeepSeek-V3 /
Kimi shape with MLA and routed + shared experts) and its prepared prompts of 20..300 tokens, extracts with real vLLM
in `--dtype`, runs verify on the clean extraction (the projection ratio of every layer), then, for each scale s of
`--scales` and both signs, a copy with one layer (`--layer`, an index into layer_ids) times 1 + s in every sample,
planted through the shard writer (tests/layer_scale.py), verified by the real stage with 4 reference samples as the
tests run it. Prints and writes, per factor, whether the reference check named the layer as scaled and the ratio;
docs/ARCHITECTURE.md ("Verify: the checks and their tolerances") has a run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.target import Target, fingerprint_model_dir, write_target
from tests.conftest import (
    EXTRACT_PARAMS,
    build_tiny_deepseek_v3,
    build_tiny_llama,
    copy_project,
    make_prepared,
    run_stage,
)
from tests.layer_scale import scale_layer

VERIFY = {"reference_samples": 4}


def build(root: Path, arch: str, dtype: str, samples: int) -> Path:
    builder = build_tiny_llama if arch == "llama" else build_tiny_deepseek_v3
    model_dir = builder(root / "tiny-model")
    write_target(Target(path=model_dir, embedded=False, fingerprint=fingerprint_model_dir(model_dir)), root / layout.TARGET_JSON)
    make_prepared(root / layout.PREPARED_DATASET, n=samples)
    run_stage(root, "extract", **{**EXTRACT_PARAMS, "dtype": dtype})
    return root


def verify(root: Path) -> tuple[dict, str]:
    try:
        run_stage(root, "verify", **VERIFY)
        message = ""
    except PipelineError as e:
        message = str(e)
    return json.loads((root / layout.METRICS / "verify.json").read_text()), message


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["llama", "deepseek_v3"], required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float8_e4m3", "float32"], required=True)
    ap.add_argument("--scales", default="0.005,0.008,0.01,0.012,0.015,0.02")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layer-scale-"))
    clean = build(work / "clean", args.arch, args.dtype, args.samples)
    metrics, message = verify(clean)
    assert metrics["passed"], message
    layer_id = metrics["layer_ids"][args.layer]
    result = {"arch": args.arch, "dtype": args.dtype, "layer_id": layer_id, "samples": args.samples,
              "clean_ratios": {k: r["scale_ratio"] for k, r in metrics["layers"].items()},
              "bound": metrics["layers"][str(layer_id)]["scale_bound"], "planted": []}
    print(f"{args.arch} {args.dtype}: clean projection ratios {result['clean_ratios']}, bound {result['bound']:.4%}")
    for s in [float(x) for x in args.scales.split(",")]:
        for factor in (1 + s, 1 - s):
            root = copy_project(clean, work / f"x{factor}", layout.TARGET_JSON, layout.PREPARED_DIR, layout.HIDDEN_STATES_DIR)
            scale_layer(root, args.layer, factor)
            t0 = time.perf_counter()
            metrics, message = verify(root)
            caught = any(f"[reference] layer={layer_id}:" in x and "systematically scaled" in x for x in message.splitlines())
            row = metrics["layers"][str(layer_id)]
            ratio = row["scale_ratio"]
            # every other failure line: another check, or the reference check's other tests (the relative error's)
            other = [x.strip()[:120] for x in message.splitlines() if x.startswith("  [") and "systematically scaled" not in x]
            result["planted"].append({"factor": factor, "caught": caught, "ratio": ratio, "other_failures": other,
                                      "rel_rms_error": row["rel_rms_error"], "allowed": row.get("allowed"),
                                      "verify_s": round(time.perf_counter() - t0, 1)})
            print(f"  layer {layer_id} x {factor:.4f}: ratio {ratio:.5f}, {'caught' if caught else 'passed'}; relative error "
                  f"{row['rel_rms_error']:.4f} (allowed {row.get('allowed', float('nan')):.4f})"
                  + (f"; other failures: {other}" if other else ""))
            shutil.rmtree(root)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
