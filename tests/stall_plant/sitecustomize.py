"""A stalled engine, planted from outside the product (tests/test_engine_processes.py puts this directory on
PYTHONPATH): with PLANT_STALL=start vLLM's `LLM.__init__` waits forever before it prints a line, as an engine
core forked with an inherited OpenMP pool does; with PLANT_STALL=step:N the engine's step waits forever from
its Nth call on, as an engine that stops scheduling does. Nothing else changes."""

import importlib.abc
import importlib.util
import os
import sys
import threading

PLANT = os.environ.get("PLANT_STALL", "")
MODULES = {"start": "vllm.entrypoints.llm", "step": "vllm.v1.engine.llm_engine"}


def stall(*args, **kwargs):
    threading.Event().wait()


def plant(module) -> None:
    if PLANT == "start":
        module.LLM.__init__ = stall
        return
    after = int(PLANT.split(":")[1])
    step = module.LLMEngine.step
    calls = [0]

    def stalling_step(self):
        calls[0] += 1
        if calls[0] >= after:
            stall()
        return step(self)

    module.LLMEngine.step = stalling_step


class PlantAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_plant(module):
            exec_module(module)
            plant(module)

        spec.loader.exec_module = exec_and_plant
        return spec


if PLANT:
    sys.meta_path.insert(0, PlantAfterImport(MODULES[PLANT.split(":")[0]]))
