"""The final-state check's head: argmax(lm_head(norm(h_N))) of a shard's chosen final-layer states, on the GPU
when there is one (verify's scan, pipeline/verification/scan.py, calls it from its threads); which masked positions are
chosen, and their chunks."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable

import numpy as np
import torch

from pipeline.verification.reference.model import FinalHeadModel, ReferenceModel

# [positions, vocab] fp32 logits are large (8,192 x 128k = 4 GiB): a shard's positions go through
# lm_head in chunks, and at most two chunks are on the GPU at once
FINAL_CHUNK_POSITIONS = 8192
FINAL_HEAD_SLOTS = 2


class FinalHead:
    """argmax(lm_head(norm(h))) for the final-state pass (every masked position, or a seeded
    sample of `verify.final_state_positions_per_shard` per shard).

    At 8B scale lm_head is ~6% of the target's FLOPs per token, so this pass is not free. On a
    GPU it runs lm_head on bf16 tensor cores with fp32 outputs (`mode` "bf16-fp32": the norm in
    fp32, its output and the weight rounded to bf16, as the target itself serves), or, where
    torch lacks `mm(..., out_dtype=)`, as a TF32 matmul ("tf32"); on a CPU in the reference's
    fp32 ("fp32"). The reference-sample checks use the fp32 forward, never this. On a GPU each of
    the two slots has a CUDA stream of its own and chunks go up from pinned memory, so one chunk's
    copy overlaps the other's matmul (an 8,192-position chunk's pageable copy up took as long as its
    matmul on an H200, 12.5 against 12.7 ms; from page-locked memory 1.2 ms).
    """

    def __init__(self, reference: ReferenceModel | FinalHeadModel) -> None:
        self.reference = reference
        self.wants_pinned = reference.device.type == "cuda"  # chunks copied up from page-locked memory
        self.mode, self.weight = "fp32", None
        self._slots: queue.SimpleQueue = queue.SimpleQueue()
        head = reference.lm_head
        if reference.device.type != "cuda":
            for _ in range(FINAL_HEAD_SLOTS):
                self._slots.put(None)
            return
        for _ in range(FINAL_HEAD_SLOTS):
            self._slots.put(torch.cuda.Stream(reference.device))
        self.mode = "tf32"
        if getattr(head, "bias", None) is None:
            weight = head.weight.detach().to(torch.bfloat16)
            try:
                torch.mm(weight[:2], weight[:2].t(), out_dtype=torch.float32)
                self.mode, self.weight = "bf16-fp32", weight
            except (TypeError, RuntimeError, NotImplementedError):
                pass
        # the slots' streams must see the weights, which were made on the loading thread's stream
        torch.cuda.synchronize(reference.device)

    @torch.inference_mode()
    def argmax(self, final_states: torch.Tensor, timed: Callable[[str, float], float] | None = None) -> torch.Tensor:
        """argmax over the vocabulary for final (pre-norm) states [P, H] (on the host, or already on the head's device:
        the rows the per-sample scoring uploaded), on the CPU. `timed` (e.g. `ShardScan.timed`) is told where the time
        went: head_pin, head_slot_wait, head_compute."""
        return self.predict(final_states, None, timed)[0]

    @torch.inference_mode()
    def predict(self, final_states: torch.Tensor, tokens: torch.Tensor | None,
                timed: Callable[[str, float], float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`argmax`, and where `tokens` [P, K] (token ids per state) is given, the log-probabilities [P, K] the head gives
        those tokens (fp32, on the CPU): the per-sample next-token test's evidence (pipeline/verification/samples/next_token.py)."""
        lap = timed or (lambda _key, _since: time.perf_counter())
        out, chosen = [], []
        for i in range(0, final_states.shape[0], FINAL_CHUNK_POSITIONS):
            t = time.perf_counter()
            chunk = final_states[i : i + FINAL_CHUNK_POSITIONS]
            if self.wants_pinned and chunk.device.type == "cpu" and not chunk.is_pinned():
                chunk = chunk.pin_memory()  # a host copy, outside the slot: threads do it in parallel
                t = lap("head_pin", t)
            stream = self._slots.get()
            t = lap("head_slot_wait", t)
            if stream is not None and chunk.is_cuda:  # states made on the caller's stream: this one waits for them
                stream.wait_stream(torch.cuda.current_stream(chunk.device))
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    logits = self._logits(chunk)
                    best = logits.argmax(-1)
                    if tokens is None:
                        out.append(best.cpu())  # .cpu() waits for this stream only
                    else:
                        wanted = tokens[i : i + FINAL_CHUNK_POSITIONS].to(logits.device, non_blocking=True)
                        picked = logits.gather(1, wanted) - torch.logsumexp(logits, -1, keepdim=True)
                        both = torch.cat([best[:, None].float(), picked], 1).cpu()  # one host copy
                        out.append(both[:, 0].long())
                        chosen.append(both[:, 1:])
            finally:
                self._slots.put(stream)
                lap("head_compute", t)
        return torch.cat(out), (torch.cat(chosen) if tokens is not None else None)

    def _logits(self, chunk: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.reference.final_logits(chunk.to(self.reference.device, non_blocking=True))
        states = chunk.to(self.reference.device, non_blocking=True).to(self.reference.dtype)
        normed = self.reference.final_norm(states)
        return torch.mm(normed.to(torch.bfloat16), self.weight.t(), out_dtype=torch.float32)


def sample_final_positions(masked: list, limit: int | None, seed: int, shard_name: str) -> list:
    """The masked positions whose final state goes through lm_head: all of them, or a seeded
    sample of `limit` across the shard (`verify.final_state_positions_per_shard`) of the candidates (with the per-sample
    tests on, the masked positions they judge)."""
    total = sum(len(p) for _, p, _ in masked)
    if limit is None or total <= limit:
        return masked
    rng = np.random.default_rng([seed, int.from_bytes(shard_name.encode()[-8:], "little")])
    keep = np.zeros(total, dtype=bool)
    keep[rng.choice(total, size=limit, replace=False)] = True
    out, start = [], 0
    for name, positions, ids in masked:
        chosen = positions[keep[start : start + len(positions)]]
        start += len(positions)
        if len(chosen):
            out.append((name, chosen, ids))
    return out


def split_positions(chosen: list, size: int) -> list[list]:
    """(name, positions, ids) items cut into pieces of at most `size` positions, in order."""
    pieces, piece, room = [], [], size
    for name, positions, ids in chosen:
        while len(positions):
            taken, positions = positions[:room], positions[room:]
            piece.append((name, taken, ids))
            room -= len(taken)
            if room == 0:
                pieces.append(piece)
                piece, room = [], size
    if piece:
        pieces.append(piece)
    return pieces
