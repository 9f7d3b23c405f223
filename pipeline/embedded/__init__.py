"""The embedded target: a generated chat corpus, a BPE tokenizer and a tiny Llama trained on them.

It lets the whole pipeline run on a laptop CPU with no downloads; `model.path: embedded` selects it.

`seed_shape` builds another target beside it, outside the pipeline: the seed's shape, written on the GPU
(`python -m pipeline.embedded.seed_shape DIR`, then `model.path: DIR`).
"""
