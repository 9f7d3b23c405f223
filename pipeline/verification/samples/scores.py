"""Every sample scored on its own: per-token coherence of the captured layers with each other and
with the token (the verdicts on these scores: pipeline/verification/samples/judge.py).

The residual stream ties a token's captured layers together and to its own embedding: layer j is
largely a linear function of the other captured layers and of E[token]. A linear predictor per
layer, fitted by least squares on a seeded subset of the run (`verify.coherence_fit_tokens` token
rows), leaves a small residual on clean data. Per sampled position t (every `verify.sample_stride`-th,
seeded offset per sample, position 0 left out: the attention sink's state is an outlier of every
model) and per test it scores the residual energy as a share of the state's:

    layer j      ||h_j - predict(other captured layers, E[ids[t]])||^2 / ||h_j||^2
    token        ||h_a - predict(E[ids[t]])||^2 / ||h_a||^2   (a = the first captured layer)
    whitened j   ||S_j^-1 (h_j - predict(...))||^2 / ||h_j||^2, scaled (S_j: the clean residual's covariance)

fp8 states: each of these residual energies less its expected rounding energy (pipeline/verification/samples/rounding.py).

The clean residual of a layer lives mostly in a few directions; noise or wrong values added to a state
spread over all of them, so the whitened share sees them where the raw share cannot (tiny Llama, 540
samples: noise of relative RMS 0.2-0.3 on 16 positions of one layer, where the raw share caught 0.3 on
two layers and nothing up to 2 on the others; the 2-core CPU, recorded 2026-12-02 in commit 31adcff: "Sensitivity,
measured" in `git show c1aae8c:docs/ARCHITECTURE.md`; today's limits: docs/ARCHITECTURE.md "Per-sample tests:
what is caught, what cannot be").

Every run of `verify.sample_window` consecutive positions of every sample is a window; its score is
the mean log residual share of its judged positions, the largest left out (robust to one odd token). Windows are judged against all windows of the run (median, and the MAD
as a robust sigma: a fault in one sample barely moves either), one-sided, at z* from a Bonferroni
correction over every window of every test: under a normal law of the clean window scores the
whole run's false-alarm probability is <= `verify.sample_false_alarm`. Zeroed rows, rows of another
request or layer, shifted rows and noise break the fit (docs/ARCHITECTURE.md, "Per-sample tests: what is caught,
what cannot be").
"""

from __future__ import annotations

import contextlib
import queue
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.verification.host_staging import StagingBuffer, new_buffer
from pipeline.verification.samples.energy import share_scale, squared_norm
from pipeline.verification.samples.exchange import EXCHANGE_POSITIONS, ExchangeTest
from pipeline.verification.samples.least_squares import FoldFit, fit_folds
from pipeline.verification.samples.positions import BATCH_ROWS, batches, judged_positions, row_spans, seeded_draw
from pipeline.verification.samples.rounding import RoundingFloor, rounding_uncertainty

INDICES_PER_ROW = 8  # int64 indices a batch uploads per judged row, at most (Coherence._indices)
REFIT_Z = 4.0  # robust sigmas off the other fitted samples' mean share: left out of the second fit
FOLD_MIN_SAMPLES = 8  # fewer samples have no median and MAD to judge by: the refit's outlier pass, a fold's own
# scan threads scoring on a GPU at once, each on a CUDA stream of its own: a batch's upload, products and host copy
# wait for that batch's work only, not for every thread's work queued on the one default stream
SCORING_SLOTS = 4


@dataclass
class SampleScores:
    sample: int
    positions: np.ndarray  # [P] the sampled positions
    # [P, 3L + 3] per test (tests_per_position): contrast ratios (layers, token, all layers), raw residual shares
    # (layers, all), whitened residual shares (layers); CPU
    shares: torch.Tensor
    # per adjacent pair of captured layers (i, i + 1): mean log(share as written / share with the two
    # exchanged) over the first EXCHANGE_POSITIONS judged positions; > 0: they fit better exchanged
    exchange: torch.Tensor | None = None
    # [P] the next-token test's scores (pipeline/verification/samples/next_token.py), set by the scan where the target's head is loaded
    next_token: torch.Tensor | None = None
    # [P, 3L + 3] fp8 states: per test the standard deviation the rounding leaves in the log of each share (0 where a
    # test keeps the rounding in its energies: the contrast ratios), `rounding.rounding_uncertainty`; None: not fp8
    rounding: torch.Tensor | None = None


