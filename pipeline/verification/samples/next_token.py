"""The per-sample next-token test: does a sample's final captured layer predict *this* sample's next tokens?

The target was trained to make lm_head(norm(h_N(t))) predict token t + 1, so its final state is tied to the sample's
tokens as tightly as the target predicts text. Per judged position t the head's log-probabilities of three tokens
are read: the next one (t + 1), the current one (t) and the one after the next (t + 2). The score is the contrast

    log p(best of t, t + 2) - log p(t + 1)

Clean, the next token is far likelier than its neighbours (a trained target: -8 nats at the median); a state that is
not this position's is not: another request's state predicts neither (~0), a state one token late (shifted rows, a
buffer copied a token late) predicts the current token (+10). Like the coherence ratios it cancels how predictable a
token is. On a random-weight target every token is about as likely as any other: the scores are noise around 0 and
the test, calibrated on the run's own scores as every per-sample test is, has no power and raises nothing.

Why a test of its own: on the DeepSeek-V3 / Kimi shape (MLA, routed experts) the first captured layer carries much
less of its own token than on a Llama (a linear map from E[id] leaves ~25% of its energy unexplained against ~5-20%),
so the token test separates a clean state from another request's by ~1.5 robust sigmas a position, which the
run-calibrated thresholds do not clear (docs/ARCHITECTURE.md "Per-sample tests: what is caught, what
cannot be").
"""

from __future__ import annotations

import numpy as np
import torch

TOKENS_PER_POSITION = 3  # the next token, the current one, the one after the next


def answered_positions(positions: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """The judged positions whose final state goes through lm_head: those with a next token where the token or the
    next one is the target's answer (loss mask 1): the final-state check's (the token's) and this test's (the next
    one's, `contrast_scores`)."""
    mask = np.asarray(loss_mask) != 0
    inside = positions[positions < len(mask) - 1]
    return inside[mask[inside] | mask[inside + 1]]


def contrast_tokens(ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[P, 3] int64 token ids whose log-probabilities the head gives at each answered position (`answered_positions`):
    t + 1, t, t + 2 (t + 2 clipped to the sample's last token)."""
    last = len(ids) - 1
    ids = np.asarray(ids).astype(np.int64)
    return np.stack([ids[positions + 1], ids[positions], ids[np.minimum(positions + 2, last)]], 1)


def contrast_scores(log_probs: torch.Tensor, answered: np.ndarray, judged: np.ndarray, loss_mask: np.ndarray) -> torch.Tensor:
    """[P] per judged position the contrast in nats, from the log-probabilities [A, 3] of `contrast_tokens` at the
    `answered` ones (the judge ranks them over the run: judge.token_identity); NaN where the next token
    is not the target's answer (a user's words are not what a target predicts, and a trained target's confident
    guesses at a user's new question after its answer made the contrast's clean tail: docs/ARCHITECTURE.md
    "Per-sample tests: what is caught, what cannot be") and at positions not answered."""
    mask = np.asarray(loss_mask) != 0
    length = len(mask)
    lp = log_probs.double()
    contrast = torch.maximum(lp[:, 1], lp[:, 2]) - lp[:, 0]
    # the position before the last: its t + 2 is clipped to t + 1 itself, which would cancel the contrast
    before_last = torch.from_numpy(answered == length - 2)
    contrast = torch.where(before_last, lp[:, 1] - lp[:, 0], contrast)
    contrast[torch.from_numpy(~mask[answered + 1])] = float("nan")
    out = torch.full((len(judged),), float("nan"), dtype=torch.float32)
    out[torch.from_numpy(np.searchsorted(judged, answered))] = contrast.float()
    return out
