"""K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): block layouts, ggml's two encoders, and decoders.

Every K-quant block covers ``QK_K = 256`` weights of one row, cut into sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or
32 (Q4_K, Q5_K) weights.  Each sub-block has its own small integer scale (and, for the "a·q − b" types, an
integer min); one or two f16 super-block factors turn those integers into floats.  All multi-byte fields are
little-endian; ``ggml_half`` is IEEE binary16.

Layouts (byte offsets inside one block; ``L[i]`` is the quant of weight i of the block)::

  Q2_K  84 B  x = d·(sc&15)·q − dmin·(sc>>4),  q in 0..3
        [0:16)   scales: byte j = sub-block j's 4-bit scale (low nibble) | 4-bit min (high nibble)
        [16:80)  qs: 2 chunks of 128 weights; byte 32c+l holds L[128c+l+32k] in bits 2k..2k+1 (k = 0..3)
        [80:82)  d      [82:84) dmin
  Q3_K  110 B x = d·(s−32)·(q−4),  q in 0..7 (3 bits = 2 low bits in qs + 1 high bit in hmask)
        [0:32)   hmask: bit k of byte l is the high bit of L[32k+l]
        [32:96)  qs: low 2 bits, same order as Q2_K
        [96:108) scales: 16 six-bit s; low nibbles: s_j in byte j (j<8) or byte j−8 high nibble (j≥8);
                 high 2 bits of s_j in byte 8 + j%4 at bit 2·(j//4)
        [108:110) d
  Q4_K  144 B x = d·sc·q − dmin·m,  q in 0..15
        [0:2) d  [2:4) dmin
        [4:16)   scales: 8 six-bit (sc, m) pairs: j<4: byte j = sc_j | (sc_{j+4}>>4)<<6,
                 byte j+4 = m_j | (m_{j+4}>>4)<<6; j≥4: byte j+4 = (sc_j&15) | (m_j&15)<<4
        [16:144) qs: 4 chunks of 64 weights; byte 32c+l = L[64c+l] | L[64c+32+l]<<4
  Q5_K  176 B like Q4_K with q in 0..31: [16:48) qh: bit 2c of byte l = high bit of L[64c+l],
        bit 2c+1 = high bit of L[64c+32+l]; [48:176) low nibbles as Q4_K's qs
  Q6_K  210 B x = d·sc·(q−32),  q in 0..63, sc int8
        [0:128)  ql: 2 chunks of 128; byte 64c+l = low4(L[128c+l]) | low4(L[128c+64+l])<<4,
                 byte 64c+32+l = low4(L[128c+32+l]) | low4(L[128c+96+l])<<4
        [128:192) qh: byte 32c+l holds the high 2 bits of L[128c+l+32k] at bits 2k..2k+1
        [192:208) scales (int8)   [208:210) d

Encoding: ``ggml_quantize_chunk`` → ``quantize_<t>`` runs ``quantize_row_<t>_ref`` when no importance matrix
is given and ``quantize_row_<t>_impl`` (row by row, the same per-column imatrix for every row) with one: a
*different* algorithm, not the same one with weights 1.  (The ``quant_weights == NULL`` branches inside the
``_impl`` functions are never reached from there.)

* ``_ref``: per sub-block, a scale (and min) search — ``make_qkx2_quants`` (Q2_K: weights |x|, mean absolute
  error; Q4_K/Q5_K: weights sqrt(mean x²)+|x|, squared error), ``make_q3_quants`` (Q3_K),
  ``make_qx_quants`` (Q6_K, weights x²) — then the sub-block scales are quantized linearly against their
  maximum (Q2_K: 4 bits, max/15; Q4_K/Q5_K: 6 bits, max/63; Q3_K: signed 6 bits, -max/32; Q6_K: int8,
  -max/128).
* ``_impl``: weights ``imatrix[i] · sqrt(σ² + x[i]²)`` with σ² = Σx²/256 (Q2_K) or 2·Σx²/256 (Q3_K, Q4_K,
  Q5_K); Q6_K uses the imatrix itself as the weights.  The scale search is ``make_qkx3_quants`` (Q2_K,
  Q4_K, Q5_K) or ``make_qx_quants`` (Q3_K, Q6_K), and the sub-block scales/mins are quantized by
  ``make_qp_quants`` (Q2_K, Q4_K, Q5_K; weighted by each sub-block's weight sum) or ``make_qx_quants``
  (Q3_K), not by max/… .
* Both paths then store d (and dmin) as f16 **first** and re-quantize every weight of a sub-block with the
  f16-rounded ``d·scale`` (and ``dmin·min``): ``q = nearest_int((x + dmin·m) / (d·sc))`` clamped.  A sub-block
  whose ``d·scale`` is 0 keeps the quants its search produced.

Exact rounding (what byte-identity with ggml rests on):

* Everything is float32 in ggml's operation order; every accumulation is a sequential float32 sum (no
  pairwise summation, no fused multiply-add — the libggml-base we match is built for baseline x86-64).
* ``nearest_int(v)`` = low mantissa bits of ``v + 1.5·2²³`` in float32: round half to even for |v| < 2²².
* float32 → f16 rounds to nearest even.  Integer stores into ``uint8_t``/``int8_t`` wrap modulo 256.
* ``GROUP_MAX_EPS = 1e-15``: a group whose largest |x| (or scale) is below it is treated as all zero.

This module holds the readable reference (numpy, one block at a time, written after the C step by step) and
the decoders; :mod:`quantkit.kernels.kquants_numba` holds the fast encoders that tests prove byte-identical
to both this reference and ggml.
"""
from __future__ import annotations

