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
_INT32_MIN = np.int64(-2147483648)
_FLT_MAX = F32(3.4028234663852886e38)
# make_qkx3_quants arguments of quantize_row_q4_1_impl / q5_1_impl: rmin, rdelta, nstep
_QKX3_RMIN = F32(-0.9)
_QKX3_RDELTA = F32(0.05)
_QKX3_NSTEP = 36


@njit(inline="always")
def c_int(v):
    """C's float → int32 conversion on x86 (cvttss2si): truncation; NaN, inf and |v| ≥ 2³¹ give INT32_MIN."""
    ok = abs(v) < _TWO_POW_31
    i = np.int64(v if ok else ZERO)  # selects, not branches: loops over this vectorize
    return i if ok else _INT32_MIN


@njit(inline="always")
def c_int8(v):
    """``(int8_t)v`` for a float v: the low byte of :func:`c_int`, as a signed value."""
    return ((c_int(v) + 128) & 0xFF) - 128


@njit(inline="always")
def c_roundf_byte(v):
    """``(int8_t)roundf(v)`` as a byte: round half away from zero, then the low byte of the int32."""
    vs = v if abs(v) < _TWO_POW_31 else ZERO  # roundf(v) out of int32 range -> INT32_MIN, whose low byte is 0
    i = np.int64(vs)
    frac = vs - F32(i)  # exact: the fraction of a float below 2^31
    i = i + 1 if frac >= _HALF else i
    i = i - 1 if frac <= -_HALF else i
    return i & 0xFF


@jit
def _abs_max(x, o):
    """amax and the signed value that reached it first (ggml's ``if (amax < fabsf(v))`` scan)."""
    amax = ZERO
    mx = ZERO
    for j in range(QK):
        v = x[o + j]
        bigger = amax < abs(v)
        mx = v if bigger else mx
        amax = abs(v) if bigger else amax
    return amax, mx


@jit
def _min_max(x, o):
    """ggml's ``if (v < min) min = v; if (v > max) max = v;`` from ±FLT_MAX."""
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
def _ref_quants(x, o, nmax, affine, idd, mn, L):
    """quantize_row_q{4,5}_{0,1}_ref's quants of one block into L.

    Symmetric (Q4_0, Q5_0): ``MIN(2nmax-1, (int8)(x*id + nmax + 0.5))``; affine (Q4_1, Q5_1):
    ``(int8)((x - min)*id + 0.5)``, clamped with ``MIN(15, ·)`` for Q4_1 only.
    """
    offset = F32(nmax) + _HALF
    top = 2 * nmax - 1
    clamp = nmax == 15
    for j in range(QK):
        if affine:
            q = c_int8((x[o + j] - mn) * idd + _HALF)
            L[j] = q if (q < nmax or not clamp) else nmax
        else:
            q = c_int8(x[o + j] * idd + offset)
            L[j] = q if q < top else top


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


@njit(cache=True, nogil=True, error_model="numpy")
def symmetric(x, out, nmax, type_size):
    """Q4_0 (nmax 8, 18-byte blocks) and Q5_0 (nmax 16, 22-byte blocks) without an importance matrix.

    ggml: d = max/-nmax (max: the first weight of largest |x|), q = MIN(2nmax-1, (int8)(x*id + nmax + 0.5)).
    """
    nb = x.shape[1] // QK
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        L = np.empty(QK, np.int32)
        for ib in range(nb):
            pos = ib * type_size
            _, mx = _abs_max(xr, ib * QK)
            d = mx / F32(-nmax)
            put_u16(orow, pos, fp32_to_fp16(d))
            _ref_quants(xr, ib * QK, nmax, False, ONE / d if d != ZERO else ZERO, ZERO, L)
            _pack(orow, pos + 2, L, nmax == 16)


@njit(cache=True, nogil=True, error_model="numpy")
def affine(x, out, nmax, type_size):
    """Q4_1 (nmax 15, 20-byte blocks) and Q5_1 (nmax 31, 24-byte blocks) without an importance matrix.

    ggml: d = (max-min)/nmax, m = min, q = (int8)((x-min)*id + 0.5), clamped with MIN(15, ·) for Q4_1 only.
    """
    nb = x.shape[1] // QK
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        L = np.empty(QK, np.int32)
        for ib in range(nb):
            pos = ib * type_size
            mn, mx = _min_max(xr, ib * QK)
            d = (mx - mn) / F32(nmax)
            put_u16(orow, pos, fp32_to_fp16(d))
            put_u16(orow, pos + 2, fp32_to_fp16(mn))
            _ref_quants(xr, ib * QK, nmax, True, ONE / d if d != ZERO else ZERO, mn, L)
            _pack(orow, pos + 4, L, nmax == 31)


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
