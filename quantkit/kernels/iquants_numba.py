"""Fast I-quant encoders (IQ2_XXS, IQ2_XS, IQ3_XXS) in numba, byte-identical to ggml's ``ggml_quantize_chunk``.

The algorithm, layouts and rounding are documented in :mod:`quantkit.formats.iquants` (and its readable
reference encoders); the tables in :mod:`quantkit.formats.iq_tables`; the float32 exactness rules in
:mod:`quantkit.kernels.kq_primitives`, whose ``nearest_int``, ``make_qp_quants`` and half conversion are used
here.  This module does the same float32 operations in the same order, restructured for speed only where
that cannot change a result:

* The neighbour search computes the weighted distance of every listed neighbour in one pass per element
  (``nb_pos`` is element-major), so the loop over neighbours vectorises; each neighbour's distance is still
  accumulated element 0..dim-1 in ggml's order, and the argmin is a sequential first-strict-minimum scan.
* Rows are independent: they run in parallel (``prange``) and the bytes do not depend on the thread count.

Where ggml aborts the process (``GGML_ASSERT(grid_index >= 0)`` when every neighbour distance is inf/NaN,
``GGML_ASSERT(scale >= 0)`` or "point not on grid" when a sub-block scale is NaN — both only reachable when
weights overflow float32, |x| above ~1e13), the row's status says so and the caller raises.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..formats.iq_tables import NB_ALIGN
from .kq_primitives import F32, GROUP_MAX_EPS, ONE, ZERO, fp32_to_fp16, jit, make_qp_quants, nearest_int, put_u16

QK_K = 256

# The per-group helpers are inlined into the row kernels at numba-IR level: as separate functions every call
# would increment and decrement the reference counts of its array arguments (atomic operations on the shared
# tables, which also serialise threads).
inline = njit(cache=True, error_model="numpy", inline="always")

# Row status codes (0: encoded).  Each is a condition on which ggml aborts instead of writing the row.
OK = 0
NO_NEIGHBOUR = 1     # every neighbour's weighted distance is inf or NaN
NAN_SCALE = 2        # a sub-block scale came out NaN
OFF_GRID = 3         # the final quants of a group are not a grid point

_HALF = F32(0.5)
_FLT_MAX = F32(np.finfo(np.float32).max)
_TENTH = F32(0.1)
_FIFTH = F32(0.2)
_SCALE_DIV = F32(31.0)                 # super-block scale d = max sub-block scale / 31 (4-bit scales)
_IQ3_D_FUDGE = F32(1.0125)             # IQ3_XXS stores d * 1.0125 ("small improvement via this fudge factor")
_GROUP_MAX_EPS_IQ3_XXS = F32(1e-8)
_FQK_K = F32(QK_K)
_TWO = F32(2.0)
_SCALE_NIBBLE_MAX = 15

IQ2_XXS_BYTES = 66    # d f16 | 8 × (u32 four grid indices, u32 four 7-bit sign codes | 4-bit scale << 28)
IQ2_XS_BYTES = 74     # d f16 | 32 × u16 (9-bit grid index | 7-bit sign code << 9) | 8 × two 4-bit scales
IQ3_XXS_BYTES = 98    # d f16 | 64 × u8 grid index | 8 × u32 (four 7-bit sign codes | 4-bit scale << 28)


# ------------------------------------------------------------------------------------------------ shared steps

@inline
def _sum_sq(x, off, n):
    s = ZERO
    for i in range(n):
        s += x[off + i] * x[off + i]
    return s


@inline
def _fold_signs(x, off, weight, xval, base):
    """|x| of one group of 8 into xval, and its 7-bit sign code.

    An odd number of negatives cannot be stored (the 8th sign is the parity of the 7 stored), so the element
    with the smallest weight·x² keeps the wrong sign: its xval is negated instead.
    """
    nflip = 0
    s = 0
    for i in range(8):
        v = x[off + base + i]
        if v >= ZERO:
            xval[base + i] = v
        else:
            xval[base + i] = -v
            nflip += 1
            s |= 1 << i
    if nflip % 2:
        imin = 0
        vmin = weight[base] * x[off + base] * x[off + base]
        for i in range(1, 8):
            ax = weight[base + i] * x[off + base + i] * x[off + base + i]
            if ax < vmin:
                vmin = ax
                imin = i
        xval[base + imin] = -xval[base + imin]
        s ^= 1 << imin
    return s & 127


@inline
def _max_of(v, n):
    """ggml's running MAX(a, b) = a > b ? a : b, starting from v[0]."""
    m = v[0]
    for i in range(1, n):
        m = m if m > v[i] else v[i]
    return m


