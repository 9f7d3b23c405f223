"""The hidden-state shards: the format extract writes and verify, train and export read (docs/FORMAT.md).

- `format`: the shard format, its writer and reader (safetensors shards, manifests, extract_meta.json);
- `stats`: the per-layer statistics each manifest records, computed as a shard is written;
- `export`: our shards to speculators' training-data layouts.

Extraction, verification, training, planning and the command line use these modules; none of them imports
a stage.
"""
