"""Log-probabilities, greedy tokens and top-k ids from float32 logits, as ds4's ``score_official`` computes them.

Per row: ``max`` is the largest finite logit, ``logsum = max + log(sum(exp(v - max)))`` over the finite logits in
float64, a token's log-probability is ``v - logsum``; the greedy token is the first index holding ``max``; the
top-k ids are ordered by logit descending, ties by lower id first, non-finite logits excluded.  ``-inf`` logits
(masked tokens) are allowed; NaN or ``+inf`` means the model is broken and raises :class:`NonFiniteLogits`.

:func:`log_normalizers` computes them on the host (numpy, rows over threads).  :func:`device_log_normalizers` is
the same arithmetic in torch where the logits already are: on CUDA the runtime computes them beside the forward
pass, so scoring's host work is a few gathers per case instead of a float64 pass over every logit (which took
longer on the host than the pass on an H200).  Its sums run in another order: equal to :func:`log_normalizers`
within float64 rounding, the greedy ids identical (tests/test_scoring.py).  :class:`NormalizedRows` carries rows
with their normalizers from wherever they were computed.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import ValidationError
from ..resources import available_cpus

#: Rows handled per block when converting to float64 (bounds each thread's temporary to ROW_BLOCK x vocab x 8 bytes).
ROW_BLOCK = 16
#: Threads sharing the rows of one call (numpy releases the GIL in the float64 exp that dominates; per-row results
#: do not depend on the split).  Rows per thread at least :data:`ROWS_PER_THREAD`: a thread costs ~50 us.
MAX_THREADS = 8
ROWS_PER_THREAD = 64

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


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
    """``(logsum float64 [n], greedy int64 [n])`` per row (module doc), rows split over threads."""
    global _pool
    n = logits.shape[0]
    logsum = np.empty(n, np.float64)
    greedy = np.empty(n, np.int64)
    threads = min(MAX_THREADS, available_cpus(), max(1, n // ROWS_PER_THREAD))
    if threads == 1:
        bad = _normalize_rows(logits, 0, n, logsum, greedy)
    else:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="quantkit-logsum")
        bounds = np.linspace(0, n, threads + 1).astype(int)
        found = list(_pool.map(lambda i: _normalize_rows(logits, bounds[i], bounds[i + 1], logsum, greedy),
                               range(threads)))
        bad = min((b for b in found if b is not None), default=None)
    if bad is not None:
        raise _non_finite(logits, bad)
    return logsum, greedy


@dataclass(frozen=True)
class NormalizedRows:
    """Logits rows with their :func:`log_normalizers`; sliced by rows like the array."""

    rows: np.ndarray            # float32 [n, vocab]
    logsum: np.ndarray          # float64 [n]
    greedy: np.ndarray          # int64 [n]

    @classmethod
    def of(cls, rows: np.ndarray) -> "NormalizedRows":
        """``rows`` normalized on the host (:func:`log_normalizers`)."""
        return cls(rows, *log_normalizers(rows))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rows.shape

    def __getitem__(self, rows: slice) -> "NormalizedRows":
        return NormalizedRows(self.rows[rows], self.logsum[rows], self.greedy[rows])


#: Most float64 values :func:`device_log_normalizers` widens at once (256 MiB).
DEVICE_BLOCK_VALUES = 1 << 25


def device_log_normalizers(logits):
    """``(logsum, greedy)`` of a float32 torch tensor ``[n, vocab]`` of finite or ``-inf`` logits, as torch
    tensors where ``logits`` is (float64 ``[n]``, int64 ``[n]``): :func:`log_normalizers`' arithmetic, rows
    widened in blocks of at most :data:`DEVICE_BLOCK_VALUES` values.  Nothing here waits for the device: the
    caller checks finiteness (the runtime's logits are checked before they are returned)."""
    import torch

    top, greedy = logits.max(dim=1)         # the first index holding the maximum, as numpy's argmax
    top = top.double()
    logsum = torch.empty_like(top)
    step = max(1, DEVICE_BLOCK_VALUES // max(1, logits.shape[1]))
    for start in range(0, logits.shape[0], step):
        block = logits[start:start + step].double().sub_(top[start:start + step, None]).exp_()
        torch.log(block.sum(dim=1), out=logsum[start:start + step])
    return logsum.add_(top), greedy


def _normalize_rows(logits: np.ndarray, r0: int, r1: int, logsum: np.ndarray, greedy: np.ndarray) -> int | None:
    """Fill rows ``r0:r1`` of ``logsum`` and ``greedy``; the first row whose largest logit is not finite (NaN or
    +inf somewhere in it, or nothing above -inf), or None.  ``max`` propagates NaN, so one reduction checks a row."""
    shifted = np.empty((min(ROW_BLOCK, r1 - r0), logits.shape[1]), np.float64)
    for start in range(r0, r1, ROW_BLOCK):
        block = logits[start:min(start + ROW_BLOCK, r1)]
        top32 = block.max(axis=1)
        finite = np.isfinite(top32)
        if not finite.all():
            return start + int(np.argmin(finite))
        greedy[start:start + len(block)] = block.argmax(axis=1)
        top = top32.astype(np.float64)
        buf = shifted[:len(block)]
        np.subtract(block, top[:, None], out=buf, dtype=np.float64)    # exact: float32 widens to float64
        np.exp(buf, out=buf)
        logsum[start:start + len(block)] = top + np.log(buf.sum(axis=1))
    return None


def _non_finite(logits: np.ndarray, row: int) -> NonFiniteLogits:
    """The error of the first bad row's block, as a block-by-block check reports it: its first row holding NaN or
    +inf, else its first row holding nothing above -inf."""
    start = row - row % ROW_BLOCK
    block = logits[start:start + ROW_BLOCK]
    bad = np.isnan(block) | (block == np.inf)
    if bad.any():
        first = int(np.argmax(bad.any(axis=1)))
        return NonFiniteLogits(start + first, "NaN" if np.isnan(block[first]).any() else "+inf")
    return NonFiniteLogits(row, "only -inf")


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
