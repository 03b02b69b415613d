"""Compile (or load from numba's on-disk cache) the encoders a job needs, before the job runs.

numba compiles a kernel on its first call and, with ``cache=True``, stores the machine code on disk; later
processes load it in milliseconds.  On a fresh machine the first call pays the compile (seconds per kernel).
Worker pools call :func:`warm_encoders` with a different share of the job's kernels in each worker, so each kernel
is compiled once, in parallel with the others, and every worker then loads the rest from the cache (without this,
every worker compiled every kernel it met, the same ones in parallel).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .api import encode
from .registry import get_format

#: Seed of the warm-up block (one row of one block: the kernels' argument types do not depend on the sizes).
_SEED = 0


def warm_encoders(kinds: Iterable[tuple[object, bool]]) -> None:
    """Run each encoder ``(type, with importance)`` once on one small block (compiling or loading its kernel)."""
    rng = np.random.default_rng(_SEED)
    for qtype, with_importance in kinds:
        fmt = get_format(qtype)
        if not fmt.can_encode:
            continue
        x = rng.standard_normal((1, fmt.block_size)).astype(np.float32)
        importance = np.ones(fmt.block_size, np.float32) if with_importance else None
        encode(x, qtype, importance)


def encoder_kinds(jobs: Iterable) -> list[tuple[object, bool]]:
    """The distinct ``(type, with importance)`` of the encode jobs (:class:`quantkit.convert.tensors.TensorJob`),
    in a fixed order (so that every worker computes the same list and takes its own share)."""
    kinds = {(int(job.qtype), job.importance != "none") for job in jobs if job.kind == "encode"}
    return sorted(kinds)
