"""numba decoders for the grid-based i-quants (IQ2_*, IQ3_*, IQ1_*), mirroring ggml's ``dequantize_row_iq*``.

Each kernel takes ``b: uint8[n_blocks, type_size]``, writes ``y: float32[n_blocks, 256]`` and is handed its
grid (``float32[entries, 8 or 4]``, gguf-py's table) and the 128-entry ``ksigns`` table.  Weights come in
sub-blocks of 32 (``ib``); a grid entry covers 8 (IQ2/IQ1) or 4 (IQ3) weights.  Layouts (byte offsets; d is a
little-endian f16 at @0 except in IQ1_M):

- IQ2_XXS (66 B): per ib a u32 pair @2+8ib: bytes 0..3 index four 8-wide grid rows, the second u32 holds four
  7-bit sign codes (``>> 7l``) and the 4-bit scale (``>> 28``); ``db = d * (0.5 + s) * 0.25``.
- IQ2_XS (74 B): u16 qs[32] @2 (9-bit grid index, 7-bit sign code above it), scales[8] @66 (two 4-bit
  scales per ib: first 16 weights low nibble, last 16 high).
- IQ2_S (82 B): qs[32] @2 (low 8 index bits), signs[32] @34 (explicit sign bits), qh[8] @66 (2 high index bits
  per row at ``2l``), scales[8] @74.
- IQ3_XXS (98 B): qs[64] @2 (one 4-wide grid index each), per ib a u32 @66+4ib (four sign codes and a 4-bit
  scale); ``db = d * (0.5 + s) * 0.5``.
- IQ3_S (110 B): qs[64] @2, qh[8] @66 (9th index bit, one per 4-wide row), signs[32] @74, scales[4] @106 (4 bits
  per ib); ``db = d * (1 + 2s)``.
- IQ1_S (50 B): qs[32] @2, u16 qh[8] @34: per ib 3 high index bits per row (``>> 3l``), a 3-bit scale
  (``>> 12``) and the delta sign (bit 15); weight ``(d * (2s + 1)) * (grid + delta)``, delta = ±1/8.
- IQ1_M (56 B): qs[32] @0, qh[16] @32 (per 8-wide row: 3 high index bits and a delta sign bit, two rows per byte),
  u16 sc[4] @48: 3-bit scales (two per 16 weights) and, in the top nibbles of sc[0..3], the f16 ``d``.

The row loops run ``grid.shape[1]`` times, a count LLVM sees only at run time: with a literal 8 or 4 it
unrolls them fully and, unable to prove ``y`` and ``b`` do not overlap, leaves them scalar (3x slower).

Signs multiply by ±1.0 as ggml does (so a zero scale under a minus sign gives -0.0, as in ggml and gguf-py).
Rounding: the scale products and ``db * grid`` are exact in float32 (at most 11 + 5 + 6 significant bits), so
operand order only matters in principle; it follows ggml anyway.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dequant_scalars import f16_to_f32, load_f16, load_u16, load_u32

_QUARTER = np.float32(0.25)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_MINUS_ONE = np.float32(-1.0)


@njit(cache=True)
def _sign(signs, j):
    return _MINUS_ONE if (signs >> j) & 1 else _ONE


@njit(cache=True, nogil=True)
def iq2_xxs(b, y, grid, ksigns):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            aux1 = load_u32(b, i, 2 + 8 * ib + 4)
            db = d * (_HALF + np.float32(aux1 >> np.uint32(28))) * _QUARTER
            for l in range(4):
                row = b[i, 2 + 8 * ib + l]
                signs = ksigns[(aux1 >> np.uint32(7 * l)) & np.uint32(127)]
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = db * grid[row, j] * _sign(signs, j)


@njit(cache=True, nogil=True)
def iq2_xs(b, y, grid, ksigns):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            sc = np.int32(b[i, 66 + ib])
            db0 = d * (_HALF + np.float32(sc & 0xF)) * _QUARTER
            db1 = d * (_HALF + np.float32(sc >> 4)) * _QUARTER
            for l in range(4):
                q = load_u16(b, i, 2 + 2 * (4 * ib + l))
                row = q & np.uint32(511)
                signs = ksigns[q >> np.uint32(9)]
                dl = db0 if l < 2 else db1
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = dl * grid[row, j] * _sign(signs, j)


@njit(cache=True, nogil=True)
def iq2_s(b, y, grid):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            sc = np.int32(b[i, 74 + ib])
            db0 = d * (_HALF + np.float32(sc & 0xF)) * _QUARTER
            db1 = d * (_HALF + np.float32(sc >> 4)) * _QUARTER
            qh = np.int32(b[i, 66 + ib])
            for l in range(4):
                row = np.int32(b[i, 2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)
                signs = b[i, 34 + 4 * ib + l]
                dl = db0 if l < 2 else db1
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = dl * grid[row, j] * _sign(signs, j)


@njit(cache=True, nogil=True)
def iq3_xxs(b, y, grid, ksigns):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            aux = load_u32(b, i, 66 + 4 * ib)
            db = d * (_HALF + np.float32(aux >> np.uint32(28))) * _HALF
            for l in range(4):
                signs = ksigns[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                row1 = b[i, 2 + 8 * ib + 2 * l]
                row2 = b[i, 2 + 8 * ib + 2 * l + 1]
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = db * grid[row1, j] * _sign(signs, j)
                    y[i, 32 * ib + 8 * l + 4 + j] = db * grid[row2, j] * _sign(signs, j + 4)


@njit(cache=True, nogil=True)
def iq3_s(b, y, grid):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            db = d * np.float32(1 + 2 * ((np.int32(b[i, 106 + ib // 2]) >> (4 * (ib % 2))) & 0xF))
            qh = np.int32(b[i, 66 + ib])
            for l in range(4):
                row1 = np.int32(b[i, 2 + 8 * ib + 2 * l]) | ((qh << (8 - 2 * l)) & 256)
                row2 = np.int32(b[i, 2 + 8 * ib + 2 * l + 1]) | ((qh << (7 - 2 * l)) & 256)
                signs = b[i, 74 + 4 * ib + l]
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = db * grid[row1, j] * _sign(signs, j)
                    y[i, 32 * ib + 8 * l + 4 + j] = db * grid[row2, j] * _sign(signs, j + 4)


@njit(cache=True, nogil=True)
def iq1_s(b, y, grid, delta):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for ib in range(8):
            qh = np.int32(load_u16(b, i, 34 + 2 * ib))
            dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
            dt = -delta if qh & 0x8000 else delta
            for l in range(4):
                row = np.int32(b[i, 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = dl * (grid[row, j] + dt)


@njit(cache=True, nogil=True)
def iq1_m(b, y, grid, delta):
    w = grid.shape[1]
    for i in range(b.shape[0]):
        sc0 = load_u16(b, i, 48)
        sc1 = load_u16(b, i, 50)
        sc2 = load_u16(b, i, 52)
        sc3 = load_u16(b, i, 54)
        # the f16 super-block scale is spread over the top nibbles of the four scale words
        d = f16_to_f32((sc0 >> np.uint32(12)) | ((sc1 >> np.uint32(8)) & np.uint32(0x00F0))
                       | ((sc2 >> np.uint32(4)) & np.uint32(0x0F00)) | (sc3 & np.uint32(0xF000)))
        for ib in range(8):
            s = np.int32(load_u16(b, i, 48 + 2 * (ib // 2)))
            shift = 6 * (ib % 2)
            dl1 = d * np.float32(2 * ((s >> shift) & 7) + 1)
            dl2 = d * np.float32(2 * ((s >> (shift + 3)) & 7) + 1)
            for l in range(4):
                qh = np.int32(b[i, 32 + 2 * ib + l // 2])
                qh_row = qh if l % 2 == 0 else qh >> 4    # rows 0, 2 use the low nibble, 1, 3 the high one
                row = np.int32(b[i, 4 * ib + l]) | ((qh_row & 7) << 8)
                dt = -delta if qh_row & 0x08 else delta
                dl = dl1 if l < 2 else dl2
                for j in range(w):
                    y[i, 32 * ib + 8 * l + j] = dl * (grid[row, j] + dt)
