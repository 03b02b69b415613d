"""numba encoders for the legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), byte-identical to ggml.

Layouts, rounding and the two ggml paths (``quantize_row_<t>_ref`` without an importance matrix,
``quantize_row_<t>_impl`` with one) are documented in :mod:`quantkit.formats.legacy`; this module mirrors them
operation by operation in float32 (the exactness rules are those of :mod:`quantkit.kernels.kq_primitives`,
whose ``nearest_int`` and f16 conversion are used here).  make_qx_quants evaluates its independent trial
scales side by side; make_qkx3_quants runs ggml's trials one after another, as it must: an accepted trial
moves ``min``, which the later trials use.

Each public kernel takes ``x: float32[rows, n]`` (C-contiguous, finite), ``qw: float32[n]`` where it uses one,
and writes ``out: uint8[rows, n/32 * type_size]``, parallel over rows with ``prange``.  Rows are independent, so
the bytes do not depend on the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kq_primitives import F32, GROUP_MAX_EPS, ONE, ZERO, fp32_to_fp16, jit, nearest_int, put_u16

QK = 32
_HALF = F32(0.5)
_TENTH = F32(0.1)
_TWO_POW_31 = F32(2.0 ** 31)
_INT32_MIN = np.int64(-2147483648)
_FLT_MAX = F32(3.4028234663852886e38)
# make_qkx3_quants arguments of quantize_row_q4_1_impl / q5_1_impl: rmin, rdelta, nstep
_QKX3_RMIN = F32(-0.9)
_QKX3_RDELTA = F32(0.05)
_QKX3_NSTEP = 36
QX_TRIALS = 19  # make_qx_quants: the starting scale and 18 more


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
def make_qx_quants(nmax, x, L, w, lanes):
    """ggml make_qx_quants(32, nmax, x, L, rmse_type=1, w): L[i] = l + nmax, l in [-nmax, nmax-1]; the scale.

    The 19 trial scales (the start -nmax/max, then -(nmax + 0.1·is)/max for is = -9..-1, 1..9) do not depend
    on each other, only ggml's "strictly better" choice does: their sums are accumulated side by side
    (``lanes``: 3 rows of QX_TRIALS, each sum adding its terms in ggml's order) and the choice is replayed.
    """
    n = x.shape[0]
    amax = ZERO
    mx = ZERO
    for i in range(n):
        bigger = abs(x[i]) > amax
        mx = x[i] if bigger else mx
        amax = abs(x[i]) if bigger else amax
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return ZERO
    fnmax = F32(nmax)
    iscale, sumlx, suml2 = lanes[0], lanes[1], lanes[2]
    iscale[0] = -fnmax / mx
    for t in range(1, QX_TRIALS):
        step = t - 10 if t < 10 else t - 9
        iscale[t] = -(fnmax + _TENTH * F32(step)) / mx
    for t in range(QX_TRIALS):
        sumlx[t] = ZERO
        suml2[t] = ZERO
    for i in range(n):
        xi = x[i]
        wi = w[i]
        wx = wi * xi
        for t in range(QX_TRIALS):
            fl = F32(max(-nmax, min(nmax - 1, nearest_int(iscale[t] * xi))))
            sumlx[t] += wx * fl
            suml2[t] += wi * fl * fl
    scale = sumlx[0] / suml2[0] if suml2[0] != ZERO else ZERO
    best = scale * sumlx[0]
    chosen = 0
    for t in range(1, QX_TRIALS):
        if suml2[t] > ZERO and sumlx[t] * sumlx[t] > best * suml2[t]:
            scale = sumlx[t] / suml2[t]
            best = scale * sumlx[t]
            chosen = t
    for i in range(n):
        L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale[chosen] * x[i])))
    return scale


@jit
def make_qkx3_quants(nmax, x, w, L, Laux):
    """ggml make_qkx3_quants(32, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, use_mad=false), in ggml's order.

    Returns (scale, the_min).  The trials run one after another because an accepted trial moves ``min``,
    which every later trial's iscale and levels use.
    """
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > ZERO:
        mn = ZERO
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return ZERO, -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = ONE / iscale
    best_error = ZERO
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        L[i] = l
        diff = scale * F32(l) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for step in range(_QKX3_NSTEP + 1):
        iscale = (_QKX3_RMIN + _QKX3_RDELTA * F32(step) + fnmax) / (mx - mn)
        sum_l = ZERO
        sum_l2 = ZERO
        sum_xl = ZERO
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            wl = w[i] * F32(l)
            sum_l += wl
            sum_l2 += wl * F32(l)
            sum_xl += wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > ZERO:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > ZERO:
                this_min = ZERO
                this_scale = sum_xl / sum_l2
            err = ZERO
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                err += w[i] * (diff * diff)
            if err < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = err
                scale = this_scale
                mn = this_min
    return scale, -mn


@jit
def _row_sigma2(x):
    """Σx²/n over the whole row, summed in order (quantize_row_<t>_impl)."""
    s = ZERO
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s / F32(x.shape[0])


@jit
def _block_weights(x, o, qw, sigma2, w):
    """w[j] = qw[j] * sqrtf(sigma2 + x[j]²) over one block."""
    for j in range(QK):
        v = x[o + j]
        w[j] = qw[o + j] * np.sqrt(sigma2 + v * v)


@njit(parallel=True, cache=True, error_model="numpy")
def q8_0(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
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


@njit(parallel=True, cache=True, error_model="numpy")
def symmetric(x, out, nmax, type_size):
    """Q4_0 (nmax 8, 18-byte blocks) and Q5_0 (nmax 16, 22-byte blocks) without an importance matrix.

    ggml: d = max/-nmax (max: the first weight of largest |x|), q = MIN(2nmax-1, (int8)(x*id + nmax + 0.5)).
    """
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
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


@njit(parallel=True, cache=True, error_model="numpy")
def affine(x, out, nmax, type_size):
    """Q4_1 (nmax 15, 20-byte blocks) and Q5_1 (nmax 31, 24-byte blocks) without an importance matrix.

    ggml: d = (max-min)/nmax, m = min, q = (int8)((x-min)*id + 0.5), clamped with MIN(15, ·) for Q4_1 only.
    """
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
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


@njit(parallel=True, cache=True, error_model="numpy")
def symmetric_imatrix(x, qw, out, nmax, type_size):
    """Q4_0 / Q5_0 with an importance matrix: make_qx_quants(32, nmax, x, L, 1, qw·sqrt(σ²+x²)) per block."""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr = x[r]
        orow = out[r]
        L = np.empty(QK, np.int64)
        w = np.empty(QK, np.float32)
        lanes = np.empty((3, QX_TRIALS), np.float32)
        sigma2 = _row_sigma2(xr)
        for ib in range(nb):
            o = ib * QK
            pos = ib * type_size
            _block_weights(xr, o, qw, sigma2, w)
            d = make_qx_quants(nmax, xr[o:o + QK], L, w, lanes)
            put_u16(orow, pos, fp32_to_fp16(d))
            _pack(orow, pos + 2, L, nmax == 16)


@njit(parallel=True, cache=True, error_model="numpy")
def affine_imatrix(x, qw, out, nmax, type_size):
    """Q4_1 / Q5_1 with an importance matrix: make_qkx3_quants(32, nmax, x, w, L, &min, Laux, -0.9, 0.05, 36)."""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr = x[r]
        orow = out[r]
        L = np.empty(QK, np.int64)
        Laux = np.empty(QK, np.int64)
        w = np.empty(QK, np.float32)
        sigma2 = _row_sigma2(xr)
        for ib in range(nb):
            o = ib * QK
            pos = ib * type_size
            _block_weights(xr, o, qw, sigma2, w)
            d, the_min = make_qkx3_quants(nmax, xr[o:o + QK], w, L, Laux)
            put_u16(orow, pos, fp32_to_fp16(d))
            put_u16(orow, pos + 2, fp32_to_fp16(-the_min))
            _pack(orow, pos + 4, L, nmax == 31)
