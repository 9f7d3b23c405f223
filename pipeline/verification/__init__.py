"""Verification: the verify stage's machinery (pipeline/stages/verify.py; dvc.yaml names this folder as its code).

- `shards`: verify's per-shard checks, merged over the scan: structure, recorded values, outlier shards, storage,
  each shard's next-token accuracy of its final states;
- `scan`: the per-shard pass, shards in a thread pool: structure, recorded values and final-state hits of one shard;
- `values`: a sample's value check on its statistics (non-finite, all-zero or constant layers);
- `audit`: an audited shard read in full apart from the scan: its sha256 and every sample's statistics;
- `final_head`: the final-state check's head (argmax of lm_head(norm(h_N))), its seeded positions and chunks;
- `report`: the findings and numbers of a run: metrics/verify.json, the per-layer CSV, plots, reports/verify/;
- `shard_view`, `host_staging`: a memory-mapped shard as numpy views and the rows verify reads; the host buffers
  the scan threads stage rows in;
- `samples/`: the per-sample tests: every sample's coherence and next-token scores, where they look, the fit of
  their predictors, their verdicts;
- `reference/`: the transformers reference forward verify compares the captured states with, whole or streamed,
  its memory cost, and the reference check.

The sub-packages import, of the modules here, only `report`, `shard_view` and `host_staging` (which import no
sub-package); `scan`, `shards` and `final_head` stand above them. The verify stage, `make plan`
(pipeline/planning/reference.py), the seed's shape and bench/ use these modules; none of them imports a stage.
"""
