"""A CPU-safe ExampleHiddenStatesConnector, loaded by vLLM through `kv_connector_module_path`.

The stock connector copies the captured hidden states off the device with a CUDA stream into
pinned memory; on a CPU-only build that raises (`pin_memory=True requires a CUDA or other
accelerator backend`). On CPU the hidden-states cache already lives in host memory, so this
subclass gathers the rows synchronously and hands them to the stock writer thread pool. The file
protocol is unchanged: one safetensors file per request (`hidden_states` [T, L, H], `token_ids`
[T]) guarded by an exclusive flock on `<file>.lock` until it is written.

On CUDA `vllm_compat` selects the stock connector; should this class get a device cache anyway,
it defers to the stock code.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _stock

CONNECTOR_NAME = "CpuHiddenStatesConnector"


class _DoneEvent:
    """Stands in for the CUDA event of a finished device-to-host copy."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DONE = _DoneEvent()


class CpuHiddenStatesConnector(_stock.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: _stock.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        # The stock helper knows this vLLM version's cache layout; advanced indexing copies,
        # so the rows stay valid after the scheduler frees and reuses the blocks.
        hidden = _stock.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}

        assert pending.req_id not in self._req_futures, "two hidden-state writes for one req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        future = self._executor.submit(self._write_tensors, tensors, _DONE, pending.filename, lock_fd)
        # vLLM >= 0.32 reports a request as sent only when it has an event here.
        self._req_copy_events[pending.req_id] = _DONE
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
