"""The code copies and variants of the next budget call (docs/BENCHMARKS.md "Verify's scan, session 22"): two ways the
scan's threads could use the host's cores, each a copy of `--rev`'s `pipeline/` (1fd57d5: the 4-thread scan that
session 22's call 3 measured them against; 541db86 made v8x1 the GPU default) with the one line that sets torch's
intra-op threads for the scan changed, and a diagnostic without the audit, interleaved with main.

    python bench/scan_thread_variants.py --out .gpucarry   # writes .gpucarry/v8x1, .gpucarry/v4x3, .gpucarry/variants.json

then on the device: VERIFY_COLD_ONLY=1 VERIFY_COLD_VARIANTS="$(cat .gpucarry/variants.json)" python3
bench/gpu_extract_bench.py --out $OUT --jobs verifyall --deadline 560
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

INTRA_OP = "torch.set_num_threads(max(1, min(intra_op, len(os.sched_getaffinity(0)) // threads)))"
CANDIDATES = {
    # 8 scan threads, each gather on one core: session 19's fastest scoring (147 batches a second)
    "v8x1": ("torch.set_num_threads(1)", {"workers": 8}),
    # 4 scan threads; the audit's readers counted among the cores: 3 intra-op threads a scan thread on 16, not 4
    "v4x3": ("torch.set_num_threads(max(1, min(intra_op, (len(os.sched_getaffinity(0)) - len(read_fully)) // threads)))", {}),
}
NO_AUDIT = {"audit_fraction": 0.0, "audit_min_shards": 0}  # a diagnostic: no shard read in full, not a setting to ship


def copy_with(out: Path, rev: str, name: str, line: str) -> Path:
    """`git archive <rev> pipeline` under out/name, with the intra-op line replaced by `line`."""
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    archive = subprocess.run(["git", "archive", rev, "pipeline"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="tar")
    scan = next((p for p in (target / "pipeline" / "verification" / "scan.py", target / "pipeline" / "verify_scan.py")
                 if p.is_file()), target / "pipeline" / "verification" / "scan.py")  # a rev before the layout: its old path
    text = scan.read_text()
    if text.count(INTRA_OP) != 1:
        raise SystemExit(f"{scan}: the intra-op line is not there once; pass a --rev that has it")
    scan.write_text(text.replace(INTRA_OP, line))
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".gpucarry"))
    ap.add_argument("--rev", default="1fd57d5", help="the revision whose pipeline/ the copies change")
    args = ap.parse_args()
    codes = {name: str(copy_with(args.out, args.rev, name, line)) for name, (line, _) in CANDIDATES.items()}
    variants: dict[str, dict] = {}
    for rep in (1, 2):  # interleaved: identical processes differ by up to ~10%, and the host drifts within a call
        for name, (_, params) in CANDIDATES.items():
            variants[f"{name}_{rep}"] = {"code": codes[name], **({"env": {"VERIFY_COLD_PARAMS": json.dumps(params)}} if params else {})}
        variants[f"main_{rep}"] = {}
    variants["noaudit_1"] = {"env": {"VERIFY_COLD_PARAMS": json.dumps(NO_AUDIT)}}
    (args.out / "variants.json").write_text(json.dumps(variants))
    print(json.dumps(variants, indent=1))


if __name__ == "__main__":
    main()
