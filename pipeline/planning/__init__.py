"""Capacity planning, `python -m pipeline plan` (`make plan`): what a run will cost before it starts.

- `plan`: the projection: the bytes the extraction writes and the free space, wall time, engine memory;
- `extract_time`: the extraction's wall time (the longer of compute and shard writes, plus the last shard's drain);
- `reference`: verify's reference forward at the planned scale.

The command line uses these modules; none of them imports a stage.
"""
