"""The extraction core below the stages: what to extract, where it goes, and the engine that computes it.

- `inputs`: the prepared dataset, the shard plan and the run key (what to extract);
- `capacity`: the bytes an extraction writes and whether they fit the disk (`make plan` and the stage);
- `output`: the output directory: free space checked, other runs' shards cleared, a full disk named;
- `engine`: one vLLM engine fed with the samples, its captures checked and written as shards;
- `ray`: the same shards computed by several engines on a Ray cluster (extract.engine: ray);
- `vllm_compat`: all vLLM-version-specific code (extract; check, regenerate and eval);
- `hs_connector`: the hidden-states KV connector vLLM loads by its module path (CPU-safe; quantizes fp8 states where they are).

The extract stage (pipeline/stages/extract.py; dvc.yaml names this folder as its code), the other stages
that use vLLM, `python -m pipeline plan` (pipeline/planning/plan.py) and bench/ use these modules; none of
them imports a stage.
"""
