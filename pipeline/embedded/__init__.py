"""The embedded target: a generated chat corpus, a BPE tokenizer and a tiny Llama trained on them.

It lets the whole pipeline run on a laptop CPU with no downloads; `model.path: embedded` selects it.
"""
