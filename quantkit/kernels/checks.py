"""Input checks run in parallel (:func:`quantkit.kernels.rows.over_rows`), so they scale with the encoders they
guard (a serial numpy scan would not)."""
import numba
import numpy as np

from .rows import over_rows

_EXPONENT = np.uint32(0x7F800000)


@numba.njit(cache=True, nogil=True)
def _nonfinite_rows(bits: np.ndarray, bad: np.ndarray) -> None:
    rows, n = bits.shape
    for r in range(rows):
        # NaN and Inf are exactly the values whose exponent bits are all ones; an integer OR-reduction of that
        # test has no branch and is associative, so it vectorizes (a float test with an early exit does not)
        found = np.uint32(0)
        for j in range(n):
            found |= np.uint32((bits[r, j] & _EXPONENT) == _EXPONENT)
        bad[r] = found != 0


#: Below this many values numpy scans in about a millisecond, less than the parallel kernel's first call costs
#: (numba loads it from its cache: ~0.25 s, the whole check of a GPU conversion's norms and routers).
SERIAL_CHECK_VALUES = 1 << 20


def first_nonfinite_row(x: np.ndarray) -> int:
    """Index of the first row of float32 ``x[rows, n]`` holding a NaN or Inf, or -1 when every value is finite."""
    if x.size < SERIAL_CHECK_VALUES:
        bad = ~np.isfinite(x).all(axis=1)
    else:
        bits = x.view(np.uint32)
        bad = np.zeros(bits.shape[0], np.bool_)
        over_rows(bits.shape[0], lambda r0, r1: _nonfinite_rows(bits[r0:r1], bad[r0:r1]))
    bad = np.flatnonzero(bad)
    return int(bad[0]) if bad.size else -1
