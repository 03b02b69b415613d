"""numba building blocks of ggml's K-quant encoders, each a step-by-step mirror of ``ggml-quants.c``.

Exactness rules every function here follows (they are what byte-identity with ggml rests on):

* All arithmetic is IEEE float32 in ggml's operation order.  numba promotes ``float32 (op) int`` and
  ``float32 (op) python float`` to float64, so every integer that enters float arithmetic is converted with
  ``F32(...)`` first and every constant is a float32 global.  The ggml build we match (libggml-base of
  llama-cpp-python 0.3.36, x86-64 baseline SSE2) contains no fused multiply-add, and numba without fastmath
  does not contract either, so ``a*b + c`` rounds twice on both sides.
* ``nearest_int`` is ggml's magic-number rounding: add 1.5·2²³ in float32 and read the low mantissa bits,
  i.e. round half to even for |v| < 2²², and a deterministic wrap-around beyond.
* ggml's ``MAX``/``MIN`` macros are ``a > b ? a : b`` / ``a < b ? a : b``; they are written out where a NaN
  could reach them.  Stores into ``uint8_t``/``int8_t`` wrap modulo 256, mirrored with explicit masks.
* float32 → float16 is ggml's own bit algorithm (round to nearest even, NaN → 0x7E00 with the sign kept).
* ``error_model="numpy"``: a float division by zero gives inf/NaN like C instead of raising.

A float64 reaching ``nearest_int`` or ``fp32_to_fp16`` (a forgotten ``F32``) is a compile-time error
(:func:`require_float32`), not a silent double rounding.

numba's on-disk cache (``cache=True``) keys a kernel on its own source file only: after editing this module,
delete ``quantkit/kernels/__pycache__/*.nbi`` / ``*.nbc`` or the kernels that use it keep the old code.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import overload

F32 = np.float32

ZERO = F32(0.0)
ONE = F32(1.0)
ROUND_MAGIC = F32(12582912.0)       # 1.5 * 2**23: adding it leaves round-half-even(v) in the low mantissa bits
GROUP_MAX_EPS = F32(1e-15)          # ggml's "this group is all zero" threshold
_FP16_SCALE_TO_INF = F32(2.0 ** 112)
_FP16_SCALE_TO_ZERO = F32(2.0 ** -110)
_FP16_EXP_SCALE = F32(2.0 ** -112)
_HALF = F32(0.5)
NAN = F32(np.nan)

jit = njit(cache=True, error_model="numpy", nogil=True)


def require_float32(v):
    """Compile-time check inside numba code: ``v`` must be typed float32."""


@overload(require_float32)
def _require_float32_typing(v):
    if v != types.float32:
        raise TypingError(f"expected a float32 operand, got {v}: convert with F32() to keep ggml's rounding")
    return lambda v: None


@jit
def f32_from_bits(bits):
    return np.uint32(bits).view(np.float32)


@jit
def f32_bits(v):
    return np.int64(np.float32(v).view(np.uint32))


@jit
def nearest_int(v):
    """ggml's nearest_int for a float32 ``v``: round half to even via the 1.5·2²³ magic number."""
    require_float32(v)
    return (np.int64(np.float32(v + ROUND_MAGIC).view(np.int32)) & 0x007FFFFF) - 0x00400000


@jit
def as_int8(v):
    """C conversion of an int to ``int8_t`` (wraps modulo 256)."""
    return ((v + 128) & 0xFF) - 128


@jit
def fp32_to_fp16(f):
    """ggml_compute_fp32_to_fp16: float32 → IEEE half bits, round to nearest even."""
    require_float32(f)
    base = (abs(f) * _FP16_SCALE_TO_INF) * _FP16_SCALE_TO_ZERO
    w = f32_bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = f32_from_bits((bias >> 1) + 0x07800000) + base
    bits = f32_bits(base)
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    if shl1_w > 0xFF000000:
        nonsign = 0x7E00
    return ((sign >> 16) | nonsign) & 0xFFFF