import functools

import numpy as np

from ._ggml_numpy import as_int8, f16_bits, nearest_int
from .registry import GGMLType, ImatrixUse, QuantFormat

QK_K = 256

# Block fields as (name, byte offset, byte length), in storage order (ggml-common.h).
BLOCK_FIELDS: dict[GGMLType, tuple[tuple[str, int, int], ...]] = {
    GGMLType.Q2_K: (("scales", 0, 16), ("qs", 16, 64), ("d", 80, 2), ("dmin", 82, 2)),
    GGMLType.Q3_K: (("hmask", 0, 32), ("qs", 32, 64), ("scales", 96, 12), ("d", 108, 2)),
    GGMLType.Q4_K: (("d", 0, 2), ("dmin", 2, 2), ("scales", 4, 12), ("qs", 16, 128)),
    GGMLType.Q5_K: (("d", 0, 2), ("dmin", 2, 2), ("scales", 4, 12), ("qh", 16, 32), ("qs", 48, 128)),
    GGMLType.Q6_K: (("ql", 0, 128), ("qh", 128, 64), ("scales", 192, 16), ("d", 208, 2)),
}


def field_offsets(qtype: GGMLType) -> dict[str, int]:
    """{field name: byte offset inside the block}."""
    return {name: off for name, off, _ in BLOCK_FIELDS[qtype]}


def block_bytes(qtype: GGMLType) -> int:
    """Bytes per block: the end of the last field (the registry test checks it against gguf-py's sizes)."""
    _, off, size = BLOCK_FIELDS[qtype][-1]
    return off + size


def _field(blocks: np.ndarray, qtype: GGMLType, name: str) -> np.ndarray:
    """Column slice of field ``name`` of every block in ``blocks[n, type_size]``."""
    off, size = {field: (o, s) for field, o, s in BLOCK_FIELDS[qtype]}[name]
    return blocks[:, off:off + size]


GROUP_MAX_EPS = np.float32(1e-15)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


# ------------------------------------------------------------------------------------------------ primitives

def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _seqsum(terms) -> np.float32:
    """``float s = 0; for (...) s += term;`` — a sequential float32 sum (numpy's sum is pairwise)."""
    return np.add.accumulate(np.concatenate([[_F0], _f32(terms)]))[-1]


def _seqsum_from_first(terms) -> np.float32:
    """``float s = t[0]; for (i = 1; ...) s += t[i];``."""
    return np.add.accumulate(_f32(terms))[-1]


def _fp16(v) -> tuple[np.float32, np.ndarray]:
    """GGML_FP32_TO_FP16 then GGML_FP16_TO_FP32: (the value read back, the 2 stored bytes)."""
    stored = f16_bits(np.array([v], np.float32))[0]
    return np.float32(stored.view(np.float16)[0]), stored