@jit
def _search(xval, weight, waux, Ls, on_grid, n, dim, bits, kmaxq, base_q, step, n_steps, denom, scale,
            refine_all, kmap, levels, nb_start, nb_count, nb_pos, nb_index, d2):
    """ggml's scale search for one sub-block of n weights in groups of dim.  Returns (status, scale).

    Trials: for is in -n_steps..n_steps, id = (base_q + is·step)/denom; every group is rounded to levels
    0..kmaxq-1 of 1/id and, when that point is off the grid, moved to the neighbour of least
    Σ waux·(q/id − x)² (the first one on ties).  The trial with the best Σwxq²/Σwq² (q = 2l+1) gives the
    scale, the levels Ls[0] and the on-grid flags on_grid[0].  Then one refinement pass at that scale re-snaps
    every group (refine_all) or the ones that were off the grid, and refits the scale by least squares.
    Ls[1] and on_grid[1] hold the trial in progress (one 2-row array each: no per-trial array rebinding).
    """
    n_groups = n // dim
    n_trials = 2 * n_steps + 1
    best = ZERO
    for t in range(n_trials + 1):
        refining = t == n_trials
        if refining:
            if not scale > ZERO:
                break
            if not refine_all:
                n_off = 0
                for k in range(n_groups):
                    n_off += not on_grid[0, k]
                if n_off == 0:
                    break
            inv_scale = ONE / scale
            this_scale = scale
            dst = 0
        else:
            inv_scale = (base_q + F32(t - n_steps) * step) / denom
            this_scale = ONE / inv_scale
            dst = 1
        for k in range(n_groups):
            if refining and not refine_all and on_grid[0, k]:
                continue
            base = k * dim
            u = 0
            for i in range(dim):
                l = nearest_int(_HALF * (inv_scale * xval[base + i] - ONE))
                l = max(0, min(kmaxq - 1, l))
                Ls[dst, base + i] = l
                u |= l << (bits * i)
            g = np.int64(kmap[u])
            on_grid[1, k] = g >= 0
            if g >= 0:
                continue
            # iq2/iq3_find_best_neighbour: distances scored NB_ALIGN neighbours at a time (a vector loop, each
            # distance summed in ggml's element order), then ggml's scan: the first d2 below the best so far.
            lst = -g - 1
            start = nb_start[lst]
            count = nb_count[lst]
            for c in range(0, count, NB_ALIGN):
                chunk = (start + c) // NB_ALIGN
                for jj in range(NB_ALIGN):
                    acc = ZERO
                    for i in range(dim):
                        diff = this_scale * F32(nb_pos[chunk, i, jj]) - xval[base + i]
                        acc += waux[base + i] * diff * diff
                    d2[c + jj] = acc
            best_d2 = _FLT_MAX
            jbest = -1
            for j in range(count):
                if d2[j] < best_d2:
                    best_d2 = d2[j]
                    jbest = j
            if jbest < 0:
                return NO_NEIGHBOUR, scale
            g = np.int64(nb_index[start + jbest])
            for i in range(dim):
                Ls[dst, base + i] = levels[g, i]
        sumqx = ZERO
        sumq2 = ZERO
        for i in range(n):
            w = weight[i]
            q = F32(2 * Ls[dst, i] + 1)
            sumqx += w * xval[i] * q
            sumq2 += w * q * q
        if refining:
            if sumq2 > ZERO:
                scale = sumqx / sumq2
        elif sumq2 > ZERO and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                Ls[0, i] = Ls[1, i]
            for k in range(n_groups):
                on_grid[0, k] = on_grid[1, k]
    return OK, scale


@inline
def _lookup_groups(L, n_groups, dim, bits, kmap, grid_out):
    """The final grid index of each group from its levels (ggml aborts if one is off the grid)."""
    for k in range(n_groups):
        u = 0
        for i in range(dim):
            u |= np.int64(L[k * dim + i]) << (bits * i)
        g = kmap[u]
        if g < 0:
            return False
        grid_out[k] = g
    return True


@jit
def _scale_nibble(inv_d, scale):
    return max(0, min(_SCALE_NIBBLE_MAX, nearest_int(_HALF * (inv_d * scale - ONE))))


@jit
def _put_u32(out, pos, v):
    for b in range(4):
        out[pos + b] = (v >> (8 * b)) & 0xFF


