"""The weight-energy bootstrap: importance for what calibration never observed, and how its use is recorded.

:func:`bootstrap_importance` is ``Σ_rows w²`` per input column (float64 sums rounded to float32): the importance
a column would have if every input were equally likely, weighted by how much the weights there matter.  It is
what an expert the calibration text never routed to gets (a real calibration saw 14,922 of 15,360 experts), and
what every tensor gets in a conversion without an imatrix.

A GGUF written with importance records it under two keys (written by :mod:`quantkit.convert.provenance`):

``quantkit.imatrix.calibration`` (:data:`CALIBRATION_KEY`)
    ``imatrix`` (every matrix observed), ``imatrix+bootstrap``, ``bootstrap`` (no imatrix) or ``none``.
``quantkit.imatrix.bootstrap`` (:data:`BOOTSTRAP_KEY`)
    ARRAY[STRING], one item per tensor with bootstrapped matrices: ``"<name>"`` for a 2-D tensor, else
    ``"<name>:<experts>"`` with the experts as ranges (:func:`expert_ranges`), e.g.
    ``"blk.3.ffn_up_exps.weight:0,5-7"``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ValidationError

BOOTSTRAP_KEY = "quantkit.imatrix.bootstrap"
CALIBRATION_KEY = "quantkit.imatrix.calibration"


def bootstrap_importance(w: np.ndarray) -> np.ndarray:
    """float32 ``[n]``: Σ over rows of ``w**2`` for each input column of ``w[rows, n]``."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValidationError(f"bootstrap importance needs a 2-D [rows, n] weight, got shape {w.shape}")
    w64 = w.astype(np.float64, copy=False)
    return np.einsum("rn,rn->n", w64, w64).astype(np.float32)


def expert_ranges(experts: list[int]) -> str:
    """Sorted expert indices as ranges: ``[0, 5, 6, 7, 9]`` -> ``"0,5-7,9"``."""
    parts, start = [], None
    for i, e in enumerate(experts):
        if start is None:
            start = e
        if i + 1 == len(experts) or experts[i + 1] != e + 1:
            parts.append(str(start) if start == e else f"{start}-{e}")
            start = None
    return ",".join(parts)
