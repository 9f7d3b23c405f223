"""Verification: the verify stage's machinery (pipeline/stages/verify.py; dvc.yaml names its code).

- `samples/`: the per-sample tests: every sample's coherence and next-token scores, where they look, the fit of
  their predictors, their verdicts;
- `reference/`: the transformers reference forward verify compares the captured states with, whole or streamed,
  its memory cost, and the reference check.

The verify stage, `make plan` (pipeline/planning/reference.py), the seed's shape and bench/ use these modules;
none of them imports a stage.
"""