@jit
def _distance_buffer(nb_count):
    """Scratch for the distances of the longest neighbour list, padded to whole chunks."""
    return np.empty(-(-nb_count.max() // NB_ALIGN) * NB_ALIGN, np.float32)


@jit
def _prepare(x, off, n, qw, use_qw, sigma2, weight, waux, xval, signs):
    """Weights, their square roots, |x| with the parity fix-up and the sign codes of one sub-block; returns
    max xval (ggml's MAX chain)."""
    if use_qw:
        for i in range(n):
            weight[i] = qw[off + i] * np.sqrt(sigma2 + x[off + i] * x[off + i])
    else:
        for i in range(n):
            weight[i] = x[off + i] * x[off + i]
    for i in range(n):
        waux[i] = np.sqrt(weight[i])
    for k in range(n // 8):
        signs[k] = _fold_signs(x, off, weight, xval, 8 * k)
    return _max_of(xval, n)


@jit
def _finish_scale(scale, signs, n_signs):
    """ggml's guard after the search: a NaN scale aborts; a negative one flips the sign codes (it "should
    never happen").  Returns (status, |scale|)."""
    if scale != scale:
        return NAN_SCALE, scale
    if scale < ZERO:
        for k in range(n_signs):
            signs[k] = ~signs[k] & 127
        return OK, -scale
    return OK, scale


# --------------------------------------------------------------------------------------------------- IQ2_XXS

@jit
def _iq2_xxs_row(x, qw, y, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    """quantize_row_iq2_xxs_impl for one row; y receives the row's blocks.  Returns a status code."""
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    Ls = np.zeros((2, 32), np.int64)
    Lqp = np.zeros(32, np.uint8)
    on_grid = np.ones((2, 4), np.bool_)
    d2 = _distance_buffer(nb_count)
    grid_idx = np.zeros(4, np.int64)
    signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    q2 = np.zeros(16, np.int64)
    for ibl in range(x.shape[0] // QK_K):
        xo = QK_K * ibl
        q2[:] = 0
        max_scale = ZERO
        sigma2 = _sum_sq(x, xo, QK_K) / _FQK_K
        for ib in range(8):
            mx = _prepare(x, xo + 32 * ib, 32, qw, True, sigma2, weight, waux, xval, signs)
            scales[ib] = ZERO
            if mx < GROUP_MAX_EPS:
                continue
            scale = make_qp_quants(32, 4, xval, Lqp, weight)
            eff_max = scale * F32(3)
            if eff_max <= ZERO:
                continue
            status, scale = _search(xval, weight, waux, Ls, on_grid, 32, 8, 2, 3, F32(5), _TENTH, 6, eff_max,
                                    scale, True, kmap, levels, nb_start, nb_count, nb_pos, nb_index, d2)
            if status == OK:
                status, scale = _finish_scale(scale, signs, 4)
            if status == OK and not _lookup_groups(Ls[0], 4, 8, 2, kmap, grid_idx):
                status = OFF_GRID
            if status != OK:
                return status
            for k in range(4):
                q2[2 * ib] |= grid_idx[k] << (8 * k)
                q2[2 * ib + 1] |= signs[k] << (7 * k)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        yo = IQ2_XXS_BYTES * ibl
        if max_scale == ZERO:
            for b in range(IQ2_XXS_BYTES):
                y[yo + b] = 0
            continue
        d = max_scale / _SCALE_DIV
        put_u16(y, yo, fp32_to_fp16(d))
        inv_d = ONE / d
        for ib in range(8):
            q2[2 * ib + 1] |= _scale_nibble(inv_d, scales[ib]) << 28
        for j in range(16):
            _put_u32(y, yo + 2 + 4 * j, q2[j])
    return OK


@njit(parallel=True, cache=True, error_model="numpy")
def encode_iq2_xxs_rows(x, qw, out, status, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    for r in prange(x.shape[0]):
        status[r] = _iq2_xxs_row(x[r], qw, out[r], kmap, levels, nb_start, nb_count, nb_pos, nb_index)


# ---------------------------------------------------------------------------------------------------- IQ2_XS

@jit
def _iq2_xs_row(x, qw, y, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    """quantize_row_iq2_xs_impl for one row; y receives the row's blocks.  Returns a status code."""
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    Ls = np.zeros((2, 16), np.int64)
    on_grid = np.ones((2, 2), np.bool_)
    d2 = _distance_buffer(nb_count)
    grid_idx = np.zeros(2, np.int64)
    signs = np.zeros(2, np.int64)
    scales = np.zeros(16, np.float32)
    q2 = np.zeros(32, np.int64)
    for ibl in range(x.shape[0] // QK_K):
        xo = QK_K * ibl
        q2[:] = 0
        max_scale = ZERO
        sigma2 = _sum_sq(x, xo, QK_K) / _FQK_K
        for ib in range(16):
            mx = _prepare(x, xo + 16 * ib, 16, qw, True, sigma2, weight, waux, xval, signs)
            Ls[0, :] = 0
            scales[ib] = ZERO
            if mx < GROUP_MAX_EPS:
                continue
            on_grid[0, :] = True
            status, scale = _search(xval, weight, waux, Ls, on_grid, 16, 8, 2, 3, F32(5), _TENTH, 9, mx,
                                    mx / F32(5), False, kmap, levels, nb_start, nb_count, nb_pos, nb_index, d2)
            if status == OK:
                status, scale = _finish_scale(scale, signs, 2)
            if status == OK and not _lookup_groups(Ls[0], 2, 8, 2, kmap, grid_idx):
                status = OFF_GRID
            if status != OK:
                return status
            for k in range(2):
                q2[2 * ib + k] = grid_idx[k] | (signs[k] << 9)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        yo = IQ2_XS_BYTES * ibl
        for b in range(IQ2_XS_BYTES):
            y[yo + b] = 0
        if max_scale == ZERO:
            continue
        d = max_scale / _SCALE_DIV
        put_u16(y, yo, fp32_to_fp16(d))
        inv_d = ONE / d
        for j in range(32):
            put_u16(y, yo + 2 + 2 * j, q2[j])
        for ib in range(16):
            y[yo + 66 + ib // 2] |= _scale_nibble(inv_d, scales[ib]) << (4 * (ib % 2))
    return OK


@njit(parallel=True, cache=True, error_model="numpy")
def encode_iq2_xs_rows(x, qw, out, status, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    for r in prange(x.shape[0]):
        status[r] = _iq2_xs_row(x[r], qw, out[r], kmap, levels, nb_start, nb_count, nb_pos, nb_index)


# --------------------------------------------------------------------------------------------------- IQ3_XXS

@jit
def _iq3_xxs_row(x, qw, use_qw, y, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    """quantize_row_iq3_xxs_impl(256, ...) for one row; y receives the row's blocks.  Returns a status code."""
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    Ls = np.zeros((2, 32), np.int64)
    on_grid = np.ones((2, 8), np.bool_)
    d2 = _distance_buffer(nb_count)
    grid_idx = np.zeros(8, np.int64)
    signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    scales_and_signs = np.zeros(8, np.int64)
    for ibl in range(x.shape[0] // QK_K):
        xo = QK_K * ibl
        yo = IQ3_XXS_BYTES * ibl
        for b in range(IQ3_XXS_BYTES):
            y[yo + b] = 0
        scales_and_signs[:] = 0
        max_scale = ZERO
        sigma2 = _TWO * _sum_sq(x, xo, QK_K) / _FQK_K
        for ib in range(8):
            mx = _prepare(x, xo + 32 * ib, 32, qw, use_qw, sigma2, weight, waux, xval, signs)
            Ls[0, :] = 0
            scales[ib] = ZERO
            if mx < _GROUP_MAX_EPS_IQ3_XXS:
                continue
            on_grid[0, :] = True
            status, scale = _search(xval, weight, waux, Ls, on_grid, 32, 4, 3, 8, F32(15), _FIFTH, 15, mx,
                                    mx / F32(15), False, kmap, levels, nb_start, nb_count, nb_pos, nb_index, d2)
            if status == OK:
                status, scale = _finish_scale(scale, signs, 4)
            if status == OK and not _lookup_groups(Ls[0], 8, 4, 3, kmap, grid_idx):
                status = OFF_GRID
            if status != OK:
                return status
            for k in range(8):
                y[yo + 2 + 8 * ib + k] = grid_idx[k]
            scales_and_signs[ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:
            for b in range(IQ3_XXS_BYTES):
                y[yo + b] = 0
            continue
        d = max_scale / _SCALE_DIV
        put_u16(y, yo, fp32_to_fp16(d * _IQ3_D_FUDGE))
        inv_d = ONE / d
        for ib in range(8):
            _put_u32(y, yo + 66 + 4 * ib, scales_and_signs[ib] | (_scale_nibble(inv_d, scales[ib]) << 28))
    return OK


@njit(parallel=True, cache=True, error_model="numpy")
def encode_iq3_xxs_rows(x, qw, use_qw, out, status, kmap, levels, nb_start, nb_count, nb_pos, nb_index):
    for r in prange(x.shape[0]):
        status[r] = _iq3_xxs_row(x[r], qw, use_qw, out[r], kmap, levels, nb_start, nb_count, nb_pos, nb_index)
