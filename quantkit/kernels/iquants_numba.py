"""Fast I-quant encoders (IQ2_XXS, IQ2_XS, IQ3_XXS) in numba, byte-identical to ggml's ``ggml_quantize_chunk``.

The algorithm, layouts and rounding are documented in :mod:`quantkit.formats.iquants` (with its readable
reference encoders), the search tables in :mod:`quantkit.formats.iq_tables`, the float32 exactness rules in
:mod:`quantkit.kernels.kq_primitives` (whose ``nearest_int``, ``make_qp_quants`` and half conversion are used
here).  The kernels do ggml's float32 operations in ggml's order; what differs is only arrangement:

* Neighbour search: the distances of NB_ALIGN listed neighbours are computed together (``nb_pos`` holds their
  lattice values chunk by chunk, element-major), a loop that vectorises; each distance is still summed over
  elements 0..dim-1 in ggml's order, and the pick is ggml's sequential first-strict-minimum scan.
* One trial loop serves the trials and the refinement pass (``_search``), levels of the kept trial and of
  the trial in progress live in one 2-row array.
* Rows run in parallel (:func:`quantkit.kernels.rows.over_rows`), one contiguous part per thread, each with
  private copies of everything it reads; a row's bytes do not depend on the thread count.

Where ggml aborts the process (``GGML_ASSERT(grid_index >= 0)`` when every neighbour distance is inf/NaN,
``GGML_ASSERT(scale >= 0)`` or "point not on grid" when a sub-block scale is NaN: weights so large that the
weighted distances overflow float32), the row's status says which and the caller raises.
"""
from __future__ import annotations

import numpy as np

from ..formats.iq_tables import NB_ALIGN
from .kq_primitives import F32, GROUP_MAX_EPS, ONE, ZERO, fp32_to_fp16, jit, make_qp_quants, nearest_int, put_u16

QK_K = 256

# ggml's type ids, the ``qtype`` argument of the kernels.
IQ2_XXS = 16
IQ2_XS = 17
IQ3_XXS = 18

# Row status codes (0: encoded).  Each other one is a condition on which ggml aborts instead of writing the row.
EMPTY = -1           # (sub-block only) all weights below the zero threshold: nothing is stored
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
_EPS_IQ3_XXS = F32(1e-8)               # IQ3_XXS's all-zero threshold (GROUP_MAX_EPS_IQ3_XXS)
_FQK_K = F32(QK_K)
_TWO = F32(2.0)
_SCALE_NIBBLE_MAX = 15

IQ2_XXS_BYTES = 66    # d f16 | 8 × (u32 four grid indices, u32 four 7-bit sign codes | 4-bit scale << 28)
IQ2_XS_BYTES = 74     # d f16 | 32 × u16 (9-bit grid index | 7-bit sign code << 9) | 8 × two 4-bit scales
IQ3_XXS_BYTES = 98    # d f16 | 64 × u8 grid index | 8 × u32 (four 7-bit sign codes | 4-bit scale << 28)


# ------------------------------------------------------------------------------------------------ shared steps

@jit
def _sum_sq(x, off, n):
    s = ZERO
    for i in range(n):
        s += x[off + i] * x[off + i]
    return s


@jit
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


@jit
def _max_of(v, n):
    """ggml's running MAX(a, b) = a > b ? a : b, starting from v[0]."""
    m = v[0]
    for i in range(1, n):
        m = m if m > v[i] else v[i]
    return m


@jit
def _search(xval, weight, waux, Ls, on_grid, n, dim, bits, kmaxq, base_q, step, n_steps, denom, scale,
            refine_all, kmap, nb_start, nb_count, nb_pos, d2):
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
            chunk = (start + jbest) // NB_ALIGN
            for i in range(dim):
                Ls[dst, base + i] = (nb_pos[chunk, i, jbest % NB_ALIGN] - 1) // 2
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


