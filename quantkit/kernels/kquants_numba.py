"""Fast K-quant encoders (Q2_K … Q6_K) in numba, byte-identical to ggml's ``ggml_quantize_chunk``.

Layouts, rounding rules and the two ggml paths (``quantize_row_<t>_ref`` without an importance matrix,
``quantize_row_<t>_impl`` with one) are documented in :mod:`quantkit.formats.kquants`; the float32 exactness
rules in :mod:`quantkit.kernels.kq_primitives`.

How it is fast without changing a bit: ggml runs each sub-block's scale search on its own, a chain of
dependent float32 additions.  Here up to ``SEARCH_GROUP`` sub-blocks of a row (several super-blocks) are
transposed into columns and searched side by side, so every inner loop runs across sub-blocks and
vectorizes, while each sub-block still sees exactly ggml's sequence of operations.  The per-block steps that
follow (scale quantization, the final re-quantization, packing) run block by block.  Rows are independent and
run in parallel (threads: :func:`quantkit.kernels.rows.over_rows`); the bytes do not depend on the thread count.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..formats.kquants import QK_K, block_bytes, field_offsets
from ..formats.registry import GGMLType
from .rows import over_rows
from .kq_primitives import (F32, GROUP_MAX_EPS, ONE, Q3_STATE_ROWS, QKX_STATE_ROWS, QX_STATE_ROWS, ZERO, as_int8,
                            fp16_to_fp32, fp32_to_fp16, get_u16, jit, make_q3_quants_lanes, make_qkx_quants_lanes,
                            make_qp_quants, make_qx_quants_lanes, nearest_int, put_u16)

SEARCH_GROUP = 64   # sub-blocks whose scale searches run side by side (SIMD lanes of make_qkx_quants_lanes)

# Block sizes and field offsets come from the one layout table (quantkit.formats.kquants.BLOCK_FIELDS).
_Q2, _Q3, _Q4, _Q5, _Q6 = (field_offsets(t) for t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
                                                       GGMLType.Q6_K))
Q2_K_BYTES, Q2_K_SCALES, Q2_K_QS, Q2_K_D, Q2_K_DMIN = (block_bytes(GGMLType.Q2_K), _Q2["scales"], _Q2["qs"],
                                                       _Q2["d"], _Q2["dmin"])
Q3_K_BYTES, Q3_K_HMASK, Q3_K_QS, Q3_K_SCALES, Q3_K_D = (block_bytes(GGMLType.Q3_K), _Q3["hmask"], _Q3["qs"],
                                                        _Q3["scales"], _Q3["d"])
Q4_K_BYTES, Q4_K_D, Q4_K_DMIN, Q4_K_SCALES, Q4_K_QS = (block_bytes(GGMLType.Q4_K), _Q4["d"], _Q4["dmin"],
                                                       _Q4["scales"], _Q4["qs"])
Q5_K_BYTES, Q5_K_QH, Q5_K_QS = block_bytes(GGMLType.Q5_K), _Q5["qh"], _Q5["qs"]
Q6_K_BYTES, Q6_K_QL, Q6_K_QH, Q6_K_SCALES, Q6_K_D = (block_bytes(GGMLType.Q6_K), _Q6["ql"], _Q6["qh"],
                                                     _Q6["scales"], _Q6["d"])
if (_Q5["d"], _Q5["dmin"], _Q5["scales"]) != (Q4_K_D, Q4_K_DMIN, Q4_K_SCALES):
    raise RuntimeError("Q5_K's d/dmin/scales must sit where Q4_K's do: the shared Q4_K/Q5_K code relies on it")

# Search parameters of ggml's make_qkx2/qkx3_quants calls (rmin, rdelta, nstep).
Q2_K_REF_SEARCH = (F32(-0.5), F32(0.1), 15)
Q4_K_REF_SEARCH = (F32(-1.0), F32(0.1), 20)
Q5_K_REF_SEARCH = (F32(-0.5), F32(0.1), 15)
IMATRIX_SEARCH = (F32(-0.9), F32(0.05), 36)
Q2_K_SCALE_MAX = F32(15.0)       # 4-bit sub-block scales and mins
K4_SCALE_MAX = F32(63.0)         # 6-bit sub-block scales and mins (Q4_K, Q5_K)
Q3_K_SCALE_RANGE = F32(-32.0)    # 6-bit signed sub-block scales
Q6_K_SCALE_RANGE = F32(-128.0)   # 8-bit signed sub-block scales
_TWO = F32(2.0)
_FQK_K = F32(QK_K)
_F32_SUB = F32(32.0)


# ---------------------------------------------------------------------------------------------- shared pieces

@jit
def _sum_sq(x, n):
    s = ZERO
    for i in range(n):
        s += x[i] * x[i]
    return s


@jit
def _imatrix_lanes(xb, qwb, sub, sigma2, k0, xt, wt, sw):
    """One super-block into lane columns k0.. of xt/wt: weights qw·sqrt(σ² + x²) (ggml's imatrix weighting)
    and each sub-block's sequential weight sum ``sw``."""
    for j in range(QK_K // sub):
        k = k0 + j
        sumw = ZERO
        for i in range(sub):
            v = xb[sub * j + i]
            xt[i, k] = v
            wt[i, k] = qwb[sub * j + i] * F32(math.sqrt(sigma2 + v * v))
            sumw += wt[i, k]
        sw[k] = sumw


@jit
def _to_lanes(xb, k0, sub, xt):
    """One super-block into lane columns k0.. of xt (sub-block j → column k0 + j)."""
    for j in range(QK_K // sub):
        for i in range(sub):
            xt[i, k0 + j] = xb[sub * j + i]


@jit
def _from_lanes(Lt, k0, sub, L):
    """Quants of one super-block back from lane columns k0.. into block order."""
    for j in range(QK_K // sub):
        for i in range(sub):
            L[sub * j + i] = Lt[i, k0 + j]


@jit
def _per_weight(f, sub, out):
    """Spread per-sub-block factors f[j] over the block's weights (so the final pass is one long loop:
    LLVM leaves loops of 16 or 32 iterations scalar)."""
    for j in range(QK_K // sub):
        for i in range(sub):
            out[sub * j + i] = f[j]


@jit
def _requantize_asym(x, d, dm, sub, nmax, L, de, me):
    """Final pass of the a·q − b types: L = clamp(nearest_int((x + dm[j]) / d[j]), 0, nmax) for every
    sub-block j with d[j] != 0 (d, dm: the f16-rounded factors times the integer scale/min); a sub-block
    with d[j] == 0 keeps the quants of its search.  ``de``/``me``: scratch of QK_K floats."""
    _per_weight(d, sub, de)
    _per_weight(dm, sub, me)
    for i in range(QK_K):
        l = max(0, min(nmax, nearest_int((x[i] + me[i]) / de[i])))
        L[i] = L[i] if de[i] == ZERO else l


@jit
def _requantize_sym(x, d, sub, nmin, nmax, L, de):
    """Final pass of the a·q types: L = clamp(nearest_int(x / d[j]), nmin, nmax) − nmin, as _requantize_asym."""
    _per_weight(d, sub, de)
    for i in range(QK_K):
        l = max(nmin, min(nmax, nearest_int(x[i] / de[i]))) - nmin
        L[i] = L[i] if de[i] == ZERO else l


@jit
def _pack_2bit(L, y, off):
    """qs of Q2_K/Q3_K: byte j/4+l of each 128-chunk holds quants l, l+32, l+64, l+96 (2 bits each)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            y[off + j // 4 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 2)
                                   | (np.int64(L[j + l + 64]) << 4) | (np.int64(L[j + l + 96]) << 6)) & 0xFF


@jit
def _pack_k4_scale(y, off, j, ls, lm):
    """Q4_K/Q5_K: 6-bit scale ls and min lm of sub-block j into the 12 scale bytes (C uint8 stores)."""
    if j < 4:
        y[off + j] = ls & 0xFF
        y[off + j + 4] = lm & 0xFF
    else:
        y[off + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
        y[off + j - 4] = (np.int64(y[off + j - 4]) | ((ls >> 4) << 6)) & 0xFF
        y[off + j] = (np.int64(y[off + j]) | ((lm >> 4) << 6)) & 0xFF


@jit
def _get_k4_scale(y, off, j):
    """get_scale_min_k4: (scale, min) of sub-block j read back from the packed bytes."""
    if j < 4:
        return np.int64(y[off + j]) & 63, np.int64(y[off + j + 4]) & 63
    lo = np.int64(y[off + j + 4])
    return (lo & 0xF) | ((np.int64(y[off + j - 4]) >> 6) << 4), (lo >> 4) | ((np.int64(y[off + j]) >> 6) << 4)


@jit
def _put_q3_scale(y, j, l):
    """Q3_K: 6-bit scale l of sub-block j: low nibbles in bytes 0-7, high 2-bit pairs in bytes 8-11."""
    off = Q3_K_SCALES
    if j < 8:
        y[off + j] = l & 0xF
    else:
        y[off + j - 8] = (np.int64(y[off + j - 8]) | ((l & 0xF) << 4)) & 0xFF
    l >>= 4
    y[off + 8 + j % 4] = (np.int64(y[off + 8 + j % 4]) | (l << (2 * (j // 4)))) & 0xFF


@jit
def _get_q3_scale(y, j):
    off = Q3_K_SCALES
    sc = np.int64(y[off + j]) & 0xF if j < 8 else np.int64(y[off + j - 8]) >> 4
    return as_int8((sc | (((np.int64(y[off + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32)


# ---------------------------------------------------------------------------------------------- Q2_K

@jit
def _q2_k_finish(x, y, L, d, dm, de, me):
    """Re-quantize with the f16-rounded d/dmin and the 4-bit scales, then pack (shared by both paths)."""
    dd = fp16_to_fp32(get_u16(y, Q2_K_D))
    dmm = fp16_to_fp32(get_u16(y, Q2_K_DMIN))
    for j in range(QK_K // 16):
        sc = np.int64(y[Q2_K_SCALES + j])
        d[j] = dd * F32(sc & 0xF)
        dm[j] = dmm * F32(sc >> 4)
    _requantize_asym(x, d, dm, 16, 3, L, de, me)
    _pack_2bit(L, y, Q2_K_QS)


@jit
def _q2_k_ref_scales(y, scales, mins):
    """quantize_row_q2_K_ref: 4-bit scales and mins against their maxima, d = max/15 (f16)."""
    max_scale = ZERO
    max_min = ZERO
    for j in range(QK_K // 16):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    if max_scale > ZERO:
        iscale = Q2_K_SCALE_MAX / max_scale
        for j in range(QK_K // 16):
            y[Q2_K_SCALES + j] = nearest_int(iscale * scales[j]) & 0xFF
        put_u16(y, Q2_K_D, fp32_to_fp16(max_scale / Q2_K_SCALE_MAX))
    else:
        for j in range(QK_K // 16):
            y[Q2_K_SCALES + j] = 0
        put_u16(y, Q2_K_D, fp32_to_fp16(ZERO))
    if max_min > ZERO:
        iscale = Q2_K_SCALE_MAX / max_min
        for j in range(QK_K // 16):
            y[Q2_K_SCALES + j] = (np.int64(y[Q2_K_SCALES + j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
        put_u16(y, Q2_K_DMIN, fp32_to_fp16(max_min / Q2_K_SCALE_MAX))
    else:
        put_u16(y, Q2_K_DMIN, fp32_to_fp16(ZERO))


@jit
def _q2_k_impl_scales(y, scales, mins, sw, Ls, Lm):
    """quantize_row_q2_K_impl: scales and mins quantized by make_qp_quants weighted by the sub-block weights."""
    dm = make_qp_quants(QK_K // 16, 15, scales, Ls, sw)
    mm = make_qp_quants(QK_K // 16, 15, mins, Lm, sw)
    put_u16(y, Q2_K_D, fp32_to_fp16(dm))
    put_u16(y, Q2_K_DMIN, fp32_to_fp16(mm))
    for j in range(QK_K // 16):
        y[Q2_K_SCALES + j] = (np.int64(Ls[j]) | (np.int64(Lm[j]) << 4)) & 0xFF


@jit
def _q2_k_row(x, qw, use_qw, y):
    per = QK_K // 16
    nb = x.shape[0] // QK_K
    group = SEARCH_GROUP // per
    if use_qw:
        rmin, rdelta, nstep = IMATRIX_SEARCH
    else:
        rmin, rdelta, nstep = Q2_K_REF_SEARCH
    xt = np.empty((16, SEARCH_GROUP), np.float32)
    wt = np.empty((16, SEARCH_GROUP), np.float32)
    Lt = np.empty((16, SEARCH_GROUP), np.uint8)
    st = np.empty((QKX_STATE_ROWS, SEARCH_GROUP), np.float32)
    scales = np.empty(SEARCH_GROUP, np.float32)
    mins = np.empty(SEARCH_GROUP, np.float32)
    sw = np.empty(SEARCH_GROUP, np.float32)
    L = np.empty(QK_K, np.uint8)
    Ls = np.empty(per, np.uint8)
    Lm = np.empty(per, np.uint8)
    d = np.empty(per, np.float32)
    dm = np.empty(per, np.float32)
    de = np.empty(QK_K, np.float32)
    me = np.empty(QK_K, np.float32)
    for g0 in range(0, nb, group):
        gb = min(group, nb - g0)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            xb = x[x0:x0 + QK_K]
            if use_qw:
                _imatrix_lanes(xb, qw[x0:x0 + QK_K], 16, _sum_sq(xb, QK_K) / _FQK_K, b * per, xt, wt, sw)
                continue
            for j in range(per):
                for i in range(16):
                    xt[i, b * per + j] = xb[16 * j + i]
                    wt[i, b * per + j] = abs(xb[16 * j + i])
        make_qkx_quants_lanes(gb * per, 16, 3, xt, wt, Lt, rmin, rdelta, nstep, not use_qw, scales, mins, st)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            yb = y[(g0 + b) * Q2_K_BYTES:(g0 + b + 1) * Q2_K_BYTES]
            k0 = b * per
            _from_lanes(Lt, k0, 16, L)
            if use_qw:
                _q2_k_impl_scales(yb, scales[k0:k0 + per], mins[k0:k0 + per], sw[k0:k0 + per], Ls, Lm)
            else:
                _q2_k_ref_scales(yb, scales[k0:k0 + per], mins[k0:k0 + per])
            _q2_k_finish(x[x0:x0 + QK_K], yb, L, d, dm, de, me)


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_q2_k(x, qw, use_qw, out):
    for r in range(x.shape[0]):
        _q2_k_row(x[r], qw, use_qw, out[r])


# ---------------------------------------------------------------------------------------------- Q3_K

@jit
def _q3_k_finish(x, y, L, d, de):
    dd = fp16_to_fp32(get_u16(y, Q3_K_D))
    for j in range(QK_K // 16):
        d[j] = dd * F32(_get_q3_scale(y, j))
    _requantize_sym(x, d, 16, -4, 3, L, de)
    # The high bit of quant 32k+l goes to bit k of hmask byte l; qs keeps the low 2 bits (L in 0..7).
    for l in range(32):
        bits = 0
        for k in range(8):
            bits |= (np.int64(L[32 * k + l]) >> 2) << k
        y[Q3_K_HMASK + l] = bits
    for i in range(QK_K):
        L[i] &= 3
    _pack_2bit(L, y, Q3_K_QS)


@jit
def _q3_k_ref_scales(y, scales):
    """quantize_row_q3_K_ref: signed 6-bit scales against the largest |scale|, d = max/-32 (f16)."""
    max_scale = ZERO
    amax = ZERO
    for j in range(QK_K // 16):
        if abs(scales[j]) > amax:
            amax = abs(scales[j])
            max_scale = scales[j]
    for k in range(12):
        y[Q3_K_SCALES + k] = 0
    if max_scale != ZERO:
        iscale = Q3_K_SCALE_RANGE / max_scale
        for j in range(QK_K // 16):
            l = as_int8(nearest_int(iscale * scales[j]))
            _put_q3_scale(y, j, max(-32, min(31, l)) + 32)
        put_u16(y, Q3_K_D, fp32_to_fp16(ONE / iscale))
    else:
        put_u16(y, Q3_K_D, fp32_to_fp16(ZERO))


@jit
def _q3_k_impl_scales(y, scales, sw, Ls, st):
    """quantize_row_q3_K_impl: the 16 sub-block scales quantized by make_qx_quants (nmax 32) weighted by sw."""
    d_block = np.empty(1, np.float32)
    per = QK_K // 16
    make_qx_quants_lanes(1, per, 32, scales.reshape((per, 1)), sw.reshape((per, 1)), Ls.reshape((per, 1)),
                         d_block, st)
    for k in range(12):
        y[Q3_K_SCALES + k] = 0
    for j in range(per):
        _put_q3_scale(y, j, np.int64(Ls[j]))
    put_u16(y, Q3_K_D, fp32_to_fp16(d_block[0]))


@jit
def _q3_k_row(x, qw, use_qw, y):
    per = QK_K // 16
    nb = x.shape[0] // QK_K
    group = SEARCH_GROUP // per
    xt = np.empty((16, SEARCH_GROUP), np.float32)
    wt = np.empty((16, SEARCH_GROUP), np.float32)
    Lt = np.empty((16, SEARCH_GROUP), np.int8)
    st = np.empty((max(QX_STATE_ROWS, Q3_STATE_ROWS), SEARCH_GROUP), np.float32)
    scales = np.empty(SEARCH_GROUP, np.float32)
    sw = np.empty(SEARCH_GROUP, np.float32)
    L = np.empty(QK_K, np.int8)
    Ls = np.empty(per, np.uint8)
    d = np.empty(per, np.float32)
    de = np.empty(QK_K, np.float32)
    for g0 in range(0, nb, group):
        gb = min(group, nb - g0)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            xb = x[x0:x0 + QK_K]
            if use_qw:
                _imatrix_lanes(xb, qw[x0:x0 + QK_K], 16, _TWO * _sum_sq(xb, QK_K) / _FQK_K, b * per, xt, wt, sw)
            else:
                _to_lanes(xb, b * per, 16, xt)
        if use_qw:
            make_qx_quants_lanes(gb * per, 16, 4, xt, wt, Lt, scales, st)
        else:
            make_q3_quants_lanes(gb * per, 16, 4, xt, Lt, scales, st)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            yb = y[(g0 + b) * Q3_K_BYTES:(g0 + b + 1) * Q3_K_BYTES]
            _from_lanes(Lt, b * per, 16, L)
            if use_qw:
                _q3_k_impl_scales(yb, scales[b * per:(b + 1) * per], sw[b * per:(b + 1) * per], Ls, st)
            else:
                _q3_k_ref_scales(yb, scales[b * per:(b + 1) * per])
            _q3_k_finish(x[x0:x0 + QK_K], yb, L, d, de)


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_q3_k(x, qw, use_qw, out):
    for r in range(x.shape[0]):
        _q3_k_row(x[r], qw, use_qw, out[r])


# ---------------------------------------------------------------------------------------------- Q4_K / Q5_K

@jit
def _k4_requantize(x, y, L, nmax, d, dm, de, me):
    """Q4_K/Q5_K: re-quantize each sub-block with its f16 d·scale and dmin·min (skip when that is zero)."""
    dd = fp16_to_fp32(get_u16(y, Q4_K_D))
    dmm = fp16_to_fp32(get_u16(y, Q4_K_DMIN))
    for j in range(QK_K // 32):
        sc, m = _get_k4_scale(y, Q4_K_SCALES, j)
        d[j] = dd * F32(sc)
        dm[j] = dmm * F32(m)
    _requantize_asym(x, d, dm, 32, nmax, L, de, me)


@jit
def _k4_ref_scales(y, scales, mins):
    """quantize_row_q4_K_ref / q5_K_ref: 6-bit scales and mins against their maxima, d = max/63 (f16)."""
    max_scale = ZERO
    max_min = ZERO
    for j in range(QK_K // 32):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = K4_SCALE_MAX / max_scale if max_scale > ZERO else ZERO
    inv_min = K4_SCALE_MAX / max_min if max_min > ZERO else ZERO
    for j in range(QK_K // 32):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _pack_k4_scale(y, Q4_K_SCALES, j, ls, lm)
    put_u16(y, Q4_K_D, fp32_to_fp16(max_scale / K4_SCALE_MAX))
    put_u16(y, Q4_K_DMIN, fp32_to_fp16(max_min / K4_SCALE_MAX))


@jit
def _k4_impl_scales(y, scales, mins, sw, Ls, Lm, clamp_scales):
    """quantize_row_q4_K_impl / q5_K_impl: scales and mins quantized by make_qp_quants.

    ``clamp_scales``: Q5_K applies MIN(63, ·) to the make_qp_quants output, Q4_K does not.
    """
    d_block = make_qp_quants(QK_K // 32, 63, scales, Ls, sw)
    m_block = make_qp_quants(QK_K // 32, 63, mins, Lm, sw)
    for j in range(QK_K // 32):
        ls = np.int64(Ls[j])
        lm = np.int64(Lm[j])
        if clamp_scales:
            ls = min(63, ls)
            lm = min(63, lm)
        _pack_k4_scale(y, Q4_K_SCALES, j, ls, lm)
    put_u16(y, Q4_K_D, fp32_to_fp16(d_block))
    put_u16(y, Q4_K_DMIN, fp32_to_fp16(m_block))


@jit
def _q4_k_pack(L, y):
    for j in range(0, QK_K, 64):
        for l in range(32):
            y[Q4_K_QS + j // 2 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 4)) & 0xFF


@jit
def _q5_k_pack(L, y):
    for j in range(32):
        y[Q5_K_QH + j] = 0
    m1 = 1
    m2 = 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1 = np.int64(L[n + j])
            if l1 > 15:
                l1 -= 16
                y[Q5_K_QH + j] |= m1
            l2 = np.int64(L[n + j + 32])
            if l2 > 15:
                l2 -= 16
                y[Q5_K_QH + j] |= m2
            y[Q5_K_QS + n // 2 + j] = (l1 | (l2 << 4)) & 0xFF
        m1 <<= 2
        m2 <<= 2


@jit
def _k4_row(x, qw, use_qw, y, nmax):
    """One row of Q4_K (nmax=15) or Q5_K (nmax=31)."""
    per = QK_K // 32
    nb = x.shape[0] // QK_K
    group = SEARCH_GROUP // per
    block_bytes = Q4_K_BYTES if nmax == 15 else Q5_K_BYTES
    if use_qw:
        rmin, rdelta, nstep = IMATRIX_SEARCH
    elif nmax == 15:
        rmin, rdelta, nstep = Q4_K_REF_SEARCH
    else:
        rmin, rdelta, nstep = Q5_K_REF_SEARCH
    xt = np.empty((32, SEARCH_GROUP), np.float32)
    wt = np.empty((32, SEARCH_GROUP), np.float32)
    Lt = np.empty((32, SEARCH_GROUP), np.uint8)
    st = np.empty((QKX_STATE_ROWS, SEARCH_GROUP), np.float32)
    scales = np.empty(SEARCH_GROUP, np.float32)
    mins = np.empty(SEARCH_GROUP, np.float32)
    sw = np.empty(SEARCH_GROUP, np.float32)
    L = np.empty(QK_K, np.uint8)
    Ls = np.empty(per, np.uint8)
    Lm = np.empty(per, np.uint8)
    d = np.empty(per, np.float32)
    dm = np.empty(per, np.float32)
    de = np.empty(QK_K, np.float32)
    me = np.empty(QK_K, np.float32)
    for g0 in range(0, nb, group):
        gb = min(group, nb - g0)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            xb = x[x0:x0 + QK_K]
            if use_qw:
                _imatrix_lanes(xb, qw[x0:x0 + QK_K], 32, _TWO * _sum_sq(xb, QK_K) / _FQK_K, b * per, xt, wt, sw)
                continue
            for j in range(per):
                # _ref weights: sqrt(mean x² of the sub-block) + |x|
                av_x = F32(math.sqrt(_sum_sq(xb[32 * j:32 * j + 32], 32) / _F32_SUB))
                for i in range(32):
                    xt[i, b * per + j] = xb[32 * j + i]
                    wt[i, b * per + j] = av_x + abs(xb[32 * j + i])
        make_qkx_quants_lanes(gb * per, 32, nmax, xt, wt, Lt, rmin, rdelta, nstep, False, scales, mins, st)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            yb = y[(g0 + b) * block_bytes:(g0 + b + 1) * block_bytes]
            k0 = b * per
            _from_lanes(Lt, k0, 32, L)
            if use_qw:
                _k4_impl_scales(yb, scales[k0:k0 + per], mins[k0:k0 + per], sw[k0:k0 + per], Ls, Lm, nmax == 31)
            else:
                _k4_ref_scales(yb, scales[k0:k0 + per], mins[k0:k0 + per])
            _k4_requantize(x[x0:x0 + QK_K], yb, L, nmax, d, dm, de, me)
            if nmax == 15:
                _q4_k_pack(L, yb)
            else:
                _q5_k_pack(L, yb)


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_k4(x, qw, use_qw, out, nmax):
    """Q4_K (nmax=15) and Q5_K (nmax=31)."""
    for r in range(x.shape[0]):
        _k4_row(x[r], qw, use_qw, out[r], nmax)


# ---------------------------------------------------------------------------------------------- Q6_K

@jit
def _q6_k_finish(x, y, L, scales, d, de):
    """quantize_row_q6_K_ref / _impl after the sub-block searches: int8 scales against the largest |scale|,
    d = max/-128 (f16), re-quantization and packing."""
    max_scale = ZERO
    max_abs_scale = ZERO
    for ib in range(QK_K // 16):
        if abs(scales[ib]) > max_abs_scale:
            max_abs_scale = abs(scales[ib])
            max_scale = scales[ib]
    if max_abs_scale < GROUP_MAX_EPS:
        for k in range(Q6_K_BYTES):
            y[k] = 0
        return
    iscale = Q6_K_SCALE_RANGE / max_scale
    h = fp32_to_fp16(ONE / iscale)
    put_u16(y, Q6_K_D, h)
    for ib in range(QK_K // 16):
        y[Q6_K_SCALES + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF
    dd = fp16_to_fp32(h)
    for j in range(QK_K // 16):
        d[j] = dd * F32(as_int8(np.int64(y[Q6_K_SCALES + j])))
    _requantize_sym(x, d, 16, -32, 31, L, de)
    for j in range(0, QK_K, 128):
        ql = Q6_K_QL + j // 2
        qh = Q6_K_QH + j // 4
        for l in range(32):
            a = np.int64(L[j + l])
            b = np.int64(L[j + l + 32])
            c = np.int64(L[j + l + 64])
            e = np.int64(L[j + l + 96])
            y[ql + l] = ((a & 0xF) | ((c & 0xF) << 4)) & 0xFF
            y[ql + l + 32] = ((b & 0xF) | ((e & 0xF) << 4)) & 0xFF
            y[qh + l] = ((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)) & 0xFF


@jit
def _q6_k_row(x, qw, use_qw, y):
    per = QK_K // 16
    nb = x.shape[0] // QK_K
    group = SEARCH_GROUP // per
    xt = np.empty((16, SEARCH_GROUP), np.float32)
    wt = np.empty((16, SEARCH_GROUP), np.float32)
    Lt = np.empty((16, SEARCH_GROUP), np.uint8)
    st = np.empty((QX_STATE_ROWS, SEARCH_GROUP), np.float32)
    scales = np.empty(SEARCH_GROUP, np.float32)
    L = np.empty(QK_K, np.uint8)
    d = np.empty(per, np.float32)
    de = np.empty(QK_K, np.float32)
    for g0 in range(0, nb, group):
        gb = min(group, nb - g0)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            for j in range(per):
                k = b * per + j
                for i in range(16):
                    v = x[x0 + 16 * j + i]
                    xt[i, k] = v
                    # _impl uses the imatrix itself as the weights; _ref passes NULL, i.e. x².
                    wt[i, k] = qw[x0 + 16 * j + i] if use_qw else v * v
        make_qx_quants_lanes(gb * per, 16, 32, xt, wt, Lt, scales, st)
        for b in range(gb):
            x0 = (g0 + b) * QK_K
            _from_lanes(Lt, b * per, 16, L)
            _q6_k_finish(x[x0:x0 + QK_K], y[(g0 + b) * Q6_K_BYTES:(g0 + b + 1) * Q6_K_BYTES], L,
                         scales[b * per:(b + 1) * per], d, de)


@njit(cache=True, nogil=True, error_model="numpy")
def _encode_q6_k(x, qw, use_qw, out):
    for r in range(x.shape[0]):
        _q6_k_row(x[r], qw, use_qw, out[r])


# ---------------------------------------------------------------------------------------------- entry points

_NO_IMATRIX = np.zeros(0, np.float32)


def _run(kernel, block_bytes, x, imatrix, *extra):
    # float32 C-contiguous inputs (no copy when they already are): a float64 imatrix would compile a kernel
    # that rounds the weights twice.
    x = np.ascontiguousarray(x, dtype=np.float32)
    qw = _NO_IMATRIX if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    out = np.zeros((x.shape[0], (x.shape[1] // QK_K) * block_bytes), np.uint8)
    use_qw = imatrix is not None
    over_rows(x.shape[0], lambda r0, r1: kernel(x[r0:r1], qw, use_qw, out[r0:r1], *extra))
    return out


def encode_q2_k(x, imatrix=None):
    return _run(_encode_q2_k, Q2_K_BYTES, x, imatrix)


def encode_q3_k(x, imatrix=None):
    return _run(_encode_q3_k, Q3_K_BYTES, x, imatrix)


def encode_q4_k(x, imatrix=None):
    return _run(_encode_k4, Q4_K_BYTES, x, imatrix, 15)


def encode_q5_k(x, imatrix=None):
    return _run(_encode_k4, Q5_K_BYTES, x, imatrix, 31)


def encode_q6_k(x, imatrix=None):
    return _run(_encode_q6_k, Q6_K_BYTES, x, imatrix)