@jit
def fp16_to_fp32(h):
    """ggml_compute_fp16_to_fp32: IEEE half bits → float32 (exact)."""
    w = np.int64(h) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    if two_w < (1 << 27):
        magnitude = f32_bits(f32_from_bits((two_w >> 17) | (126 << 23)) - _HALF)
    else:
        magnitude = f32_bits(f32_from_bits((two_w >> 4) + (0xE0 << 23)) * _FP16_EXP_SCALE)
    return f32_from_bits(sign | magnitude)


@jit
def get_u16(data, pos):
    return np.int64(data[pos]) | (np.int64(data[pos + 1]) << 8)


@jit
def put_u16(out, pos, h):
    out[pos] = h & 0xFF
    out[pos + 1] = (h >> 8) & 0xFF


# --------------------------------------------------------------------------------------------------------------
# Scale searches.  The *_lanes searches take sub-blocks as columns (x[i, k] = weight i of sub-block k) so that
# their inner loops run across sub-blocks; the others take one sub-block as a 1-D view.
# --------------------------------------------------------------------------------------------------------------

QX_STATE_ROWS = 7      # scratch rows make_qx_quants_lanes needs
QX_TRIALS = 9          # make_qx_quants tries iscale = -(nmax + 0.1*is)/max for is = -9..9 after is = 0


@jit
def make_qx_quants_lanes(nl, n, nmax, xt, wt, Lt, scale, st):
    """ggml make_qx_quants with rmse_type=1 on ``nl`` groups at once (group k = column k of ``xt[n, :]``).

    ``wt`` are the weights (x² where ggml is given NULL).  Symmetric quants Lt = l + nmax, l in
    [-nmax, nmax-1]; a group whose max |x| is below GROUP_MAX_EPS gets all-zero quants and scale 0.  Every
    inner loop runs over groups (SIMD), each group seeing ggml's float32 operations in ggml's order.
    ``st`` is scratch of ``QX_STATE_ROWS`` rows.
    """
    amax, mx, iscale, sumlx, suml2, best, q_iscale = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    fnmax = F32(nmax)
    for k in range(nl):
        amax[k] = ZERO
        mx[k] = ZERO
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            bigger = abs(v) > amax[k]
            amax[k] = abs(v) if bigger else amax[k]
            mx[k] = v if bigger else mx[k]
    for trial in range(2 * QX_TRIALS + 1):
        # trial 0 is ggml's starting point is = 0 (-(nmax + 0)/max == -nmax/max), then is = -9..-1, 1..9
        step = 0 if trial == 0 else (trial - 1 - QX_TRIALS if trial <= QX_TRIALS else trial - QX_TRIALS)
        numer = -(fnmax + F32(0.1) * F32(step))
        for k in range(nl):
            iscale[k] = numer / mx[k]
            sumlx[k] = ZERO
            suml2[k] = ZERO
        for i in range(n):
            for k in range(nl):
                v = xt[i, k]
                fl = F32(max(-nmax, min(nmax - 1, nearest_int(iscale[k] * v))))
                sumlx[k] += wt[i, k] * v * fl
                suml2[k] += wt[i, k] * fl * fl
        if trial == 0:
            for k in range(nl):
                scale[k] = sumlx[k] / suml2[k] if suml2[k] != ZERO else ZERO
                best[k] = scale[k] * sumlx[k]
                q_iscale[k] = iscale[k]
        else:
            for k in range(nl):
                if suml2[k] > ZERO and sumlx[k] * sumlx[k] > best[k] * suml2[k]:
                    scale[k] = sumlx[k] / suml2[k]
                    best[k] = scale[k] * sumlx[k]
                    q_iscale[k] = iscale[k]
    for k in range(nl):
        scale[k] = scale[k] if amax[k] >= GROUP_MAX_EPS else ZERO
    for i in range(n):
        for k in range(nl):
            l = nmax + max(-nmax, min(nmax - 1, nearest_int(q_iscale[k] * xt[i, k])))
            Lt[i, k] = l if amax[k] >= GROUP_MAX_EPS else 0


Q3_STATE_ROWS = 5      # scratch rows make_q3_quants_lanes needs
REFINE_PASSES = 5      # make_q3_quants and make_qp_quants move single quants for at most 5 passes


