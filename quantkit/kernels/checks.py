"""Input checks run in parallel, so they scale with the encoders they guard (a serial numpy scan would not)."""
import numba
import numpy as np

_EXPONENT = np.uint32(0x7F800000)


@numba.njit(parallel=True, cache=True)
def _nonfinite_rows(bits: np.ndarray) -> np.ndarray:
    rows, n = bits.shape
    bad = np.zeros(rows, np.bool_)
    for r in numba.prange(rows):
        # NaN and Inf are exactly the values whose exponent bits are all ones; an integer OR-reduction of that
        # test has no branch and is associative, so it vectorizes (a float test with an early exit does not)
        found = np.uint32(0)
        for j in range(n):
            found |= np.uint32((bits[r, j] & _EXPONENT) == _EXPONENT)
        bad[r] = found != 0
    return bad


def first_nonfinite_row(x: np.ndarray) -> int:
    """Index of the first row of float32 ``x[rows, n]`` holding a NaN or Inf, or -1 when every value is finite."""
    bad = np.flatnonzero(_nonfinite_rows(x.view(np.uint32)))
    return int(bad[0]) if bad.size else -1
