"""Log-probabilities, greedy tokens and top-k ids from float32 logits, as ds4's ``score_official`` computes them.

Per row: ``max`` is the largest finite logit, ``logsum = max + log(sum(exp(v - max)))`` over the finite logits in
float64, a token's log-probability is ``v - logsum``; the greedy token is the first index holding ``max``; the
top-k ids are ordered by logit descending, ties by lower id first, non-finite logits excluded.  ``-inf`` logits
(masked tokens) are allowed; NaN or ``+inf`` means the model is broken and raises :class:`NonFiniteLogits`.
"""
from __future__ import annotations

import numpy as np

from ..errors import ValidationError

#: Rows handled per block when converting to float64 (bounds the temporary to ROW_BLOCK x vocab x 8 bytes).
ROW_BLOCK = 64


class NonFiniteLogits(ValidationError):
    """A model produced NaN or +inf logits."""

    def __init__(self, row: int, what: str):
        self.row = row
        super().__init__(f"logits row {row} holds {what}")


def check_logits(logits: np.ndarray, n_rows: int, what: str) -> np.ndarray:
    """``logits`` as a float32 ``[n_rows, vocab]`` array, or an error naming ``what`` was evaluated."""
    logits = np.asarray(logits)
    if logits.dtype != np.float32 or logits.ndim != 2 or logits.shape[0] != n_rows or logits.shape[1] < 1:
        raise ValidationError(f"{what}: the model returned logits of dtype {logits.dtype} and shape "
                              f"{logits.shape}, expected float32 [{n_rows}, vocab]")
    return logits


def log_normalizers(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(logsum float64 [n], greedy int64 [n])`` per row (module doc)."""
    n = logits.shape[0]
    logsum = np.empty(n, np.float64)
    greedy = np.empty(n, np.int64)
    for start in range(0, n, ROW_BLOCK):
        block = logits[start:start + ROW_BLOCK]
        bad = np.isnan(block) | (block == np.inf)
        if bad.any():
            row = int(np.argmax(bad.any(axis=1)))
            raise NonFiniteLogits(start + row, "NaN" if np.isnan(block[row]).any() else "+inf")
        some_finite = (block > -np.inf).any(axis=1)
        if not some_finite.all():
            raise NonFiniteLogits(start + int(np.argmin(some_finite)), "only -inf")
        top = block.max(axis=1).astype(np.float64)
        greedy[start:start + len(block)] = block.argmax(axis=1)
        shifted = np.exp(block.astype(np.float64) - top[:, None])
        logsum[start:start + len(block)] = top + np.log(shifted.sum(axis=1))
    return logsum, greedy


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` best token ids of one logits row (module doc order)."""
    finite = np.flatnonzero(row > -np.inf)
    k = min(k, len(finite))
    if k == 0:
        return np.empty(0, np.int64)
    values = row[finite]
    kth = np.partition(values, len(values) - k)[len(values) - k]
    candidates = finite[values >= kth]
    order = np.lexsort((candidates, -row[candidates].astype(np.float64)))
    return candidates[order[:k]].astype(np.int64)
