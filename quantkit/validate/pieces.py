"""Which pieces of a planned tensor an audit produces, and which of their rows.

A tensor's pieces (:func:`quantkit.convert.tensors.pieces`) are the converter's own units of work, so producing
only some of them gives exactly the bytes ``convert`` wrote for those rows.  An audit picks experts (pieces of a
3-D tensor by ``matrix``) or rows of the tensor's ``[rows, n]`` view (:func:`quantkit.convert.tensors.tensor_rows`);
:func:`chosen` maps that choice onto the pieces.
"""
from __future__ import annotations

import numpy as np

from ..convert.tensors import Piece, SourceContext, TensorJob, pieces


def chosen(ctx: SourceContext, job: TensorJob, experts: list[int] | None, rows: np.ndarray | None
           ) -> tuple[bool, list[tuple[Piece, np.ndarray | None]]]:
    """Whether ``rows`` could be honoured, and (piece, sorted rows relative to its first row or None for all) of
    the pieces holding the chosen ``experts`` and global ``rows`` (None: all of them).  Rows cannot be chosen when
    some piece knows its position only after loading (a transformed shard): then every row is."""
    parts = list(pieces(ctx, job))
    if rows is not None and any(p.row is None or p.rows is None for p in parts):
        return False, [(p, None) for p in parts if experts is None or p.matrix in experts]
    out = []
    for piece in parts:
        if experts is not None and piece.matrix not in experts:
            continue
        if rows is None:
            out.append((piece, None))
            continue
        local = rows[(rows >= piece.row) & (rows < piece.row + piece.rows)] - piece.row
        if local.size:
            out.append((piece, local))
    return True, out

