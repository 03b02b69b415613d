"""Input checks run in parallel, so they scale with the encoders they guard (a serial numpy scan would not)."""
import numba
import numpy as np


@numba.njit(parallel=True, cache=True)
def first_nonfinite_row(x: np.ndarray) -> int:
    """Index of the first row of float32 ``x[rows, n]`` holding a NaN or Inf, or -1 when every value is finite."""
    rows, n = x.shape
    bad = np.zeros(rows, np.bool_)
    for r in numba.prange(rows):
        for j in range(n):
            if not np.isfinite(x[r, j]):
                bad[r] = True
                break
    for r in range(rows):
        if bad[r]:
            return r
    return -1
