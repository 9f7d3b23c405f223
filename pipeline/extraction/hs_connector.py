"""The project's ExampleHiddenStatesConnector, loaded by vLLM through `kv_connector_module_path`.

It does two things the stock connector does not, and nothing else:

- **CPU:** the stock connector copies the captured hidden states off the device with a CUDA stream
  into pinned memory; on a CPU-only build that raises (`pin_memory=True requires a CUDA or other
  accelerator backend`). On CPU the hidden-states cache already lives in host memory, so this
  class gathers the rows synchronously and hands them to the stock writer thread pool.
- **fp8 storage** (`extract.dtype: float8_e4m3`, extra config key `hidden_states_storage`):
  the states are quantized where they are (pipeline/hidden_states/fp8.py), on the GPU before the
  device-to-host copy, so half the bytes cross PCIe and reach the request file, and the host
  never holds the bf16 states. On CPU the same function runs on the host rows.

The file protocol is the stock one: one safetensors file per request, guarded by an exclusive
flock on `<file>.lock` until it is written, holding `token_ids` [T] and either `hidden_states`
[T, L, H] (as computed) or, for fp8, `hidden_states_fp8` [T, L, H] float8_e4m3fn with
`hidden_states_scale` [T, L] float32 and `hidden_states_stats` [L, 4] float64, the statistics the manifest
records, of the dequantized values (so the shard threads do no arithmetic on fp8 states).

vLLM selects the stock connector for a GPU run stored as computed (vllm_compat.kv_transfer_config).
The attributes used here (`_get_copy_stream`, `_lock_fds`, `_executor`, `_write_tensors`,
`_req_copy_events`, `_req_futures`, `_on_write_done`) are the same in vLLM 0.26 and 0.32.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _stock

from pipeline.hidden_states import fp8
from pipeline.hidden_states import stats as shard_stats

CONNECTOR_NAME = "HiddenStatesConnector"
STORAGE_KEY = "hidden_states_storage"  # kv_connector_extra_config: "fp8" quantizes; absent stores as computed
QUANTIZE_TOKENS = 1024  # tokens quantized at once on the GPU: its float32 temporaries stay ~0.1 GB at H 7168, L 4


class _DoneEvent:
    """Stands in for the CUDA event of a finished device-to-host copy."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DONE = _DoneEvent()


def _gpu_sync_allowed():
    """vLLM 0.32's guard for a deliberate host-to-device copy in a connector; 0.26 has none."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        return contextlib.nullcontext()
    return gpu_sync_allowed()


def quantize_rows(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """[T, L, H] states -> the request file's fp8 tensors, on the states' device, a block of tokens at a time:
    q [T, L, H] float8_e4m3fn, scale [T, L] float32, and the manifest's per-layer statistics of the dequantized
    values, [L, 4] float64 (pipeline/hidden_states/stats.py). Computed here, the host never holds a float copy of
    the states."""
    T, L, _ = hidden.shape
    q = torch.empty(hidden.shape, dtype=fp8.TORCH_DTYPE, device=hidden.device)
    scale = torch.empty((T, L), dtype=torch.float32, device=hidden.device)
    stats = shard_stats.BlockStats(L, hidden.device)
    for lo in range(0, T, QUANTIZE_TOKENS):
        hi = min(T, lo + QUANTIZE_TOKENS)
        q[lo:hi], scale[lo:hi] = fp8.quantize(hidden[lo:hi])
        stats.add(fp8.dequantize(q[lo:hi], scale[lo:hi]).transpose(0, 1).reshape(L, -1))  # [L, t H] float32
    return {fp8.STATES_KEY: q, fp8.SCALE_KEY: scale, fp8.STATS_KEY: stats.result()}


class HiddenStatesConnector(_stock.ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        storage = self._kv_transfer_config.get_from_extra_config(STORAGE_KEY, None)
        if storage not in (None, "fp8"):
            raise ValueError(f"{STORAGE_KEY}: {storage!r}; expected 'fp8' or no key")
        self._fp8 = storage == "fp8"

    def _submit_async_write(self, pending: _stock.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            if not self._fp8:
                return super()._submit_async_write(pending)
            tensors, event = self._copy_quantized_from_device(pending)
        else:
            tensors, event = self._gather_on_host(pending), _DONE
        tensors["token_ids"] = pending.token_ids.clone()

        assert pending.req_id not in self._req_futures, "two hidden-state writes for one req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        future = self._executor.submit(self._write_tensors, tensors, event, pending.filename, lock_fd)
        # vLLM >= 0.32 reports a request as sent only when it has an event here.
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _slots(self, pending: _stock.PendingSave) -> torch.Tensor:
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        return (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()

    def _gather_on_host(self, pending: _stock.PendingSave) -> dict[str, torch.Tensor]:
        # The stock helper knows this vLLM version's cache layout; advanced indexing copies,
        # so the rows stay valid after the scheduler frees and reuses the blocks.
        hidden = _stock.extract_from_kv_cache(self._kv_cache, self._slots(pending), pending.token_ids.shape[0])
        if self._fp8:
            return quantize_rows(hidden)
        return {"hidden_states": hidden.contiguous()}

    def _copy_quantized_from_device(self, pending: _stock.PendingSave) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """As the stock connector's copy, on its copy stream, with the states quantized before they leave the GPU."""
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        copy_stream.wait_event(ready)  # the copy stream sees every write the default stream made
        with torch.cuda.stream(copy_stream):
            with _gpu_sync_allowed():
                slots = self._slots(pending).to(device=self._kv_cache.device, non_blocking=True)
            hidden = _stock.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
            tensors = {}
            for key, t in quantize_rows(hidden).items():
                tensors[key] = torch.empty_like(t, device="cpu", pin_memory=True)
                tensors[key].copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        return tensors, done
