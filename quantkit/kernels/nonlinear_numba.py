"""numba encoders for IQ4_NL and IQ4_XS, byte-identical to ggml's ``quantize_row_iq4_nl_impl`` (ntry = 7).

Layouts and rounding are documented in :mod:`quantkit.formats.nonlinear`; this module mirrors ggml operation by
operation in float32 (rules as in :mod:`quantkit.kernels.kq_primitives`).  Kernels take ``x: float32[rows, n]``,
``qw: float32[n]`` (ignored unless ``use_qw``) and write ``out: uint8[rows, ...]``, parallel over rows with
threads (:func:`quantkit.kernels.rows.over_rows`); rows are independent, so the bytes do not depend on the thread count.
"""
from __future__ import annotations

import numpy as np
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from numba import njit

from .kq_primitives import F32, GROUP_MAX_EPS, ONE, ZERO, fp32_to_fp16, jit, nearest_int, put_u16

BLOCK = 32
NTRY = 7          # quantize_iq4_nl / quantize_iq4_xs search 2*7+1 scales around -max/values[0]
N_TRIALS = 2 * NTRY + 2   # the starting scale, then itry = -7..7
# kvalues_iq4nl from gguf-py, the one source.  A module global, so numba compiles it in as a constant: the
# level searches then vectorize (passed as an argument, they run several times slower).
LEVELS = np.asarray(_GGUF_IQ4_NL.kvalues, dtype=np.float32)
_N_LEVELS = LEVELS.size


@njit(inline="always")
def best_index(x):
    """ggml best_index_int8(16, values, x): nearest level; a tie (after float32 rounding) picks the upper one.

    ggml's binary search, written without branches so that loops over it vectorize: ``mu`` counts the levels
    not above x (all 16 for NaN, where the search ends on the top level too), the result is mu-1 or mu by the
    float32 distances, and the two end tests come last with ggml's priority.
    """
    mu = 0
    for k in range(_N_LEVELS):
        mu += not x < LEVELS[k]
    mu = min(max(mu, 1), _N_LEVELS - 1)
    l = mu - 1 if x - LEVELS[mu - 1] < LEVELS[mu] - x else mu
    l = _N_LEVELS - 1 if x >= LEVELS[_N_LEVELS - 1] else l
    return 0 if x <= LEVELS[0] else l


@jit
def _block_scale(x, o, w, lanes):
    """The best scale of one 32-block (ggml's first loop body for ntry > 0); 0 for an all-zero block.

    ggml's 16 trial scales (the start -max/values[0], then (itry + values[0])/max for itry = -7..7) are
    independent until the choice, so their sums are accumulated side by side (``lanes``: 3 rows of 16;
    each sum still adds its terms in ggml's order) and ggml's "strictly better" choice is replayed in order.
    """
    amax = ZERO
    mx = ZERO
    for j in range(BLOCK):
        bigger = abs(x[o + j]) > amax
        mx = x[o + j] if bigger else mx
        amax = abs(x[o + j]) if bigger else amax
    if amax < GROUP_MAX_EPS:
        return ZERO, False
    iscale, sumqx, sumq2 = lanes[0], lanes[1], lanes[2]
    iscale[0] = ONE / (-mx / LEVELS[0])
    for t in range(1, N_TRIALS):
        iscale[t] = F32(t - 1 - NTRY + np.int64(LEVELS[0])) / mx
    for t in range(N_TRIALS):
        sumqx[t] = ZERO
        sumq2[t] = ZERO
    for j in range(BLOCK):
        xj = x[o + j]
        wj = w[j]
        for t in range(N_TRIALS):
            q = LEVELS[best_index(iscale[t] * xj)]
            wq = wj * q
            sumqx[t] += wq * xj
            sumq2[t] += wq * q
    d = sumqx[0] / sumq2[0] if sumq2[0] > ZERO else ZERO
    best = d * sumqx[0]
    for t in range(1, N_TRIALS):
        if sumq2[t] > ZERO and sumqx[t] * sumqx[t] > best * sumq2[t]:
            d = sumqx[t] / sumq2[t]
            best = d * sumqx[t]
    return d, True


@jit
def _weights(x, o, qw, use_qw, sigma2, w):
    for j in range(BLOCK):
        v = x[o + j]
        w[j] = qw[o + j] * np.sqrt(sigma2 + v * v) if use_qw else v * v


@jit
def _sigma2(x, o, n):
    s = ZERO
    for j in range(n):
        s += x[o + j] * x[o + j]
    return s * (F32(2.0) / F32(n))


@jit
def _levels(x, o, scale_inv, out, pos):
    """Pack best_index(scale_inv * x) of one 32-block: byte j = L[j] | L[j+16] << 4."""
    for j in range(16):
        out[pos + j] = best_index(scale_inv * x[o + j]) | (best_index(scale_inv * x[o + 16 + j]) << 4)


@njit(cache=True, nogil=True, error_model="numpy")
def iq4_nl(x, qw, use_qw, out):
    """IQ4_NL: 18-byte blocks (d f16, qs[16]); each 32-block is its own super-block."""
    nb = x.shape[1] // BLOCK
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        w = np.empty(BLOCK, np.float32)
        lanes = np.empty((3, N_TRIALS), np.float32)
        for ib in range(nb):
            o = ib * BLOCK
            pos = ib * 18
            _weights(xr, o, qw, use_qw, _sigma2(xr, o, BLOCK), w)
            d, _ = _block_scale(xr, o, w, lanes)
            put_u16(orow, pos, fp32_to_fp16(d))
            _levels(xr, o, ONE / d if d != ZERO else ZERO, orow, pos + 2)


@njit(cache=True, nogil=True, error_model="numpy")
def iq4_xs(x, qw, use_qw, out):
    """IQ4_XS: 136-byte super-blocks of 256 (d f16, scales_h u16, scales_l[4], qs[128])."""
    sbs = 256
    n_sub = sbs // BLOCK
    nsb = x.shape[1] // sbs
    for r in range(x.shape[0]):
        xr = x[r]
        orow = out[r]
        w = np.empty(BLOCK, np.float32)
        lanes = np.empty((3, N_TRIALS), np.float32)
        scales = np.empty(n_sub, np.float32)
        for isb in range(nsb):
            o = isb * sbs
            pos = isb * 136
            sigma2 = _sigma2(xr, o, sbs)
            max_scale = ZERO
            amax_scale = ZERO
            for ib in range(n_sub):
                _weights(xr, o + ib * BLOCK, qw, use_qw, sigma2, w)
                d, nonzero = _block_scale(xr, o + ib * BLOCK, w, lanes)
                scales[ib] = d
                if nonzero and abs(d) > amax_scale:
                    amax_scale = abs(d)
                    max_scale = d
            d = -max_scale / F32(32)
            put_u16(orow, pos, fp32_to_fp16(d))
            idd = ONE / d if d != ZERO else ZERO
            scales_h = 0
            for ib in range(n_sub):
                l = max(-32, min(31, nearest_int(idd * scales[ib])))
                dl = d * F32(l)
                _levels(xr, o + ib * BLOCK, ONE / dl if dl != ZERO else ZERO, orow, pos + 8 + 16 * ib)
                l += 32
                if ib % 2 == 0:
                    orow[pos + 4 + ib // 2] = l & 0xF
                else:
                    orow[pos + 4 + ib // 2] |= (l & 0xF) << 4
                scales_h |= (l >> 4) << (2 * ib)
            put_u16(orow, pos + 2, scales_h)
