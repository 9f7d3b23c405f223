"""eagle3-pipeline: target LLM + chat data -> verified EAGLE-3 draft model."""

__version__ = "0.1.0"
