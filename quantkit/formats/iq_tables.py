"""Search tables of the I-quant encoders (IQ2_XXS, IQ2_XS, IQ3_XXS), derived from gguf-py's grids at first use.

Grid and lattice.  A grid entry is a point of ``dim`` weights (8 for IQ2_*, 4 for IQ3_XXS).  gguf-py stores each
element as a magnitude ``grid_map[l]`` (IQ2: 8, 25, 43; IQ3_XXS: 4, 12, ..., 62); the level ``l`` (0..2, or
0..7) is what ggml's encoder searches with: it measures distances on the odd lattice ``2l + 1`` and its
lattice code of a point is ``u = sum(l_i << bits * i)`` with ``bits`` = 2 (IQ2) or 3 (IQ3).  The grids
(``GRID_*``) and the sign table (``KSIGNS``: 7-bit sign code -> 8 sign bits with even parity) are gguf-py's
own, unpacked once in :mod:`quantkit.kernels.dequant_scalars` and shared with the decoders; nothing is retyped.

What ggml's ``iq2xs_init_impl`` / ``iq3xs_init_impl`` build, rebuilt here:

* ``kmap[u]``: the grid index whose code is ``u``, or ``-(list + 1)`` when no entry has that code.
* For every code the encoder can produce that is off the grid, a neighbour list: the grid entries at the
  ``nwant`` (= 2) smallest distinct squared distances ``sum((2 l_grid + 1 - (2 l_u + 1))**2)``, ordered by
  (distance, grid index).  ggml qsorts (d2, index) pairs with a comparator on both keys, so the order is total
  and qsort's instability cannot show; the encoder takes the first strict minimum of its weighted distance
  over the list, so this order is its tie-break and must be reproduced exactly.

ggml sizes the IQ2 kmap 43692 and also builds lists for codes containing a level 3, which its encoder never
produces (levels are clamped to 0..kMaxQ-1); those codes are marked ``UNREACHABLE`` here and get no list.
Lists are stored padded to whole chunks of NB_ALIGN for the fast kernel, which scores a chunk at a time.
Building a type's tables takes 0.05-0.2 s, so they are cached in memory only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from gguf import quants as gq

from ..errors import FormatError
from ..kernels.dequant_scalars import GRID_IQ2XS, GRID_IQ2XXS, GRID_IQ3XXS, KSIGNS
from .registry import GGMLType

UNREACHABLE = np.iinfo(np.int32).min   # kmap entry of a code the encoder never produces
NWANT = 2                              # distinct distances kept per neighbour list (ggml: nwant = 2 for these)
NB_ALIGN = 16                          # neighbours per chunk (one vector of float32 per element in the kernel)

__all__ = ["IQTables", "KSIGNS", "UNREACHABLE", "tables"]


@dataclass(frozen=True)
class IQTables:
    """One type's grid and search tables (all arrays read-only and C-contiguous)."""

    qtype: GGMLType
    values: np.ndarray      # float32[G, dim]: gguf-py's grid magnitudes (the decoder's table)
    levels: np.ndarray      # int8[G, dim]: lattice level of each grid element
    bits: int               # bits per level in a lattice code
    n_levels: int           # levels the encoder rounds to (ggml's kMaxQ)
    kmap: np.ndarray        # int32[2**(bits*dim)]: grid index, -(list+1), or UNREACHABLE
    nb_start: np.ndarray    # int32[n_lists]: where list l starts in nb_index / nb_pos (a multiple of NB_ALIGN)
    nb_count: np.ndarray    # int32[n_lists]: its length; the slots up to the next multiple of NB_ALIGN are padding
    nb_index: np.ndarray    # int16[total]: grid indices of the neighbours in ggml's order; padding -1
    nb_pos: np.ndarray      # int8[total // NB_ALIGN, dim, NB_ALIGN]: lattice values 2l+1 of the neighbours, by
                            # chunks of NB_ALIGN slots, element-major inside a chunk; padding 0

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def neighbours(self, code: int) -> np.ndarray:
        """Grid indices listed for a lattice code, in search order (empty for a grid point or unreachable code)."""
        entry = int(self.kmap[code])
        if entry >= 0 or entry == UNREACHABLE:
            return self.nb_index[:0]
        lst = -entry - 1
        return self.nb_index[self.nb_start[lst]:self.nb_start[lst] + self.nb_count[lst]]