class Coherence(RoundingFloor, ExchangeTest):
    """The fitted predictors: one matmul of a token's inputs [h_0 .. h_{L-1}, E[id], 1] gives every
    captured layer's prediction from the others and the first layer's from the embedding alone."""

    def __init__(self, layer_ids: list[int], embedding: torch.Tensor, stride: int, seed: int, quantized: bool = False) -> None:
        self.layer_ids, self.embedding, self.stride, self.seed = layer_ids, embedding, stride, seed
        # the states are fp8's dequantized values: every residual energy is scored less the rounding's expected share
        self.quantized = quantized
        self.device = embedding.device
        # the scoring products' dtype: bf16 tensor cores on a GPU (rounding adds ~1e-5 to a share of ~1e-1), fp32 on a CPU
        self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.weights: list[torch.Tensor] | None = None  # per fold, the predictors that score it: [(L + 1) H + 1, (L + 1) H]
        # per (fold, half), the whitened test's basis of each layer's clean residual: (eigenvectors [L, H, H], weights [L, H])
        self.whiteners: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        # [L, L]: the whitened share isotropic noise of relative RMS 1 on layer j adds to layer k's test (1 on the
        # diagonal): noise on a layer also enters the other layers' predictions; the judge names a layer with it
        self.leak: torch.Tensor | None = None
        self.fit_tokens = 0
        self.refit_excluded: list[int] = []  # samples left out of the second fit
        self._compute_cache: dict = {}  # fold -> (weights, as scored, layer differences, constant row); (fold, half) -> whitener
        self._slots: queue.SimpleQueue = queue.SimpleQueue()  # CUDA streams (None on a CPU) for scoring threads
        self._threads_ready = False

    def states(self, rows: np.ndarray | torch.Tensor, dtype: str) -> torch.Tensor:
        """[P, L, H] rows as stored (bf16 as int16) -> states [P, L, H] fp32 on the device."""
        t = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))
        if dtype == "BF16":
            t = t.view(torch.bfloat16)
        return t.to(self.device, non_blocking=True).float()

    def inputs(self, rows: np.ndarray | torch.Tensor, dtype: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[P, L, H] rows (bf16 as int16) -> (states [P, L, H] fp32, inputs [P, (L+1)H+1]) on the device."""
        h = self.states(rows, dtype)
        e = self.embedding[ids.to(self.device)].float()
        ones = torch.ones(h.shape[0], 1, device=self.device)
        return h, torch.cat([h.flatten(1), e, ones], 1)

    def fold(self, sid: int) -> int:
        """Samples fall into two seeded folds; a sample is scored by the predictors fitted on the
        other fold (cross-fitting: fitted on itself, a linear map of (L+1)H inputs absorbs much of
        a whole-sample fault, e.g. two layers exchanged)."""
        return seeded_draw(f"fold/{self.seed}/{sid}", 2)

    def half(self, sid: int) -> int:
        """Each fold falls into two seeded halves: a sample's whitened test uses the residual covariance of its fold's
        other half. Out of sample for every sample alike: a covariance estimated on a sample itself fits its residual's
        smallest directions (a sample left out of the fit scored 3.7x higher whitened than those in it, tiny Llama)."""
        return seeded_draw(f"half/{self.seed}/{sid}", 2)

    def fit(self, chunks) -> None:
        """Least squares on (fold, sample, inputs) chunks, one per fold (pipeline/verification/samples/least_squares.py); then once
        more without the samples the first fit finds far off the others (a faulty sample in the fit would make every
        sample of the other fold score worse)."""
        chunks = list(chunks)
        self._take(fit_folds(chunks, self.half, len(self.layer_ids), self.embedding.shape[1]))
        if self.weights is None or len(chunks) < FOLD_MIN_SAMPLES:
            self._ready_for_threads()
            return
        L, H = len(self.layer_ids), self.embedding.shape[1]
        means = []
        for fold, _sid, x in chunks:
            h = x[:, : L * H].reshape(-1, L, H)
            shares = self._shares(h, self._predict(x, self._compute_weights(fold)[0]), fold if self.quantized else None)
            means.append(shares.clamp_min(1e-30).log().mean(0))
        means = torch.stack(means).double()
        median = means.median(0).values
        sigma = ((means - median).abs().median(0).values * 1.4826).clamp_min(1e-6)
        keep = ((means - median) / sigma).max(1).values <= REFIT_Z
        self.refit_excluded = [int(c[1]) for c, k in zip(chunks, keep.tolist(), strict=True) if not k]
        if self.refit_excluded:
            self._take(fit_folds([c for c, k in zip(chunks, keep.tolist(), strict=True) if k], self.half, L, H))
        self._ready_for_threads()

    def _take(self, fitted: FoldFit | None) -> None:
        """A fit's predictors, whiteners and leak pattern (a fit without rows leaves the ones before)."""
        if fitted is not None:
            self.weights, self.whiteners, self.leak, self.fit_tokens = fitted.weights, fitted.whiteners, fitted.leak, fitted.rows

    def _ready_for_threads(self) -> None:
        """Everything the scoring threads share is made here, on the fitting thread, before they start: the weights
        and whiteners in the scoring dtype (made lazily on a slot's stream, another stream could read them before
        they exist) and the slots' streams, which see what this thread's stream made only after a synchronize."""
        if self._threads_ready:
            return
        self._threads_ready = True
        if self.weights is not None:
            for fold in range(2):
                self._compute_weights(fold)
                if self.quantized:
                    self._noise_gains(fold)
                for half in range(2):
                    self._compute_whitener(fold, half)
                    if self.quantized:
                        self._noise_gains(fold, half)
        self._exchanged_orders(len(self.layer_ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(SCORING_SLOTS):
                self._slots.put(torch.cuda.Stream(self.device))
        else:
            self._slots.put(None)

    def _compute_weights(self, fold: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fold's predictors in the dtype the scoring matmul runs in (bf16 on a GPU: tensor cores; rounding
        adds ~1e-5 to a share of ~1e-1), [L - 1, H, (L + 1) H] W_i - W_{i+1}, the differences of adjacent
        captured layers' input rows (the exchange test), and the constant row as scored, in fp32 (added to the
        products' fp32 results); made once per fit and fold, not per sample."""
        weights = self.weights[fold]
        cached = self._compute_cache.get(fold)
        if cached is None or cached[0] is not weights:
            L, H = len(self.layer_ids), self.embedding.shape[1]
            rows = weights[: L * H].reshape(L, H, -1)
            as_scored = weights.to(self.compute_dtype)
            cached = self._compute_cache[fold] = (weights, as_scored, (rows[:-1] - rows[1:]).to(self.compute_dtype),
                                                  as_scored[L * H + H].float())
        return cached[1], cached[2], cached[3]

    def _compute_whitener(self, fold: int, half: int) -> torch.Tensor:
        """The whitened test's basis [L, H, H]: each layer's eigenvectors with their weights folded into the columns,
        U diag(weights), so that score = ||r U diag(weights)||^2 is one product and one reduction; in the scoring dtype
        (bf16 on a GPU: a column scaled by a constant rounds as the eigenvector does, every direction alike, unlike
        S^-1, whose 1e2-1e4 spread of scales bf16 would blur)."""
        vectors, weights = self.whiteners[(fold, half)]
        cached = self._compute_cache.get((fold, half))
        if cached is None or cached[0] is not vectors:
            cached = self._compute_cache[(fold, half)] = (vectors, (vectors * weights[:, None, :]).to(self.compute_dtype))
        return cached[1]

    def _predict(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.to(weights.dtype), weights).float()

    def _shares(self, h: torch.Tensor, pred: torch.Tensor, fold: int | None = None) -> torch.Tensor:
        """[P, L + 1] residual shares of the layers (from the others) and of the first layer (from E),
        given the predictions [P, (L + 1) H] (the fit's outlier pass; a scored batch forms its own in _score_batch);
        fp8 states (`fold` given): beyond the rounding, as `_score_batch` scores them (`_beyond_rounding`)."""
        L, H = h.shape[1], h.shape[2]
        pred = pred.reshape(-1, L + 1, H)
        target = torch.cat([h, h[:, :1]], 1)
        energy = h.pow(2).sum(-1)
        _, scale, floor = share_scale(torch.cat([energy, energy[:, :1]], 1))
        residual = (target - pred).pow(2).sum(-1)
        if fold is not None:
            noise, own, variance = self._rounding_noise(h, fold)
            residual = torch.cat([self._beyond_rounding(residual[:, :L], noise, variance, self._noise_gains(fold))[0],
                                  self._beyond_rounding(residual[:, L:], own[:, :1], variance[:, :H],
                                                        torch.ones(H, 1, device=h.device))[0]], 1)
        return torch.addcmul(floor, residual, scale)

    def score(self, sid: int, hidden: np.ndarray, dtype: str, ids: torch.Tensor) -> SampleScores:
        """One sample's scores (as `score_samples` gives them)."""
        return self.score_samples([(sid, hidden, dtype, ids)])[0]

    @torch.inference_mode()
    def score_samples(self, samples: list[tuple[int, np.ndarray, str, np.ndarray | torch.Tensor]],
                      timed: Callable[[str, float], float] | None = None,
                      staging: StagingBuffer | None = None) -> list[SampleScores]:
        """Per sample (id, hidden states [T, L, H] as stored, dtype, input ids) its scores, in order. A
        shard's samples are scored together, in batches of up to BATCH_ROWS judged rows sorted by fold and half, so
        a GPU runs a few large products per shard instead of a dozen small kernels per sample. The rows go up from
        `staging` (the scan's, made before it: pipeline/verification/host_staging.py; None: a buffer made for this call). `timed`
        (e.g. `ShardScan.timed`) is told where the time went: coherence_stage, coherence_slot_wait, coherence_compute."""
        return self.score_keeping_final_states(samples, {}, timed, staging)[0]

    @torch.inference_mode()
    def score_keeping_final_states(self, samples: list[tuple[int, np.ndarray, str, np.ndarray | torch.Tensor]],
                                   final_positions: dict[int, np.ndarray],
                                   timed: Callable[[str, float], float] | None = None,
                                   staging: StagingBuffer | None = None) -> tuple[list[SampleScores], dict[int, torch.Tensor]]:
        """`score_samples`, and per sample id in `final_positions` the final captured layer's states [P, H] (as stored,
        on the scoring device) at those positions, which must be judged ones (`judged_positions`): the final-state
        check takes them from the rows already uploaded for scoring instead of reading the shard again."""
        lap = timed or (lambda _key, _since: time.perf_counter())
        L = len(self.layer_ids)
        scored: dict[int, SampleScores] = {}
        groups: dict[str, list] = {}
        for sid, hidden, dtype, ids in samples:
            positions = judged_positions(hidden.shape[0], self.stride, self.seed, sid)
            final = final_positions.get(sid, positions[:0])
            wanted = np.searchsorted(positions, final)  # their rows among the sample's judged rows
            if not (wanted < len(positions)).all() or not np.array_equal(positions[wanted], final):
                raise ValueError(f"sample {sid}: final-state positions that the per-sample tests do not judge")
            if not len(positions):
                scored[sid] = SampleScores(sid, positions, torch.zeros(0, tests_per_position(L)))
            else:
                groups.setdefault(dtype, []).append((sid, hidden, ids, positions, self.fold(sid), self.half(sid), wanted))
        if groups:
            self._ready_for_threads()  # done by `fit`; here for predictors set by hand (one thread)
        final_states: dict[int, torch.Tensor] = {}
        for dtype, group in groups.items():
            # the products run per (fold, half) on contiguous row ranges, every other operation once per batch (the
            # H200's profile: a shard's samples in up to four batches spent the scan on per-operation work)
            group.sort(key=lambda item: item[4:6])
            for batch in batches(group, BATCH_ROWS):
                rows = sum(len(item[3]) for item in batch)
                buffer = staging or new_buffer(rows * batch[0][1][0].nbytes, INDICES_PER_ROW * rows,
                                               pinned=self.device.type == "cuda")
                # the host's part first, outside a slot: the scan threads copy rows at once, SCORING_SLOTS hold the GPU
                t = time.perf_counter()
                staged = self._gather(batch, rows, buffer), self._indices(batch, buffer)
                t = lap("coherence_stage", t)
                stream = self._slots.get()
                t = lap("coherence_slot_wait", t)
                try:
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        batch_scores, finals = self._score_batch(dtype, batch, *staged)
                finally:
                    self._slots.put(stream)
                    lap("coherence_compute", t)
                scored.update(batch_scores)
                final_states.update(zip([item[0] for item in batch], finals.split([len(item[6]) for item in batch]), strict=True))
        return [scored[sid] for sid, *_ in samples], {sid: final_states[sid] for sid in final_positions}

    def _gather(self, batch: list, n: int, buffer: StagingBuffer) -> torch.Tensor:
        """The batch's judged rows [n, L, H] as stored, gathered from the shards' memory maps into the staging buffer
        (reused: a batch ends with its host copy, which waits for its uploads). torch.index_select copies each row
        once and without the GIL (np.take with `out` copies through a buffer of its own: 4-7x slower on 32 KB rows,
        and 16 scan threads wait for each other's copies)."""
        first = batch[0][1]
        rows = buffer.view((n, *first.shape[1:]), torch.from_numpy(np.empty(0, first.dtype)).dtype)
        at = 0
        with warnings.catch_warnings():  # the memory map is read-only; nothing writes through the tensor view
            warnings.simplefilter("ignore", UserWarning)
            for _, hidden, _, positions, *_ in batch:
                torch.index_select(torch.from_numpy(hidden), 0, torch.from_numpy(positions), out=rows[at : at + len(positions)])
                at += len(positions)
        return rows

    def _indices(self, batch: list, buffer: StagingBuffer) -> torch.Tensor:
        """Every index the batch's scoring needs, in one staging buffer (one upload): per judged row its token, the
        previous and next tokens; per sample its first and last judged rows; per exchange-tried row its row and its
        sample; per sample its tried rows' count; the rows whose final states are kept."""
        lengths = np.array([len(item[3]) for item in batch])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        kept = np.minimum(lengths, EXCHANGE_POSITIONS)
        parts = [np.concatenate([np.asarray(ids)[positions + shift].astype(np.int64) for _, _, ids, positions, *_ in batch])
                 for shift in (0, -1)]
        parts.append(np.concatenate([np.asarray(ids)[np.minimum(positions + 1, len(ids) - 1)] for _, _, ids, positions, *_ in batch]))
        parts += [starts, starts + lengths - 1, np.concatenate([s + np.arange(k) for s, k in zip(starts, kept, strict=True)]),
                  np.repeat(np.arange(len(batch)), kept), kept, np.concatenate([s + item[6] for s, item in zip(starts, batch, strict=True)])]
        flat = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])
        out = buffer.index_view(flat.size)
        out.copy_(torch.from_numpy(flat))
        return out

    def _score_batch(self, dtype: str, batch: list, rows: torch.Tensor, indices: torch.Tensor) -> tuple[dict[int, SampleScores], torch.Tensor]:
        """Per judged position and test, the residual share against the share a mismatched
        contrast leaves (as a ratio; the tests judge its log): each layer predicted from the other
        layers of the *next* judged position of the same sample, the first layer from the embedding of
        the previous or next token. Clean, the true inputs explain far better (ratio ~0.1); a state that
        is not this token's at this position (zeroed, shifted, another request's or layer's, noise)
        is explained no better by its own inputs than by wrong ones (ratio -> 1). The ratio
        cancels how predictable a token is, which the share alone varies with. Also the final layer's states [P, H] of
        the rows kept for the final-state check, as stored."""
        L, H = len(self.layer_ids), self.embedding.shape[1]
        lengths = np.array([len(item[3]) for item in batch])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        n, kept, samples = int(lengths.sum()), np.minimum(lengths, EXCHANGE_POSITIONS), len(batch)
        m, p = int(kept.sum()), sum(len(item[6]) for item in batch)
        folds, halves = [item[4] for item in batch], [item[4:6] for item in batch]  # the batch is sorted by them
        fold_rows, half_rows = row_spans(folds, starts, starts + lengths), row_spans(halves, starts, starts + lengths)
        index = indices.to(self.device, non_blocking=True)
        tokens_at, neighbours = index[:n], index[n : 3 * n]
        firsts, lasts = index[3 * n : 3 * n + samples], index[3 * n + samples : 3 * n + 2 * samples]
        tried, of_sample, kept_rows, final_rows = index[3 * n + 2 * samples :].split([m, m, samples, p])
        # [n, L, H] as stored (bf16 on a GPU): never copied to fp32 as a whole; every operation that reads it with an
        # fp32 operand computes in fp32
        stored = (rows.view(torch.bfloat16) if dtype == "BF16" else rows).to(self.device, non_blocking=True)
        # a row's prediction is (its layers) @ W[:LH] + E @ W[LH:LH+H] + W[LH+H]: the contrast rows (the other layers
        # of the next judged position) reuse the first product, the exchange rows correct it with
        # (h_{i+1} - h_i) @ (W_i - W_{i+1}); about half the multiply-adds of predicting them anew.
        # The constant row is added, not multiplied in as a column of ones: an inner dimension of H + 1 is odd, and
        # odd leading dimensions put every product with it on an unaligned GEMM (the H200's profile: a Turing-era
        # `align1` kernel, 0.87 s of the 8B scan at ~70 TFLOP/s).
        # Every pass over [n, L, H] costs a GPU as much as a product here (the H200's profile: elementwise kernels
        # were 40% of the scan's GPU time), so each is counted (bench/verify_sample_scoring.py --traffic): the layers' product
        # stays as the GEMM writes it, the residual and its contrast come from one "state minus token part" each, and
        # the exchange test corrects the residual in place of forming the exchanged states and their predictions.
        compute = self.compute_dtype

        def as_input(t: torch.Tensor) -> torch.Tensor:
            return t if t.dtype == compute else t.to(compute)

        flat = as_input(stored).flatten(1)
        token = as_input(self.embedding[tokens_at])
        from_layers = torch.empty(n, L * H, device=self.device, dtype=compute)
        from_token = torch.empty(n, (L + 1) * H, device=self.device)  # the layers' targets, then the first layer's
        for fold, (a, b) in fold_rows.items():
            weights, _, constant = self._compute_weights(fold)
            torch.mm(flat[a:b], weights[: L * H, : L * H], out=from_layers[a:b])
            torch.add(torch.mm(token[a:b], weights[L * H : L * H + H]), constant, out=from_token[a:b])
        energy = squared_norm(stored)  # [n, L]: each state's squared norm, the denominator of every share below
        # every share one multiply-add; columns as `share`'s, the first layer's again at the end
        inverse, scale, floor = share_scale(torch.cat([energy, energy[:, :1]], 1))
        base = torch.sub(stored.flatten(1), from_token[:, : L * H], out=torch.empty(n, L * H, device=self.device))
        residual = torch.sub(base, from_layers).view(n, L, H)
        first = stored[:, 0]
        energies = torch.cat([squared_norm(residual), squared_norm(first - from_token[:, L * H :])[:, None]], 1)
        share = torch.addcmul(floor, energies, scale)
        # the contrast: a row's state and token part against the next judged row's layers (a sample's last row: its
        # first row's), as shifted views and a fix-up of one row per sample, not a gather
        contrast = torch.empty(n, L * H, device=self.device)
        torch.sub(base[:-1], from_layers[1:], out=contrast[:-1])
        contrast[lasts] = base[lasts] - from_layers[firsts]
        contrast = torch.addcmul(floor[:, :L], squared_norm(contrast.view(n, L, H)), scale[:, :L])
        e = as_input(self.embedding[neighbours]).view(2, n, H)  # the previous tokens' rows, then the next tokens'
        from_neighbours = torch.empty(2, n, H, device=self.device)
        for fold, (a, b) in fold_rows.items():
            weights, _, constant = self._compute_weights(fold)
            torch.add(torch.matmul(e[:, a:b], weights[L * H : L * H + H, L * H :]), constant[L * H :], out=from_neighbours[:, a:b])
        tokens = torch.amin(squared_norm(first[None] - from_neighbours), 0) * inverse[:, 0]
        contrast = torch.cat([contrast, tokens[:, None]], 1)
        # the contrast ratios keep the rounding in both energies: less it, a row whose contrast is about its share (both
        # near the rounding's energy) becomes a ratio of two small differences (fp8, tiny project: 1e5, a false alarm)
        ratio, as_stored = share / contrast.clamp_min(1e-30), share  # the exchange test too: both its energies keep it
        uncertain = None  # fp8: [n, 3L + 3], the rounding's standard deviation in each test's log share
        if self.quantized:  # the residual shares less each residual's expected rounding energy (`_rounding_noise`)
            beyond, spread = torch.empty_like(energies), torch.empty_like(energies)
            variance = torch.empty(n, L * H, device=self.device)
            for fold, (a, b) in fold_rows.items():
                noise, own, variance[a:b] = self._rounding_noise(stored[a:b], fold)
                beyond[a:b, :L], spread[a:b, :L] = self._beyond_rounding(energies[a:b, :L], noise, variance[a:b],
                                                                         self._noise_gains(fold))
                # the first layer from E: its own rounding only
                beyond[a:b, L:], spread[a:b, L:] = self._beyond_rounding(energies[a:b, L:], own[:, :1], variance[a:b, :H],
                                                                         torch.ones(H, 1, device=self.device))
            share = torch.addcmul(floor, beyond, scale)
            uncertain = torch.zeros(n, tests_per_position(L), device=self.device)
            raw_uncertain = rounding_uncertainty(beyond[:, :L], spread[:, :L])
            uncertain[:, L + 2 : 2 * L + 2] = raw_uncertain
            uncertain[:, 2 * L + 2] = raw_uncertain.square().sum(1).sqrt() / L  # the log of a geometric mean of L
        raw = share[:, :L]
        # over all layers, of the ratios and of the shares: [n, 2]
        geometric = torch.stack([ratio[:, :L], raw], 1).clamp_min(1e-30).log().mean(2).exp()
        # whitened residual of each layer: ||r (U diag(weights))||^2 / ||h||^2 (an all-zero row: ZERO_ROW_SHARE)
        by_layer = as_input(residual).transpose(0, 1)  # [L, n, H]
        projected = torch.empty(L, n, H, device=self.device, dtype=compute)
        for (fold, half), (a, b) in half_rows.items():
            torch.bmm(by_layer[:, a:b], self._compute_whitener(fold, half), out=projected[:, a:b])
        white = squared_norm(projected).T
        if self.quantized:
            for (fold, half), (a, b) in half_rows.items():
                gains = self._noise_gains(fold, half)
                white[a:b], white_spread = self._beyond_rounding(white[a:b], variance[a:b] @ gains, variance[a:b], gains)
                uncertain[a:b, 2 * L + 3 :] = rounding_uncertainty(white[a:b], white_spread)
        white = torch.addcmul(floor[:, :L], white, scale[:, :L])
        tests = torch.cat([ratio, geometric[:, :1], raw, geometric[:, 1:], white], 1)
        exchange = torch.zeros(samples, max(L - 1, 0), device=self.device)
        if L > 1:  # the first EXCHANGE_POSITIONS judged positions of each sample, tried with adjacent layers exchanged
            gain = self._exchange_gain(stored[tried], residual[tried], inverse[tried], as_stored[tried, :L], folds, kept)
            exchange = exchange.index_add_(0, of_sample, gain) / kept_rows[:, None]
        finals = stored[final_rows, L - 1]  # before the host copy, which then waits for it too: another stream reads it
        # one host copy for the batch (tests, exchange and the rounding's uncertainty together)
        parts = [tests.flatten(), exchange.flatten().to(tests.dtype)] + ([uncertain.flatten()] if uncertain is not None else [])
        out = torch.cat(parts).cpu().split([part.numel() for part in parts])
        tests, exchange = out[0].reshape(tests.shape), out[1].double().reshape(exchange.shape)
        uncertain = out[2].reshape(tests.shape) if uncertain is not None else None
        scores = {sid: SampleScores(sid, positions, tests[s : s + k], exchange[i],
                                    rounding=uncertain[s : s + k] if uncertain is not None else None)
                  for i, ((sid, _, _, positions, *_), s, k) in enumerate(zip(batch, starts, lengths, strict=True))}
        return scores, finals

def tests_per_position(layers: int) -> int:
    """Scores per judged position: contrast ratios (layers, token, all layers), raw residual shares (layers, all
    layers), whitened residual shares (layers)."""
    return 3 * layers + 3
