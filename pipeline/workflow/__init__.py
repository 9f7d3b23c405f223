"""The workflow around `python -m pipeline run <stage>`: how a stage is run, guarded, invalidated and shared.

- `launcher`: every stage natively or in the pinned container (runtime.mode), the one dvc.yaml cmd;
- `output_guard`: a killed run's finished files kept, the lock against a second concurrent run;
- `invalidation`: which stages each params key re-runs, and why (dvc.yaml's `params:` lists follow it);
- `input_checks`: what the check stage refuses before any stage runs;
- `sweep`: `make sweep`, a grid of extract.layer_ids as DVC experiments;
- `share`: `make push`, DVC's run-cache with the data of every recorded run.

The stages and the command line use these modules; none of them imports a stage.
"""
