"""Row-parallel calls of serial numba kernels: one contiguous part of the rows per numba thread.

The kernels are compiled without ``parallel=True`` and release the GIL (``nogil=True``); the threads are plain
Python threads.  numba's parfor pass and its gufunc wrapper were a large share of each kernel's first compile
(the cost a fresh machine pays once per kernel; a tenth to a half of it, more for the small decoders), while a
thread pool costs nothing to compile.  Rows are independent, so the bytes do not depend on the split.  The part
count follows ``numba.get_num_threads()``: ``numba.set_num_threads(1)`` (the convert workers) runs the kernel
in the calling thread.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numba

_POOLS: dict[int, ThreadPoolExecutor] = {}


def over_rows(n_rows: int, run: Callable[[int, int], object]) -> None:
    """Call ``run(r0, r1)`` for contiguous parts covering rows ``[0, n_rows)``, one part per numba thread."""
    parts = max(1, min(n_rows, numba.get_num_threads()))
    if parts == 1:
        run(0, n_rows)
        return
    pool = _POOLS.get(parts)
    if pool is None:
        pool = _POOLS.setdefault(parts, ThreadPoolExecutor(parts, thread_name_prefix="quantkit-rows"))
    futures = [pool.submit(run, p * n_rows // parts, (p + 1) * n_rows // parts) for p in range(parts)]
    for f in futures:
        f.result()