@jit
def make_q3_quants_lanes(nl, n, nmax, xt, Lt, scale, st):
    """ggml make_q3_quants with do_rmse=true on ``nl`` groups at once (group k = column k of ``xt[n, :]``).

    Starts from iscale = -nmax/max, then passes over the group moving single quants when that raises
    (Σwxl)²/Σwl² with w = x².  ggml stops a group after a pass that changed nothing; a further pass over such
    a group changes nothing either, so running all groups until none changes is the same.  Outputs quants
    ``Lt[i, k]`` = l + nmax (``Lt`` signed, all zero for a group below GROUP_MAX_EPS) and ``scale[k]``.
    """
    amax, mx, sumlx, suml2, iscale = st[0], st[1], st[2], st[3], st[4]
    fnmax = F32(nmax)
    for k in range(nl):
        amax[k] = ZERO
        mx[k] = ZERO
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            bigger = abs(v) > amax[k]
            amax[k] = abs(v) if bigger else amax[k]
            mx[k] = v if bigger else mx[k]
    for k in range(nl):
        iscale[k] = -fnmax / mx[k]
        sumlx[k] = ZERO
        suml2[k] = ZERO
    for i in range(n):
        for k in range(nl):
            v = xt[i, k]
            l = max(-nmax, min(nmax - 1, nearest_int(iscale[k] * v)))
            Lt[i, k] = l
            fl = F32(l)
            w = v * v
            sumlx[k] += w * v * fl
            suml2[k] += w * fl * fl
    for _ in range(REFINE_PASSES):
        n_changed = 0
        for i in range(n):
            for k in range(nl):
                v = xt[i, k]
                w = v * v
                li = np.int64(Lt[i, k])
                fli = F32(li)
                slx = sumlx[k] - w * v * fli
                sl2 = suml2[k] - w * fli * fli
                new_l = max(-nmax, min(nmax - 1, nearest_int(v * sl2 / slx)))
                fnl = F32(new_l)
                new_slx = slx + w * v * fnl
                new_sl2 = sl2 + w * fnl * fnl
                if (slx > ZERO and new_l != li and new_sl2 > ZERO
                        and new_slx * new_slx * suml2[k] > sumlx[k] * sumlx[k] * new_sl2):
                    Lt[i, k] = new_l
                    sumlx[k] = new_slx
                    suml2[k] = new_sl2
                    n_changed += 1
        if n_changed == 0:
            break
    for k in range(nl):
        live = amax[k] >= GROUP_MAX_EPS
        scale[k] = (sumlx[k] / suml2[k] if suml2[k] > ZERO else ZERO) if live else ZERO
        amax[k] = ONE if live else ZERO
    for i in range(n):
        for k in range(nl):
            Lt[i, k] = Lt[i, k] + nmax if amax[k] == ONE else 0


QKX_STATE_ROWS = 15  # scratch rows make_qkx_quants_lanes needs


