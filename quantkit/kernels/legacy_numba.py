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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .kq_primitives import (F32, ONE, QKX_STATE_ROWS, QX_STATE_ROWS, ZERO, fp32_to_fp16, jit,
                            make_qkx_quants_lanes, make_qx_quants_lanes, put_u16)

QK = 32
_HALF = F32(0.5)
_TWO_POW_31 = F32(2.0 ** 31)
_FLT_MAX = F32(3.4028234663852886e38)
_INT8_END = F32(128)
_MINUS_ZERO = F32(-0.0)
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
def _small_quants(v_a, v_b):
    """Whether every quant value of a block lies in [0, 128), given the values v_a and v_b it takes at the block's
    smallest and largest weight.  Each quant is ``x*id + c`` or ``(x - min)*id + c``: correctly rounded float
    operations are monotone in x, so every weight's value lies between v_a and v_b.  In [0, 128) C's
    ``(int)`` is a plain truncation and ``(int8_t)`` keeps it, so the block needs none of :func:`_c_low_byte`'s
    emulation (NaN, inf, |v| >= 2^31: only blocks with a zero, huge or tiny scale fail this test)."""
    return v_a >= ZERO and v_a < _INT8_END and v_b >= ZERO and v_b < _INT8_END


_V8 = ir.VectorType(ir.FloatType(), 8)


@intrinsic
def _block_min_max(typingctx, x, o):
    """The smallest and largest value of the 32 finite float32 weights ``x[o:o+32]`` of a C-contiguous row.

    Written as <8 x float> vector IR: numba runs LLVM without the SLP vectorizer and the loop vectorizer leaves
    8-trip loops alone, so plain code gets scalar minss/maxss chains.  Values only: which zero (+0 or -0) a scan
    keeps depends on its order, so callers rescan a block whose result decides on a zero."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == types.float32):
        return None
    sig = types.UniTuple(types.float32, 2)(x, types.intp)

    def codegen(context, builder, signature, args):
        row = context.make_array(signature.args[0])(context, builder, args[0])
        vectors = builder.bitcast(builder.gep(row.data, [args[1]]), _V8.as_pointer())
        v = [builder.load(builder.gep(vectors, [ir.Constant(ir.IntType(64), k)]), align=4) for k in range(4)]

        def reduce(pred):
            def pick(a, b):
                return builder.select(builder.fcmp_ordered(pred, a, b), a, b)
            m = pick(pick(v[0], v[1]), pick(v[2], v[3]))
            for w in (4, 2, 1):
                lanes = [ir.Constant(ir.VectorType(ir.IntType(32), w), list(range(k, k + w))) for k in (0, w)]
                m = pick(builder.shuffle_vector(m, m, lanes[0]), builder.shuffle_vector(m, m, lanes[1]))
            return builder.extract_element(m, ir.Constant(ir.IntType(32), 0))

        return context.make_tuple(builder, signature.return_type, (reduce("<"), reduce(">")))

    return sig, codegen


@njit(inline="always")
def _first_abs_max(x, o, mn, mx):
    """ggml's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from +0: the first weight of largest |x|.

    From the block's min and max (a select: which one wins is a coin flip on random weights, a branch would
    be mispredicted half the time); only a tie of +a and -a needs the scan (an all-zero block gives +0)."""
    first = mx if mx > -mn else mn
    if mx == -mn:
        first = ZERO
        if mx > ZERO:
            for j in range(QK):
                if abs(x[o + j]) == mx:
                    return x[o + j]
    return first


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
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        for ib in range(nb):
            o = ib * QK
            pos = ib * type_size
            mn, mx = _block_min_max(xr, o)
            d = _first_abs_max(xr, o, mn, mx) / F32(-nmax)
            idd = ONE / d if d != ZERO else ZERO
            put_u16(orow, pos, fp32_to_fp16(d))
            if _small_quants(mn * idd + offset, mx * idd + offset):
                _pack_quants(xr, o, orow, pos + 2, idd, _MINUS_ZERO, offset, top, five_bit, True)
            else:
                _pack_quants(xr, o, orow, pos + 2, idd, _MINUS_ZERO, offset, top, five_bit, False)


@njit(inline="always")
def _affine(x, out, nmax, type_size, five_bit):
    """quantize_row_q4_1_ref / q5_1_ref: d = (max-min)/nmax, m = min, q = (int8)((x-min)*id + 0.5), clamped
    with MIN(15, ·) for Q4_1 only (Q5_1 stores ``(uint8_t)`` of it)."""
    nb = x.shape[1] // QK
    top = 15 if nmax == 15 else 255  # MIN(255, ·) leaves a byte as it is
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
            if _small_quants((mn - mn) * idd + _HALF, (mx - mn) * idd + _HALF):
                _pack_quants(xr, o, orow, pos + 4, idd, mn, _HALF, top, five_bit, True)
            else:
                _pack_quants(xr, o, orow, pos + 4, idd, mn, _HALF, top, five_bit, False)


@njit(inline="always")
def _pack_quants(xr, o, orow, pos, idd, mn, offset, top, five_bit, small):
    """One block's quants ``(uint8_t)MIN(top, (int8_t)((x - mn)*id + offset))`` stored at pos: 4-bit
    ``qs[j] = q[j] | q[j+16] << 4``; 5-bit ``qh`` (u32, bit j = bit 4 of q[j]), then qs of the low nibbles.
    ``small``: :func:`_small_quants` holds, so the conversion is a plain truncation.  The symmetric types pass
    mn = -0: ``x - -0`` is x except that x = -0 becomes +0, and ``±0*id + offset`` is the same value either
    way (offset, or NaN for an infinite id).  With +0 LLVM would drop the subtraction, fully unroll the
    shorter loop and never vectorize it."""
    qs = pos + 4 if five_bit else pos
    qh = 0
    for j in range(16):
        if small:
            lo = min(np.int32((xr[o + j] - mn) * idd + offset), top)
            hi = min(np.int32((xr[o + 16 + j] - mn) * idd + offset), top)
        else:
            lo = _c_min_byte((xr[o + j] - mn) * idd + offset, top)
            hi = _c_min_byte((xr[o + 16 + j] - mn) * idd + offset, top)
        if five_bit:
            orow[qs + j] = (lo & 0x0F) | ((hi & 0x0F) << 4)
            qh |= (((lo & 0x10) >> 4) << j) | (((hi & 0x10) >> 4) << (j + 16))
        else:
            orow[qs + j] = (lo | (hi << 4)) & 0xFF
    if five_bit:
        for k in range(4):
            orow[pos + k] = (qh >> (8 * k)) & 0xFF


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