_SOURCES = {
    # qtype: (gguf-py class holding grid_map, the shared grid, bits per level)
    GGMLType.IQ2_XXS: (gq.IQ2_XXS, GRID_IQ2XXS, 2),
    GGMLType.IQ2_XS: (gq.IQ2_XS, GRID_IQ2XS, 2),
    GGMLType.IQ3_XXS: (gq.IQ3_XXS, GRID_IQ3XXS, 3),
}


def _levels(qtype: GGMLType, cls, grid: np.ndarray) -> np.ndarray:
    grid_map = np.asarray(cls.grid_map, dtype=np.float32)
    levels = np.searchsorted(grid_map, grid)
    if levels.max() >= grid_map.size or not np.array_equal(grid_map[levels], grid):
        raise FormatError(f"gguf-py's {qtype.name} grid has a value outside its grid_map {tuple(grid_map)}")
    return levels.astype(np.int8)


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


@functools.lru_cache(maxsize=None)
def tables(qtype: GGMLType) -> IQTables:
    """The search tables of ``qtype`` (IQ2_XXS, IQ2_XS or IQ3_XXS), built on first use."""
    cls, grid, bits = _SOURCES[GGMLType(qtype)]
    n_levels = len(cls.grid_map)
    levels = _levels(qtype, cls, grid)
    n_grid, dim = levels.shape
    shifts = bits * np.arange(dim)
    grid_codes = (levels.astype(np.int64) << shifts).sum(axis=1)
    if np.unique(grid_codes).size != n_grid:
        raise FormatError(f"gguf-py's {qtype.name} grid has repeated entries")

    all_codes = np.arange(1 << (bits * dim))
    code_levels = (all_codes[:, None] >> shifts) & ((1 << bits) - 1)
    kmap = np.full(all_codes.size, UNREACHABLE, dtype=np.int32)
    reachable = (code_levels < n_levels).all(axis=1)
    kmap[grid_codes] = np.arange(n_grid)
    off_grid = np.flatnonzero(reachable & (kmap == UNREACHABLE))

    # Squared distances on the odd lattice between every off-grid code and every grid entry (exact integers).
    p = 2 * code_levels[off_grid] + 1
    g = 2 * levels.astype(np.int64) + 1
    d2 = (p * p).sum(axis=1)[:, None] + (g * g).sum(axis=1)[None, :] - 2 * p @ g.T
    order = np.argsort(d2 * n_grid + np.arange(n_grid), axis=1)       # by (d2, index), a total order
    d2_sorted = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate([np.zeros((off_grid.size, 1), np.int64),
                           np.cumsum(d2_sorted[:, 1:] > d2_sorted[:, :-1], axis=1)], axis=1)
    keep = rank < NWANT                                                # a prefix of each sorted row
    counts = keep.sum(axis=1)
    padded = -(-counts // NB_ALIGN) * NB_ALIGN
    nb_start = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int32)
    slot = nb_start[:, None] + np.arange(n_grid)[None, :]              # where each kept entry goes
    nb_index = np.full(int(padded.sum()), -1, dtype=np.int16)
    nb_index[slot[keep]] = order[keep]
    slot_pos = np.zeros((nb_index.size, dim), dtype=np.int8)
    listed = nb_index >= 0
    slot_pos[listed] = 2 * levels[nb_index[listed]] + 1
    nb_pos = slot_pos.reshape(-1, NB_ALIGN, dim).transpose(0, 2, 1)
    kmap[off_grid] = -(np.arange(off_grid.size) + 1)

    return IQTables(qtype=GGMLType(qtype), values=_readonly(grid), levels=_readonly(levels), bits=bits,
                    n_levels=n_levels, kmap=_readonly(kmap), nb_start=_readonly(nb_start),
                    nb_count=_readonly(counts.astype(np.int32)), nb_index=_readonly(nb_index),
                    nb_pos=_readonly(nb_pos))
