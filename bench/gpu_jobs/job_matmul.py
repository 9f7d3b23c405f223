"""bench step matmul: the host's bf16 matmul rate, the prefill roofline's ceiling."""

from __future__ import annotations

import time

from gpu_jobs.common import device, log


def job_matmul(state: dict, name: str) -> dict:
    import torch

    dev = device()
    res = {}
    shapes = {"8192": (8192, 8192, 8192), "mlp_up_16k": (16384, 4096, 2 * 14336), "mlp_down_16k": (16384, 14336, 4096)}
    if state["smoke"]:
        shapes = {"8192": (512, 512, 512)}
    for key, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        iters = 20 if dev == "cuda" else 3
        if dev == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                a @ b
            e.record()
            torch.cuda.synchronize()
            sec = s.elapsed_time(e) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(iters):
                a @ b
            sec = time.perf_counter() - t
        res[f"tflops_{key}"] = round(2 * m * k * n * iters / sec / 1e12, 1)
    log(f"matmul: {res}")
    return {"summary": res}