@jit
def _lookup_groups(L, n_groups, dim, bits, kmap, grid_out):
    """The final grid index of each group from its levels; False where ggml would abort (off the grid)."""
    for k in range(n_groups):
        u = 0
        for i in range(dim):
            u |= L[k * dim + i] << (bits * i)
        g = kmap[u]
        if g < 0:
            return False
        grid_out[k] = g
    return True


@jit
def _sub_block(x, off, qw, use_qw, sigma2, n, dim, bits, kmaxq, base_q, step, n_steps, eps, qp_start,
               refine_all, weight, waux, xval, Ls, Lqp, on_grid, signs, grid_idx, d2, kmap, nb_start, nb_count,
               nb_pos):
    """Steps 1-6 of the module docstring of :mod:`quantkit.formats.iquants` for the n weights at x[off:].

    Returns (status, scale), status EMPTY for an all-zero sub-block (nothing stored).  On success signs holds
    the sign codes of its groups of 8 and grid_idx the grid index of its groups of dim.
    """
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
    mx = _max_of(xval, n)
    if mx < eps:
        return EMPTY, ZERO
    if qp_start:                                     # IQ2_XXS
        scale = make_qp_quants(n, kmaxq + 1, xval, Lqp, weight)
        denom = scale * F32(kmaxq)
        if denom <= ZERO:
            return EMPTY, ZERO
    else:
        denom = mx
        scale = mx / base_q
    Ls[0, :] = 0
    on_grid[0, :] = True
    status, scale = _search(xval, weight, waux, Ls, on_grid, n, dim, bits, kmaxq, base_q, step, n_steps, denom,
                            scale, refine_all, kmap, nb_start, nb_count, nb_pos, d2)
    if status != OK:
        return status, scale
    if scale != scale:
        return NAN_SCALE, scale
    if scale < ZERO:                                 # "should never happen": flip the signs of the first four
        scale = -scale
        for k in range(min(4, n // 8)):
            signs[k] = ~signs[k] & 127
    if not _lookup_groups(Ls[0], n // dim, dim, bits, kmap, grid_idx):
        return OFF_GRID, scale
    return OK, scale


@jit
def _scale_nibble(inv_d, scale):
    return max(0, min(_SCALE_NIBBLE_MAX, nearest_int(_HALF * (inv_d * scale - ONE))))


@jit
def _put_u32(out, pos, v):
    for b in range(4):
        out[pos + b] = (v >> (8 * b)) & 0xFF


# ------------------------------------------------------------------------------------------------- row kernels

@jit
def _encode_row(qtype, n, dim, bits, kmaxq, n_steps, x, qw, use_qw, y, kmap, nb_start, nb_count, nb_pos):
    """quantize_row_<qtype>_impl for one row into y (zeroed by the caller).  Returns a status code.

    n (weights per scale), dim (weights per grid point), bits (per level in a lattice code), kmaxq (levels)
    and n_steps (trials -n_steps..n_steps) are passed as literals, so that numba compiles one specialisation
    per type with them constant (and the loops over them unrolled and vectorised)."""
    if qtype == IQ2_XS:
        base_q, step, eps, sigma_mul, block_bytes = F32(5), _TENTH, GROUP_MAX_EPS, ONE, IQ2_XS_BYTES
    elif qtype == IQ3_XXS:
        base_q, step, eps, sigma_mul, block_bytes = F32(15), _FIFTH, _EPS_IQ3_XXS, _TWO, IQ3_XXS_BYTES
    else:
        base_q, step, eps, sigma_mul, block_bytes = F32(5), _TENTH, GROUP_MAX_EPS, ONE, IQ2_XXS_BYTES
    n_sub = QK_K // n
    weight = np.empty(n, np.float32)
    waux = np.empty(n, np.float32)
    xval = np.empty(n, np.float32)
    Ls = np.zeros((2, n), np.int64)
    Lqp = np.zeros(n, np.uint8)
    on_grid = np.ones((2, n // dim), np.bool_)
    signs = np.zeros(n // 8, np.int64)
    grid_idx = np.zeros(n // dim, np.int64)
    d2 = np.empty(-(-nb_count.max() // NB_ALIGN) * NB_ALIGN, np.float32)
    scales = np.zeros(n_sub, np.float32)
    words = np.zeros(n_sub, np.int64)               # IQ2_XXS / IQ3_XXS: sign codes (and later ls) per 32
    for ibl in range(x.shape[0] // QK_K):
        xo = QK_K * ibl
        yo = block_bytes * ibl
        sigma2 = sigma_mul * _sum_sq(x, xo, QK_K) / _FQK_K
        max_scale = ZERO
        words[:] = 0
        for ib in range(n_sub):
            status, scale = _sub_block(x, xo + n * ib, qw, use_qw, sigma2, n, dim, bits, kmaxq, base_q, step,
                                       n_steps, eps, qtype == IQ2_XXS, qtype == IQ2_XXS, weight, waux, xval,
                                       Ls, Lqp, on_grid, signs, grid_idx, d2, kmap, nb_start, nb_count, nb_pos)
            scales[ib] = scale
            if status == EMPTY:                      # no grid, signs or scale
                continue
            if status != OK:
                return status
            max_scale = max_scale if max_scale > scale else scale
            if qtype == IQ2_XS:
                for k in range(2):
                    put_u16(y, yo + 2 + 4 * ib + 2 * k, grid_idx[k] | (signs[k] << 9))
            else:
                for k in range(4):
                    words[ib] |= signs[k] << (7 * k)
                for k in range(n // dim):
                    y[yo + 2 + 8 * ib + k] = grid_idx[k]          # IQ2_XXS: 4 bytes, then its sign word
        if max_scale == ZERO:
            for b in range(block_bytes):
                y[yo + b] = 0
            continue
        d = max_scale / _SCALE_DIV
        put_u16(y, yo, fp32_to_fp16(d * _IQ3_D_FUDGE if qtype == IQ3_XXS else d))
        inv_d = ONE / d
        for ib in range(n_sub):
            ls = _scale_nibble(inv_d, scales[ib])
            if qtype == IQ2_XS:
                y[yo + 66 + ib // 2] |= ls << (4 * (ib % 2))
            elif qtype == IQ3_XXS:
                _put_u32(y, yo + 66 + 4 * ib, words[ib] | (ls << 28))
            else:
                _put_u32(y, yo + 6 + 8 * ib, words[ib] | (ls << 28))
    return OK


@jit
def encode_rows(qtype, x, qw, use_qw, out, status, kmap, nb_start, nb_count, nb_pos):
    """Encode every row of x (float32[rows, n]) as qtype into out; a part of the rows per thread.

    Each call works on its own copies of the tables, the importance vector, the input row and the output row:
    every call increments and decrements the reference counts of its array arguments, and atomics on counts
    shared by all threads would serialise them.
    """
    t_kmap = kmap.copy()
    t_start = nb_start.copy()
    t_count = nb_count.copy()
    t_pos = nb_pos.copy()
    t_qw = qw.copy()
    xr = np.empty(x.shape[1], np.float32)
    y = np.empty(out.shape[1], np.uint8)
    for r in range(x.shape[0]):
        xr[:] = x[r]
        y[:] = 0
        # (n, dim, bits, kmaxq, n_steps) per type, as in iquants._Variant and iq_tables
        if qtype == IQ2_XS:
            status[r] = _encode_row(IQ2_XS, 16, 8, 2, 3, 9, xr, t_qw, use_qw, y, t_kmap, t_start, t_count, t_pos)
        elif qtype == IQ3_XXS:
            status[r] = _encode_row(IQ3_XXS, 32, 4, 3, 8, 15, xr, t_qw, use_qw, y, t_kmap, t_start, t_count, t_pos)
        else:
            status[r] = _encode_row(IQ2_XXS, 32, 8, 2, 3, 6, xr, t_qw, use_qw, y, t_kmap, t_start, t_count, t_pos)
        out[r, :] = y
