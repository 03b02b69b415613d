"""numba encoders for the legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), byte-identical to ggml.

Layouts, rounding and the two ggml paths (``quantize_row_<t>_ref`` without an importance matrix,
``quantize_row_<t>_impl`` with one) are documented in :mod:`quantkit.formats.legacy`; this module mirrors them
operation by operation in float32 (the exactness rules are those of :mod:`quantkit.kernels.kq_primitives`,
whose f16 conversion and scale searches — make_qx_quants, make_qkx3_quants, over many blocks at once — are
shared with the K-quants).

Each public kernel takes ``x: float32[rows, n]`` (C-contiguous, finite), ``qw: float32[n]`` where it uses one,
and writes ``out: uint8[rows, n/32 * type_size]``, parallel over rows with threads (:func:`quantkit.kernels.rows.over_rows`).  Rows are independent, so
the bytes do not depend on the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .kq_primitives import (F32, ONE, QKX_STATE_ROWS, QX_STATE_ROWS, ZERO, fp32_to_fp16, jit,
                            make_qkx_quants_lanes, make_qx_quants_lanes, put_u16)

QK = 32
_HALF = F32(0.5)
_TWO_POW_31 = F32(2.0 ** 31)
_FLT_MAX = F32(3.4028234663852886e38)
# make_qkx3_quants arguments of quantize_row_q4_1_impl / q5_1_impl: rmin, rdelta, nstep
_QKX3_RMIN = F32(-0.9)
_QKX3_RDELTA = F32(0.05)
_QKX3_NSTEP = 36


@njit(inline="always")
def c_roundf_byte(v):
    """``(int8_t)roundf(v)`` as a byte: round half away from zero, then the low byte of the int32."""
    vs = v if abs(v) < _TWO_POW_31 else ZERO  # roundf(v) out of int32 range -> INT32_MIN, whose low byte is 0
    i = np.int64(vs)
    frac = vs - F32(i)  # exact: the fraction of a float below 2^31
    i = i + 1 if frac >= _HALF else i
    i = i - 1 if frac <= -_HALF else i
    return i & 0xFF


@njit(inline="always")
def _c_low_byte(v):
    """The low byte of C's ``(int)v`` (x86: NaN, inf and |v| >= 2^31 give INT32_MIN, whose low byte is 0).

    int32 conversion and selects only: the quant loops over this vectorize (an int64 conversion would not)."""
    ok = abs(v) < _TWO_POW_31
    return (np.int32(v if ok else ZERO) & 0xFF) if ok else 0


@njit(inline="always")
def _c_min_byte(v, top):
    """``(uint8_t)MIN(top, (int8_t)v)``: a low byte of 128..255 is a negative int8, which MIN keeps."""
    b = _c_low_byte(v)
    return b if (b <= top or b >= 128) else top


@njit(inline="always")
def _fmin(a, b):
    return a if a < b else b


@njit(inline="always")
def _fmax(a, b):
    return a if a > b else b


@njit(inline="always")
def _lane_min_max(x, o):
    a = x[o]
    b = x[o + 8]
    c = x[o + 16]
    e = x[o + 24]
    return _fmin(_fmin(a, b), _fmin(c, e)), _fmax(_fmax(a, b), _fmax(c, e))


@njit(inline="always")
def _block_min_max(x, o):
    """The smallest and largest value of a block of finite weights, as a tree of 8 independent lanes (ggml's
    sequential scan is one long dependency chain).  Values only: which zero (+0 or -0) a scan keeps depends on
    the order, so callers rescan a block whose result is a zero."""
    l0, h0 = _lane_min_max(x, o)
    l1, h1 = _lane_min_max(x, o + 1)
    l2, h2 = _lane_min_max(x, o + 2)
    l3, h3 = _lane_min_max(x, o + 3)
    l4, h4 = _lane_min_max(x, o + 4)
    l5, h5 = _lane_min_max(x, o + 5)
    l6, h6 = _lane_min_max(x, o + 6)
    l7, h7 = _lane_min_max(x, o + 7)
    mn = _fmin(_fmin(_fmin(l0, l4), _fmin(l1, l5)), _fmin(_fmin(l2, l6), _fmin(l3, l7)))
    mx = _fmax(_fmax(_fmax(h0, h4), _fmax(h1, h5)), _fmax(_fmax(h2, h6), _fmax(h3, h7)))
    return mn, mx


@njit(inline="always")
def _first_abs_max(x, o):
    """ggml's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from +0: the first weight of largest |x|.

    From the block's min and max; only a tie of +a and -a needs the scan (and an all-zero block gives +0)."""
    mn, mx = _block_min_max(x, o)
    if mx > -mn:
        return mx
    if -mn > mx:
        return mn
    if mx > ZERO:
        for j in range(QK):
            if abs(x[o + j]) == mx:
                return x[o + j]
    return ZERO