@jit
def make_qkx_quants_lanes(nl, n, nmax, xt, wt, Lt, rmin, rdelta, nstep, use_mad, scale, the_min, st):
    """make_qkx2_quants / make_qkx3_quants on ``nl`` sub-blocks at once (identical for finite x).

    Sub-block k is column k of ``xt[n, :]`` (weights ``wt``), so every inner loop runs over sub-blocks and
    vectorizes, while each sub-block still sees ggml's exact sequence of float32 operations: a trial scale
    that wins moves that sub-block's min, which changes the later trials, so trials cannot be batched, but
    sub-blocks can.  Outputs: quants ``Lt[n, k]`` in [0, nmax], ``scale[k]``, ``the_min[k]`` (ggml's
    ``*the_min``, i.e. minus the fitted offset).  ``st`` is scratch of ``QKX_STATE_ROWS`` rows.
    """
    mn, mx, sum_w, sum_x, iscale = st[0], st[1], st[2], st[3], st[4]
    sum_l, sum_l2, sum_xl, t_scale, t_min = st[5], st[6], st[7], st[8], st[9]
    err, best_err, q_iscale, q_min, active = st[10], st[11], st[12], st[13], st[14]
    fnmax = F32(nmax)
    for k in range(nl):
        mn[k] = xt[0, k]
        mx[k] = xt[0, k]
        sum_w[k] = wt[0, k]
        sum_x[k] = sum_w[k] * xt[0, k]
    for i in range(1, n):
        for k in range(nl):
            v = xt[i, k]
            mn[k] = v if v < mn[k] else mn[k]
            mx[k] = v if v > mx[k] else mx[k]
            sum_w[k] += wt[i, k]
            sum_x[k] += wt[i, k] * v
    for k in range(nl):
        mn[k] = ZERO if mn[k] > ZERO else mn[k]
        iscale[k] = fnmax / (mx[k] - mn[k])
        scale[k] = ONE / iscale[k]
        q_iscale[k] = iscale[k]
        q_min[k] = mn[k]
        best_err[k] = ZERO
    for i in range(n):
        for k in range(nl):
            fl = F32(max(0, min(nmax, nearest_int(iscale[k] * (xt[i, k] - mn[k])))))
            diff = scale[k] * fl + mn[k] - xt[i, k]
            diff = abs(diff) if use_mad else diff * diff
            best_err[k] += wt[i, k] * diff
    for k in range(nl):
        # ggml returns at once for a sub-block with max == min: no trial may win there, and its quants are 0.
        active[k] = ONE if mx[k] > mn[k] else ZERO
        scale[k] = scale[k] if mx[k] > mn[k] else ZERO
        q_iscale[k] = q_iscale[k] if mx[k] > mn[k] else ZERO
    for step in range(nstep + 1):
        numer = rmin + rdelta * F32(step) + fnmax
        for k in range(nl):
            iscale[k] = numer / (mx[k] - mn[k])
            sum_l[k] = ZERO
            sum_l2[k] = ZERO
            sum_xl[k] = ZERO
            err[k] = ZERO
        for i in range(n):
            for k in range(nl):
                v = xt[i, k]
                fl = F32(max(0, min(nmax, nearest_int(iscale[k] * (v - mn[k])))))
                wl = wt[i, k] * fl
                sum_l[k] += wl
                sum_l2[k] += wl * fl
                sum_xl[k] += wl * v
        for k in range(nl):
            D = sum_w[k] * sum_l2[k] - sum_l[k] * sum_l[k]
            sc = (sum_w[k] * sum_xl[k] - sum_x[k] * sum_l[k]) / D
            m = (sum_l2[k] * sum_x[k] - sum_l[k] * sum_xl[k]) / D
            pos = m > ZERO
            t_scale[k] = sum_xl[k] / sum_l2[k] if pos else sc
            t_min[k] = ZERO if pos else m
            err[k] = ZERO if D > ZERO else NAN  # ggml skips a trial with D <= 0: NaN never wins
        for i in range(n):
            for k in range(nl):
                v = xt[i, k]
                fl = F32(max(0, min(nmax, nearest_int(iscale[k] * (v - mn[k])))))
                diff = t_scale[k] * fl + t_min[k] - v
                diff = abs(diff) if use_mad else diff * diff
                err[k] += wt[i, k] * diff
        for k in range(nl):
            if err[k] < best_err[k] and active[k] == ONE:
                best_err[k] = err[k]
                scale[k] = t_scale[k]
                q_iscale[k] = iscale[k]
                q_min[k] = mn[k]
                mn[k] = t_min[k]
    for k in range(nl):
        the_min[k] = -mn[k]
    for i in range(n):
        for k in range(nl):
            Lt[i, k] = max(0, min(nmax, nearest_int(q_iscale[k] * (xt[i, k] - q_min[k]))))


@jit
def make_qp_quants(n, nmax, x, L, qw):
    """make_qp_quants: non-negative quants L[i] in [0, nmax] of non-negative x (the sub-block scales/mins)."""
    mx = ZERO
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return ZERO
    fnmax = F32(nmax)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = ONE / iscale
    best_mse = ZERO
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = ONE / iscale_is
        mse = ZERO
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = F32(l)
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for _ in range(REFINE_PASSES):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fli = F32(L[i])
            slx = sumlx - w * x[i] * fli
            sl2 = suml2 - w * fli * fli
            if slx > ZERO and sl2 > ZERO:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > ZERO else ZERO