def _clip(l, lo, hi) -> np.ndarray:
    """MAX(lo, MIN(hi, l)) on integers."""
    return np.maximum(lo, np.minimum(hi, l))


def _first_absmax(v) -> tuple[np.float32, np.float32]:
    """``amax = 0; for (...) if (|v| > amax) { amax = |v|; max = v; }`` → (amax, max); NaN never wins."""
    amax = mx = _F0
    for value in _f32(v):
        if abs(value) > amax:
            amax, mx = abs(value), value
    return amax, mx


def _err(diff, use_mad):
    return np.abs(diff) if use_mad else diff * diff


# ------------------------------------------------------------------------------------------------ searches

def make_qx_quants(x, nmax: int, w) -> tuple[np.ndarray, np.float32]:
    """ggml make_qx_quants, rmse_type = 1 (``w`` = the weights; x² where ggml is given NULL).

    Symmetric: L = l + nmax, l in [-nmax, nmax-1]; tries iscale = -(nmax + 0.1·is)/max for is = -9..9 and
    keeps a trial when it raises (Σwxl)²/Σwl².  Returns (L, scale).
    """
    x, w = _f32(x), _f32(w)
    amax, mx = _first_absmax(x)
    if amax < GROUP_MAX_EPS:
        return np.zeros(len(x), np.int64), _F0

    def trial(iscale):
        l = _clip(nearest_int(iscale * x), -nmax, nmax - 1)
        fl = _f32(l)
        return l, _seqsum(w * x * fl), _seqsum(w * fl * fl)

    iscale = np.float32(-nmax) / mx
    l, sumlx, suml2 = trial(iscale)
    L = l + nmax
    scale = sumlx / suml2 if suml2 != 0 else _F0
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx
        l, sumlx, suml2 = trial(iscale)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L = l + nmax
            scale = sumlx / suml2
            best = scale * sumlx
    return L, scale


def make_q3_quants(x, nmax: int) -> tuple[np.ndarray, np.float32]:
    """ggml make_q3_quants with do_rmse: start from -nmax/max, then up to 5 passes that move single quants
    when that raises (Σwxl)²/Σwl² (w = x²).  Returns (L = l + nmax, scale)."""
    x = _f32(x)
    n = len(x)
    amax, mx = _first_absmax(x)
    if amax < GROUP_MAX_EPS:
        return np.zeros(n, np.int64), _F0
    iscale = np.float32(-nmax) / mx
    L = [int(v) for v in _clip(nearest_int(iscale * x), -nmax, nmax - 1)]
    w = x * x
    sumlx = _seqsum(w * x * _f32(L))
    suml2 = _seqsum(w * _f32(L) * _f32(L))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            li = np.float32(L[i])
            slx = sumlx - w[i] * x[i] * li
            if slx > 0:
                sl2 = suml2 - w[i] * li * li
                new_l = int(_clip(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1))
                if new_l != L[i]:
                    slx = slx + w[i] * x[i] * np.float32(new_l)
                    sl2 = sl2 + w[i] * np.float32(new_l) * np.float32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i], sumlx, suml2 = new_l, slx, sl2
                        n_changed += 1
        if not n_changed:
            break
    scale = sumlx / suml2 if suml2 > 0 else _F0
    return np.array(L, np.int64) + nmax, scale