@njit(inline="always")
def _strict_min_max(x, o):
    """ggml's ``if (v < min) min = v; if (v > max) max = v;`` from ±FLT_MAX."""
    mn, mx = _block_min_max(x, o)
    if mn == ZERO or mx == ZERO:  # the scan's order decides the sign of a zero
        mn = _FLT_MAX
        mx = -_FLT_MAX
        for j in range(QK):
            v = x[o + j]
            mn = v if v < mn else mn
            mx = v if v > mx else mx
    return mn, mx


@jit
def _pack(out, pos, L, five_bit):
    """Store quants L[32] (low byte kept, as a ``uint8_t``): 4-bit ``qs[j] = L[j] | L[j+16] << 4`` at pos;
    5-bit ``qh`` (u32, bit j = bit 4 of L[j]) at pos, then qs of the low nibbles at pos + 4."""
    qs = pos + 4 if five_bit else pos
    qh = 0
    for j in range(16):
        lo = L[j] & 0xFF
        hi = L[j + 16] & 0xFF
        if five_bit:
            out[qs + j] = (lo & 0x0F) | ((hi & 0x0F) << 4)
            qh |= (((lo & 0x10) >> 4) << j) | (((hi & 0x10) >> 4) << (j + 16))
        else:
            out[qs + j] = (lo | (hi << 4)) & 0xFF
    if five_bit:
        for k in range(4):
            out[pos + k] = (qh >> (8 * k)) & 0xFF


@jit
def _row_sigma2(x):
    """Σx²/n over the whole row, summed in order (quantize_row_<t>_impl)."""
    s = ZERO
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s / F32(x.shape[0])


@njit(cache=True, nogil=True, error_model="numpy")
def q8_0(x, out):
    nb = x.shape[1] // QK
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        for ib in range(nb):
            o = ib * QK
            amax = ZERO
            for j in range(QK):
                av = abs(xr[o + j])
                amax = amax if amax > av else av
            d = amax / F32(127)
            idd = ONE / d if d != ZERO else ZERO
            pos = ib * 34
            put_u16(orow, pos, fp32_to_fp16(d))
            for j in range(QK):
                orow[pos + 2 + j] = c_roundf_byte(xr[o + j] * idd)


@njit(inline="always")
def _symmetric(x, out, nmax, type_size, five_bit):
    """quantize_row_q4_0_ref / q5_0_ref: d = max/-nmax (max: the first weight of largest |x|),
    q = MIN(2nmax-1, (int8)(x*id + nmax + 0.5)).  Inlined with constant arguments, so each type's kernel is
    compiled for its own nmax and layout."""
    nb = x.shape[1] // QK
    offset = F32(nmax) + _HALF
    top = 2 * nmax - 1
    qs = 6 if five_bit else 2
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        for ib in range(nb):
            o = ib * QK
            pos = ib * type_size
            d = _first_abs_max(xr, o) / F32(-nmax)
            idd = ONE / d if d != ZERO else ZERO
            put_u16(orow, pos, fp32_to_fp16(d))
            qh = 0
            for j in range(16):
                lo = _c_min_byte(xr[o + j] * idd + offset, top)
                hi = _c_min_byte(xr[o + 16 + j] * idd + offset, top)
                if five_bit:
                    orow[pos + qs + j] = (lo & 0x0F) | ((hi & 0x0F) << 4)
                    qh |= (((lo & 0x10) >> 4) << j) | (((hi & 0x10) >> 4) << (j + 16))
                else:
                    orow[pos + qs + j] = (lo | (hi << 4)) & 0xFF
            if five_bit:
                for k in range(4):
                    orow[pos + 2 + k] = (qh >> (8 * k)) & 0xFF


