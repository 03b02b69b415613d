"""numba encoders for MXFP4 and NVFP4 (GGUF blocks), byte-identical to ggml's ``quantize_row_mxfp4_ref`` /
``quantize_row_nvfp4_ref``.

Layouts and rounding are documented in :mod:`quantkit.formats.fp4`.  The one speed-up over ggml's loop is exact:
ggml picks, among the 16 signed E2M1 codes, the first with the smallest ``|kvalue·d - x|``; codes of the other
sign never beat code 0 (their error is ``fl(|x| + m·d) ≥ |x|``) and code 8 (-0) only ties it, so the winner is
the first of the 8 magnitudes with the smallest ``|m·d - |x||`` (float32 rounding is symmetric), moved to the
negative half (code + 8) when x < 0 and the magnitude is not 0.

Kernels take ``x: float32[rows, n]`` and write ``out: uint8[rows, ...]``, parallel over rows with threads (:func:`quantkit.kernels.rows.over_rows`);
rows are independent, so the bytes do not depend on the thread count.
"""
from __future__ import annotations

import math

import numpy as np
from gguf.quants import MXFP4 as _GGUF_MXFP4
from numba import njit

from .dequant_scalars import e8m0_to_f32_half, ue4m3_to_f32_half
from .kq_primitives import F32, ZERO, f32_bits, jit

QK_MXFP4 = 32
QK_NVFP4 = 64
NVFP4_SUB = 16
_UE4M3_MAX = F32(448.0)
_SIX = F32(6.0)
_TWO_POW_9 = F32(512.0)
_HALF = F32(0.5)
# kvalues_mxfp4 (doubled E2M1) of codes 0..7, from gguf-py like every table
_MAGNITUDES = np.ascontiguousarray(np.asarray(_GGUF_MXFP4.kvalues, dtype=np.float32)[:8])


@jit
def _abs_max(x, o, n):
    amax = ZERO
    for j in range(n):
        av = abs(x[o + j])
        if amax < av:
            amax = av
    return amax


@njit(inline="always")
def e2m1_index(v, d):
    """ggml best_index_mxfp4(v, d): the 4-bit code of v on the grid kvalues_mxfp4 · d (see module docstring)."""
    a = abs(v)
    best = 0
    best_err = a
    for j in range(1, 8):
        err = abs(_MAGNITUDES[j] * d - a)
        better = err < best_err
        best = j if better else best
        best_err = err if better else best_err
    return best + 8 if (v < ZERO and best != 0) else best


@jit
def mxfp4_exponent(amax):
    """ggml: ``amax > 0 ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0`` (the byte wraps for tiny amax)."""
    if amax > ZERO:
        return (np.int64(math.floor(math.log2(amax))) + 125) & 0xFF
    return 0


@jit
def fp32_to_ue4m3(x):
    """ggml_fp32_to_ue4m3 (see :func:`quantkit.formats.fp4.fp32_to_ue4m3` for the rounding rules)."""
    if not x > ZERO:
        return 0
    if x > _UE4M3_MAX:
        x = _UE4M3_MAX
    bits = f32_bits(x)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    if exp <= 0:
        man = np.int64(x * _TWO_POW_9 + _HALF)  # x < 2^-6: well inside int range
        if man > 7:
            man = 7
        return man if man >= 1 else 0
    if exp >= 15:
        return 0x7E
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    if man > 7:
        man = 0
        exp += 1
        if exp >= 15:
            return 0x7E
    return (exp << 3) | man


@njit(cache=True, nogil=True, error_model="numpy")
def mxfp4(x, out):
    """MXFP4: 17-byte blocks (E8M0 e, qs[16]: byte j = code j | code j+16 << 4)."""
    nb = x.shape[1] // QK_MXFP4
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        for ib in range(nb):
            o = ib * QK_MXFP4
            pos = ib * 17
            e = mxfp4_exponent(_abs_max(xr, o, QK_MXFP4))
            d = e8m0_to_f32_half(e)
            orow[pos] = e
            for j in range(16):  # a fixed 16-wide loop: vectorizes
                orow[pos + 1 + j] = e2m1_index(xr[o + j], d) | (e2m1_index(xr[o + 16 + j], d) << 4)


@njit(cache=True, nogil=True, error_model="numpy")
def nvfp4(x, out):
    """NVFP4: 36-byte blocks of 64 (UE4M3 d[4], qs[32]; per 16-group byte j = code j | code j+8 << 4)."""
    n_groups = x.shape[1] // NVFP4_SUB
    per_block = QK_NVFP4 // NVFP4_SUB
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        codes = np.empty(NVFP4_SUB, np.uint8)
        for g in range(n_groups):
            o = g * NVFP4_SUB
            pos = (g // per_block) * 36
            ue = fp32_to_ue4m3(_abs_max(xr, o, NVFP4_SUB) / _SIX)
            d = ue4m3_to_f32_half(ue)
            orow[pos + g % per_block] = ue
            for j in range(NVFP4_SUB):  # codes first, in a 16-wide loop that vectorizes; then the nibbles
                codes[j] = e2m1_index(xr[o + j], d)
            q = pos + 4 + (g % per_block) * (NVFP4_SUB // 2)
            for j in range(NVFP4_SUB // 2):
                orow[q + j] = codes[j] | (codes[j + 8] << 4)