def make_qkx_quants(x, w, nmax: int, rmin, rdelta, nstep: int, use_mad: bool):
    """ggml make_qkx2_quants (``_ref`` paths) / make_qkx3_quants (``_impl`` paths), which agree for finite x.

    Asymmetric: x ≈ scale·L − the_min with L in [0, nmax].  Starts from the full range [min(x,0), max x],
    then tries iscale = (rmin + rdelta·is + nmax)/(max − min) for is = 0..nstep, fitting scale and min by
    weighted least squares; a trial that lowers the weighted error (|diff| if use_mad, else diff²) is kept,
    and its min is the one later trials measure from.  Returns (L, scale, the_min).
    """
    x, w = _f32(x), _f32(w)
    mn = x[int(np.argmin(x))]
    mx = x[int(np.argmax(x))]
    sum_w = _seqsum_from_first(w)
    sum_x = _seqsum_from_first(w * x)
    if mn > 0:
        mn = _F0
    if mx == mn:
        return np.zeros(len(x), np.int64), _F0, -mn
    iscale = np.float32(nmax) / (mx - mn)
    scale = _F1 / iscale
    L = _clip(nearest_int(iscale * (x - mn)), 0, nmax)
    best_error = _seqsum(w * _err(scale * _f32(L) + mn - x, use_mad))
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + np.float32(nmax)) / (mx - mn)
        laux = _clip(nearest_int(iscale * (x - mn)), 0, nmax)
        fl = _f32(laux)
        sum_l = _seqsum(w * fl)
        sum_l2 = _seqsum(w * fl * fl)
        sum_xl = _seqsum(w * fl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = _F0
                this_scale = sum_xl / sum_l2
            cur_error = _seqsum(w * _err(this_scale * fl + this_min - x, use_mad))
            if cur_error < best_error:
                L, best_error, scale, mn = laux, cur_error, this_scale, this_min
    return L, scale, -mn


def make_qp_quants(x, nmax: int, qw) -> tuple[np.ndarray, np.float32]:
    """ggml make_qp_quants: non-negative quants (≤ nmax) of the sub-block scales or mins ``x`` weighted by
    ``qw``; tries iscale = (nmax + 0.1·is)/max for is = -4..4 by weighted squared error, then refines single
    quants as make_q3_quants does.  Quants are stored as uint8 (a negative one wraps).  Returns (L, scale)."""
    x, qw = _f32(x), _f32(qw)
    n = len(x)
    mx = _F0
    for v in x:
        mx = mx if mx > v else v                 # MAX(max, x[i])
    if mx < GROUP_MAX_EPS:
        return np.zeros(n, np.int64), _F0
    iscale = np.float32(nmax) / mx
    L = nearest_int(iscale * x) & 0xFF
    scale = _F1 / iscale
    diff = x - scale * _f32(L)
    best_mse = _seqsum(qw * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (np.float32(0.1) * np.float32(step) + np.float32(nmax)) / mx
        scale_is = _F1 / iscale_is
        l = np.minimum(nmax, nearest_int(iscale_is * x))
        diff = x - scale_is * _f32(l)
        mse = _seqsum(qw * diff * diff)
        if mse < best_mse:
            best_mse, iscale = mse, iscale_is
    l = np.minimum(nmax, nearest_int(iscale * x))
    L = [int(v) & 0xFF for v in l]
    sumlx = _seqsum(qw * x * _f32(l))
    suml2 = _seqsum(qw * _f32(l) * _f32(l))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            li = np.float32(L[i])
            slx = sumlx - qw[i] * x[i] * li
            sl2 = suml2 - qw[i] * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, int(nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx = slx + qw[i] * x[i] * np.float32(new_l)
                    sl2 = sl2 + qw[i] * np.float32(new_l) * np.float32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i], sumlx, suml2 = new_l & 0xFF, slx, sl2
                        n_changed += 1
        if not n_changed:
            break
    return np.array(L, np.int64), (sumlx / suml2 if suml2 > 0 else _F0)


def _imatrix_weights(x, qw, sigma2):
    """ggml's importance weighting: qw[i] · sqrt(σ² + x[i]²)."""
    return _f32(qw) * np.sqrt(sigma2 + x * x)


# ------------------------------------------------------------------------------------------------ packing

def _pack_2bit(L) -> np.ndarray:
    """Q2_K/Q3_K qs: per chunk of 128, byte l holds L[l], L[l+32], L[l+64], L[l+96] at bits 0, 2, 4, 6."""
    q = np.asarray(L, np.int64).reshape(2, 4, 32)
    return ((q[:, 0] | q[:, 1] << 2 | q[:, 2] << 4 | q[:, 3] << 6) & 0xFF).reshape(-1)


def _pack_k4_scales(ls, lm) -> np.ndarray:
    """Q4_K/Q5_K 12 scale bytes from 8 scales and 8 mins (stores into uint8 wrap, as in C)."""
    out = [0] * 12
    for j in range(8):
        sc, m = int(ls[j]), int(lm[j])
        if j < 4:
            out[j] = sc & 0xFF
            out[j + 4] = m & 0xFF
        else:
            out[j + 4] = ((sc & 0xF) | ((m & 0xF) << 4)) & 0xFF
            out[j - 4] = (out[j - 4] | ((sc >> 4) << 6)) & 0xFF
            out[j] = (out[j] | ((m >> 4) << 6)) & 0xFF
    return np.array(out, np.uint8)


def _unpack_k4_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for j = 0..7 on 12 scale bytes (any leading block axes)."""
    b = np.asarray(b, np.int64)
    lo, hi, mix = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 0xF) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _pack_q3_scales(l6) -> np.ndarray:
    """Q3_K 12 scale bytes from 16 six-bit values."""
    out = [0] * 12
    for j in range(16):
        l = int(l6[j])
        if j < 8:
            out[j] = l & 0xF
        else:
            out[j - 8] = (out[j - 8] | ((l & 0xF) << 4)) & 0xFF
        l >>= 4
        out[8 + j % 4] = (out[8 + j % 4] | (l << (2 * (j // 4)))) & 0xFF
    return np.array(out, np.uint8)


def _unpack_q3_scales(b) -> np.ndarray:
    """16 signed scales (s − 32) from Q3_K's 12 scale bytes (any leading block axes)."""
    b = np.asarray(b, np.int64)
    j = np.arange(16)
    low = np.where(j < 8, b[..., j % 8] & 0xF, b[..., j % 8] >> 4)
    high = (b[..., 8 + j % 4] >> (2 * (j // 4))) & 3
    return as_int8((low | (high << 4)) - 32)


# ------------------------------------------------------------------------------------------------ encoders

def _requantize(x, d, dmin, sub, nmin, nmax, L):
    """The final pass both ggml paths share: per sub-block with d[j] != 0,
    L = clamp(nearest_int((x + dmin[j]) / d[j]), nmin, nmax) − nmin; the symmetric types pass dmin=None
    (ggml computes x / d there, not (x + 0) / d)."""
    L = np.array(L, np.int64)
    for j in range(QK_K // sub):
        if d[j] == 0:
            continue                                  # keeps the quants of the scale search
        xs = x[sub * j:sub * (j + 1)]
        l = nearest_int((xs + dmin[j]) / d[j]) if dmin is not None else nearest_int(xs / d[j])
        L[sub * j:sub * (j + 1)] = _clip(l, nmin, nmax) - nmin
    return L


def _q2_k_block(x, qw):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    if qw is None:                                  # quantize_row_q2_K_ref
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            L[16 * j:16 * j + 16], scales[j], mins[j] = make_qkx_quants(
                xs, np.abs(xs), 3, np.float32(-0.5), np.float32(0.1), 15, True)
        max_scale = max_min = _F0
        for j in range(16):
            max_scale = scales[j] if scales[j] > max_scale else max_scale
            max_min = mins[j] if mins[j] > max_min else max_min
        sc = np.zeros(16, np.int64)
        if max_scale > 0:
            sc = nearest_int((np.float32(15) / max_scale) * scales) & 0xFF
            d, d_bytes = _fp16(max_scale / np.float32(15))
        else:
            d, d_bytes = _fp16(_F0)
        if max_min > 0:
            sc = (sc | (nearest_int((np.float32(15) / max_min) * mins) << 4)) & 0xFF
            dmin, dmin_bytes = _fp16(max_min / np.float32(15))
        else:
            dmin, dmin_bytes = _fp16(_F0)
    else:                                           # quantize_row_q2_K_impl
        sigma2 = _seqsum(x * x) / np.float32(QK_K)
        sw = np.zeros(16, np.float32)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            w = _imatrix_weights(xs, qw[16 * j:16 * j + 16], sigma2)
            sw[j] = _seqsum(w)
            L[16 * j:16 * j + 16], scales[j], mins[j] = make_qkx_quants(
                xs, w, 3, np.float32(-0.9), np.float32(0.05), 36, False)
        Ls, dm = make_qp_quants(scales, 15, sw)
        Lm, mm = make_qp_quants(mins, 15, sw)
        d, d_bytes = _fp16(dm)
        dmin, dmin_bytes = _fp16(mm)
        sc = (Ls | (Lm << 4)) & 0xFF
    L = _requantize(x, d * _f32(sc & 0xF), dmin * _f32(sc >> 4), 16, 0, 3, L)
    return np.concatenate([sc.astype(np.uint8), _pack_2bit(L), d_bytes, dmin_bytes])


def _q3_k_block(x, qw):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    if qw is None:                                  # quantize_row_q3_K_ref
        for j in range(16):
            L[16 * j:16 * j + 16], scales[j] = make_q3_quants(x[16 * j:16 * j + 16], 4)
        _, max_scale = _first_absmax(scales)
        l6 = np.zeros(16, np.int64)
        if max_scale != 0:
            iscale = np.float32(-32) / max_scale
            l = as_int8(nearest_int(iscale * scales))      # int8_t l = nearest_int(...)
            l6 = _clip(l, -32, 31) + 32
            d, d_bytes = _fp16(_F1 / iscale)
        else:
            d, d_bytes = _fp16(_F0)
    else:                                           # quantize_row_q3_K_impl
        sigma2 = np.float32(2) * _seqsum(x * x) / np.float32(QK_K)
        sw = np.zeros(16, np.float32)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            w = _imatrix_weights(xs, qw[16 * j:16 * j + 16], sigma2)
            sw[j] = _seqsum(w)
            L[16 * j:16 * j + 16], scales[j] = make_qx_quants(xs, 4, w)
        l6, d_block = make_qx_quants(scales, 32, sw)
        d, d_bytes = _fp16(d_block)
    packed_scales = _pack_q3_scales(l6)
    L = _requantize(x, d * _f32(_unpack_q3_scales(packed_scales)), None, 16, -4, 3, L)
    hmask = np.zeros(32, np.int64)
    for k in range(8):
        hmask |= (L[32 * k:32 * k + 32] > 3).astype(np.int64) << k
    return np.concatenate([hmask.astype(np.uint8), _pack_2bit(L & 3), packed_scales, d_bytes])


def _k4_block(x, qw, nmax):
    """Q4_K (nmax = 15) and Q5_K (nmax = 31)."""
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(8, np.float32)
    mins = np.zeros(8, np.float32)
    if qw is None:                                  # quantize_row_q4_K_ref / q5_K_ref
        rmin, nstep = (np.float32(-1.0), 20) if nmax == 15 else (np.float32(-0.5), 15)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            av_x = np.sqrt(_seqsum(xs * xs) / np.float32(32))
            L[32 * j:32 * j + 32], scales[j], mins[j] = make_qkx_quants(
                xs, av_x + np.abs(xs), nmax, rmin, np.float32(0.1), nstep, False)
        max_scale = max_min = _F0
        for j in range(8):
            max_scale = scales[j] if scales[j] > max_scale else max_scale
            max_min = mins[j] if mins[j] > max_min else max_min
        inv_scale = np.float32(63) / max_scale if max_scale > 0 else _F0
        inv_min = np.float32(63) / max_min if max_min > 0 else _F0
        ls = np.minimum(63, nearest_int(inv_scale * scales) & 0xFF)
        lm = np.minimum(63, nearest_int(inv_min * mins) & 0xFF)
        d_val, m_val = max_scale / np.float32(63), max_min / np.float32(63)
    else:                                           # quantize_row_q4_K_impl / q5_K_impl
        sigma2 = np.float32(2) * _seqsum(x * x) / np.float32(QK_K)
        sw = np.zeros(8, np.float32)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            w = _imatrix_weights(xs, qw[32 * j:32 * j + 32], sigma2)
            sw[j] = _seqsum(w)
            L[32 * j:32 * j + 32], scales[j], mins[j] = make_qkx_quants(
                xs, w, nmax, np.float32(-0.9), np.float32(0.05), 36, False)
        ls, d_val = make_qp_quants(scales, 63, sw)
        lm, m_val = make_qp_quants(mins, 63, sw)
        if nmax == 31:                              # only q5_K_impl clamps
            ls, lm = np.minimum(63, ls), np.minimum(63, lm)
    packed = _pack_k4_scales(ls, lm)
    d, d_bytes = _fp16(d_val)
    dmin, dmin_bytes = _fp16(m_val)
    sc, m = _unpack_k4_scales(packed)
    L = _requantize(x, d * _f32(sc), dmin * _f32(m), 32, 0, nmax, L)
    q = L.reshape(4, 2, 32)
    qs = ((q[:, 0] & 0xF) | ((q[:, 1] & 0xF) << 4)).reshape(-1)
    head = np.concatenate([d_bytes, dmin_bytes, packed]).astype(np.uint8)
    if nmax == 15:
        return np.concatenate([head, qs.astype(np.uint8)])
    qh = np.zeros(32, np.int64)
    for c in range(4):
        qh |= (q[c, 0] >> 4) << (2 * c) | (q[c, 1] >> 4) << (2 * c + 1)
    return np.concatenate([head, qh.astype(np.uint8), qs.astype(np.uint8)])


def _q6_k_block(x, qw):
    L = np.zeros(QK_K, np.int64)
    scales = np.zeros(16, np.float32)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        w = xs * xs if qw is None else qw[16 * j:16 * j + 16]     # _impl passes the imatrix itself
        L[16 * j:16 * j + 16], scales[j] = make_qx_quants(xs, 32, w)
    max_abs_scale, max_scale = _first_absmax(scales)
    if max_abs_scale < GROUP_MAX_EPS:
        return np.zeros(block_bytes(GGMLType.Q6_K), np.uint8)
    iscale = np.float32(-128) / max_scale
    d, d_bytes = _fp16(_F1 / iscale)
    sc = as_int8(np.minimum(127, nearest_int(iscale * scales)))   # stored as int8
    L = _requantize(x, d * _f32(sc), None, 16, -32, 31, L)
    q = L.reshape(2, 4, 32)
    ql = np.concatenate([(q[:, 0] & 0xF) | (q[:, 2] & 0xF) << 4, (q[:, 1] & 0xF) | (q[:, 3] & 0xF) << 4], axis=1)
    qh = q[:, 0] >> 4 | (q[:, 1] >> 4) << 2 | (q[:, 2] >> 4) << 4 | (q[:, 3] >> 4) << 6
    return np.concatenate([ql.reshape(-1), qh.reshape(-1), sc & 0xFF, d_bytes]).astype(np.uint8)


def _reference_encoder(qtype: GGMLType, block_fn):
    size = block_bytes(qtype)

    def encode(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        qw = None if imatrix is None else np.asarray(imatrix, np.float32)
        out = np.zeros((x.shape[0], (x.shape[1] // QK_K) * size), np.uint8)
        with np.errstate(all="ignore"):              # C float semantics: x/0 = inf, 0/0 = NaN, overflow = inf
            for r in range(x.shape[0]):
                for b in range(x.shape[1] // QK_K):
                    cols = slice(b * QK_K, (b + 1) * QK_K)
                    out[r, b * size:(b + 1) * size] = block_fn(x[r, cols], None if qw is None else qw[cols])
        return out
    encode.__name__ = encode.__qualname__ = f"encode_{qtype.name.lower()}_reference"
    return encode


# ------------------------------------------------------------------------------------------------ decoders

def _quiet_floats(fn):
    """Run under C float semantics: inf/NaN from garbage blocks are results, not warnings."""
    @functools.wraps(fn)
    def wrapper(*args):
        with np.errstate(all="ignore"):
            return fn(*args)
    return wrapper


def _half(blocks, qtype, name):
    return np.ascontiguousarray(_field(blocks, qtype, name)).view(np.float16).astype(np.float32)   # [n, 1]


@_quiet_floats
def decode_q2_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q2_K: y = (d·(sc&15))·q − dmin·(sc>>4)."""
    n = blocks.shape[0]
    t = GGMLType.Q2_K
    sc = _field(blocks, t, "scales").astype(np.int64)
    d, dmin = _half(blocks, t, "d"), _half(blocks, t, "dmin")
    dl = (d * _f32(sc & 0xF))[:, :, None]
    ml = (dmin * _f32(sc >> 4))[:, :, None]
    qs = _field(blocks, t, "qs").astype(np.int64).reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1)
    q = _f32((qs & 3).reshape(n, 16, 16))
    return (dl * q - ml).reshape(n, QK_K)


@_quiet_floats
def decode_q3_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q3_K: y = (d·s)·(q − (high bit set ? 0 : 4))."""
    n = blocks.shape[0]
    t = GGMLType.Q3_K
    hm = _field(blocks, t, "hmask").astype(np.int64)
    qs = _field(blocks, t, "qs").astype(np.int64).reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1)
    low = (qs & 3).reshape(n, 8, 32)
    high = (hm[:, None, :] >> np.arange(8).reshape(1, 8, 1)) & 1
    q = _f32((low - np.where(high == 1, 0, 4)).reshape(n, 16, 16))
    dl = (_half(blocks, t, "d") * _f32(_unpack_q3_scales(_field(blocks, t, "scales"))))[:, :, None]
    return (dl * q).reshape(n, QK_K)


@_quiet_floats
def _decode_k4(blocks, t):
    n = blocks.shape[0]
    d, dmin = _half(blocks, t, "d"), _half(blocks, t, "dmin")
    sc, m = _unpack_k4_scales(_field(blocks, t, "scales"))
    qs = _field(blocks, t, "qs").astype(np.int64).reshape(n, 4, 1, 32)
    q = (qs >> np.array([0, 4]).reshape(1, 1, 2, 1)) & 0xF                       # [n, 4 chunks, 2 halves, 32]
    if t == GGMLType.Q5_K:
        qh = _field(blocks, t, "qh").astype(np.int64)
        bit = np.arange(8).reshape(4, 2)
        q = q | (((qh[:, None, None, :] >> bit[None, :, :, None]) & 1) << 4)
    q = _f32(q.reshape(n, 8, 32))
    return ((d * _f32(sc))[:, :, None] * q - (dmin * _f32(m))[:, :, None]).reshape(n, QK_K)


def decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K: y = (d·sc)·q − dmin·m."""
    return _decode_k4(blocks, GGMLType.Q4_K)


def decode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_K: y = (d·sc)·(q | high<<4) − dmin·m."""
    return _decode_k4(blocks, GGMLType.Q5_K)


@_quiet_floats
def decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q6_K: y = (d·sc)·(q − 32)."""
    n = blocks.shape[0]
    t = GGMLType.Q6_K
    ql = _field(blocks, t, "ql").astype(np.int64).reshape(n, 2, 2, 32)           # [chunk, half, l]
    qh = _field(blocks, t, "qh").astype(np.int64).reshape(n, 2, 32)
    low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
    q = _f32(((low | (high << 4)) - 32).reshape(n, 16, 16))
    sc = _f32(np.ascontiguousarray(_field(blocks, t, "scales")).view(np.int8))
    return ((_half(blocks, t, "d") * sc)[:, :, None] * q).reshape(n, QK_K)


# ------------------------------------------------------------------------------------------------ registry

encode_q2_k_reference = _reference_encoder(GGMLType.Q2_K, _q2_k_block)
encode_q3_k_reference = _reference_encoder(GGMLType.Q3_K, _q3_k_block)
encode_q4_k_reference = _reference_encoder(GGMLType.Q4_K, lambda x, qw: _k4_block(x, qw, 15))
encode_q5_k_reference = _reference_encoder(GGMLType.Q5_K, lambda x, qw: _k4_block(x, qw, 31))
encode_q6_k_reference = _reference_encoder(GGMLType.Q6_K, _q6_k_block)


def _fast_encoder(name: str):
    """The numba kernel, imported on first use (it imports this module's layout table)."""
    def encode(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        from ..kernels import kquants_numba
        return getattr(kquants_numba, name)(x, imatrix)
    encode.__name__ = encode.__qualname__ = name
    return encode


FORMATS = [
    QuantFormat(t, ImatrixUse.OPTIONAL, ref, _fast_encoder(f"encode_{t.name.lower()}"), dec)
    for t, ref, dec in (
        (GGMLType.Q2_K, encode_q2_k_reference, decode_q2_k),
        (GGMLType.Q3_K, encode_q3_k_reference, decode_q3_k),
        (GGMLType.Q4_K, encode_q4_k_reference, decode_q4_k),
        (GGMLType.Q5_K, encode_q5_k_reference, decode_q5_k),
        (GGMLType.Q6_K, encode_q6_k_reference, decode_q6_k),
    )
]