@njit(inline="always")
def _affine(x, out, nmax, type_size, five_bit):
    """quantize_row_q4_1_ref / q5_1_ref: d = (max-min)/nmax, m = min, q = (int8)((x-min)*id + 0.5), clamped
    with MIN(15, ·) for Q4_1 only (Q5_1 stores ``(uint8_t)`` of it)."""
    nb = x.shape[1] // QK
    qs = 8 if five_bit else 4
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        for ib in range(nb):
            o = ib * QK
            pos = ib * type_size
            mn, mx = _strict_min_max(xr, o)
            d = (mx - mn) / F32(nmax)
            idd = ONE / d if d != ZERO else ZERO
            put_u16(orow, pos, fp32_to_fp16(d))
            put_u16(orow, pos + 2, fp32_to_fp16(mn))
            qh = 0
            for j in range(16):
                if five_bit:
                    lo = _c_low_byte((xr[o + j] - mn) * idd + _HALF)
                    hi = _c_low_byte((xr[o + 16 + j] - mn) * idd + _HALF)
                    orow[pos + qs + j] = (lo & 0x0F) | ((hi & 0x0F) << 4)
                    qh |= (((lo & 0x10) >> 4) << j) | (((hi & 0x10) >> 4) << (j + 16))
                else:
                    lo = _c_min_byte((xr[o + j] - mn) * idd + _HALF, 15)
                    hi = _c_min_byte((xr[o + 16 + j] - mn) * idd + _HALF, 15)
                    orow[pos + qs + j] = (lo | (hi << 4)) & 0xFF
            if five_bit:
                for k in range(4):
                    orow[pos + 4 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, nogil=True, error_model="numpy")
def q4_0(x, out):
    _symmetric(x, out, 8, 18, False)


@njit(cache=True, nogil=True, error_model="numpy")
def q5_0(x, out):
    _symmetric(x, out, 16, 22, True)


@njit(cache=True, nogil=True, error_model="numpy")
def q4_1(x, out):
    _affine(x, out, 15, 20, False)


@njit(cache=True, nogil=True, error_model="numpy")
def q5_1(x, out):
    _affine(x, out, 31, 24, True)


@njit(cache=True, nogil=True, error_model="numpy")
def with_imatrix(x, qw, out, nmax, type_size, affine):
    """Q4_0/Q5_0 (``affine`` false) and Q4_1/Q5_1 with an importance matrix (quantize_row_<t>_impl).

    Per row σ² = Σx²/n; per weight w = qw·sqrtf(σ² + x²); the row's blocks then run through ggml's scale
    search side by side (block k = column k): make_qx_quants(32, nmax, x, L, 1, w) for the symmetric types,
    make_qkx3_quants(32, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, false) with m = -the_min for the
    affine ones.
    """
    nb = x.shape[1] // QK
    five_bit = nmax == 16 or nmax == 31
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        xt = np.empty((QK, nb), np.float32)
        wt = np.empty((QK, nb), np.float32)
        Lt = np.empty((QK, nb), np.int32)
        scale = np.empty(nb, np.float32)
        the_min = np.empty(nb, np.float32)
        st = np.empty((max(QX_STATE_ROWS, QKX_STATE_ROWS), nb), np.float32)
        L = np.empty(QK, np.int32)
        sigma2 = _row_sigma2(xr)
        for ib in range(nb):
            for j in range(QK):
                v = xr[ib * QK + j]
                xt[j, ib] = v
                wt[j, ib] = qw[ib * QK + j] * np.sqrt(sigma2 + v * v)
        if affine:
            make_qkx_quants_lanes(nb, QK, nmax, xt, wt, Lt, _QKX3_RMIN, _QKX3_RDELTA, _QKX3_NSTEP, False, scale,
                                  the_min, st)
        else:
            make_qx_quants_lanes(nb, QK, nmax, xt, wt, Lt, scale, st)
        for ib in range(nb):
            pos = ib * type_size
            put_u16(orow, pos, fp32_to_fp16(scale[ib]))
            if affine:
                put_u16(orow, pos + 2, fp32_to_fp16(-the_min[ib]))
            for j in range(QK):
                L[j] = Lt[j, ib]
            _pack(orow, pos + (4 if affine else 2), L, five_bit)
