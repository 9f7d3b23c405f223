"""The GPU bench's steps, one module per job, behind the thin CLI bench/gpu_extract_bench.py."""
