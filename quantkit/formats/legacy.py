"""Legacy 32-weight blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 — byte-identical to ggml (``ggml-quants.c``).

Layouts (byte offsets in one block; ``d``/``m`` little-endian IEEE f16; weight j of the block):

======  =====  ===========================================================================================
type    bytes  layout
======  =====  ===========================================================================================
Q4_0    18     d @0, qs[16] @2: weight j (< 16) = low nibble of qs[j], weight j+16 = its high nibble;
               value (q - 8)·d
Q4_1    20     d @0, m @2, qs[16] @4 (nibbles as Q4_0); value q·d + m
Q5_0    22     d @0, qh u32 @2 (bit j = 5th bit of weight j), qs[16] @6 (low 4 bits as Q4_0); (q - 16)·d
Q5_1    24     d @0, m @2, qh u32 @4, qs[16] @8; value q·d + m
Q8_0    34     d @0, int8 qs[32] @2; value q·d
======  =====  ===========================================================================================

Encoding (``ggml_quantize_chunk`` → ``quantize_<t>``), all float32 arithmetic, no fused multiply-add (the
libggml-base we match is an x86-64 baseline SSE2 build: not one FMA instruction in it):

- Q8_0 ignores the importance matrix.  ``d = amax/127``, ``id = d ? 1/d : 0``, ``q = (int8)roundf(x·id)``
  (half away from zero).
- Without an importance matrix (``quantize_row_<t>_ref``):

  * Q4_0/Q5_0: ``max`` = the first weight of largest |x|; ``d = max/-8`` (``/-16``), ``id = d ? 1/d : 0``,
    ``q = MIN(15, (int8)(x·id + 8.5))`` (``MIN(31, … + 16.5)``): truncation, so rounding is half up.
  * Q4_1/Q5_1: ``min``/``max`` by a strict scan (the first of ±0 is kept), ``d = (max-min)/15`` (``/31``),
    ``m = min``, ``q = (int8)((x-min)·id + 0.5)``, clamped with ``MIN(15, ·)`` for Q4_1 only.

- With one (``quantize_row_<t>_impl``): per row ``σ² = Σx²/n`` (summed in order over the row); per block
  ``w = imatrix·sqrtf(σ² + x²)``; then Q4_0/Q5_0 take ``d = make_qx_quants(32, 8|16, x, L, rmse_type=1, w)``
  (an RMSE search over 19 trial scales ``-(nmax + 0.1·is)/max``, ``nearest_int`` = half to even) and
  Q4_1/Q5_1 take ``make_qkx3_quants(32, 15|31, x, w, L, &min, Laux, -0.9, 0.05, 36, false)`` with
  ``m = -the_min``.  The chosen ``d``/``m`` are stored as f16 without re-quantizing.

A C float → int conversion on x86 gives INT32_MIN for NaN/inf/out of range, and stores keep the low byte; the
reference mirrors that, so degenerate scales (e.g. a block whose largest weight is a float32 subnormal) give
ggml's bytes too.  f16 stores are IEEE round to nearest even (ggml's own bit algorithm).
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from ..kernels import legacy_numba as nb
from ..kernels.rows import over_rows
from ._ggml_numpy import (F32, as_int8, c_int, f16_bits, first_argmax, low_byte, nearest_int, recip_or_zero,
                          roundf, safe_div, seq_sum, take)
from .registry import GGMLType, ImatrixUse, QuantFormat

QK = 32
_GROUP_MAX_EPS = F32(1e-15)  # ggml: a block with amax below this is all zero
_QX_STEPS = [s for s in range(-9, 10) if s]  # make_qx_quants' trial scales
_QKX3_RMIN, _QKX3_RDELTA, _QKX3_NSTEP = F32(-0.9), F32(0.05), 36

# type -> (nmax, type_size, affine): nmax is the quant half-range (symmetric) or top level (affine)
_LAYOUT = {t: (nmax, GGML_QUANT_SIZES[t][1], affine) for t, nmax, affine in (
    (GGMLType.Q4_0, 8, False), (GGMLType.Q5_0, 16, False), (GGMLType.Q4_1, 15, True), (GGMLType.Q5_1, 31, True))}


# ---------------------------------------------------------------- packing (shared by every path)

def _pack(qtype: GGMLType, L: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """Blocks [B, type_size] from quants L[B, 32] (ints, low byte kept) and scales d[B] (m[B] if affine)."""
    L = np.asarray(L, dtype=np.int64)
    lo, hi = L[:, :16], L[:, 16:]
    head = [f16_bits(d)] + ([f16_bits(m)] if m is not None else [])
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        qs = low_byte(lo | (hi << 4))
        return np.concatenate(head + [qs], axis=1)
    qs = low_byte((lo & 0x0F) | ((hi & 0x0F) << 4))
    bit5 = ((L & 0x10) >> 4).astype(np.uint64)
    qh = (bit5 << np.arange(QK, dtype=np.uint64)).sum(axis=1).astype("<u4")
    return np.concatenate(head + [qh.view(np.uint8).reshape(-1, 4), qs], axis=1)


# ---------------------------------------------------------------- paths without an importance matrix

def _encode_q8_0_reference(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    rows = x.shape[0]
    b = x.reshape(-1, QK)
    d = safe_div(np.abs(b).max(axis=1), F32(127))
    with np.errstate(invalid="ignore", over="ignore"):
        q = roundf((b * recip_or_zero(d)[:, None]).astype(F32))
    blocks = np.concatenate([f16_bits(d), low_byte(c_int(q))], axis=1)
    return blocks.reshape(rows, -1)


def _ref_symmetric(b: np.ndarray, nmax: int):
    """quantize_row_q4_0_ref / q5_0_ref on blocks b[B, 32]: (d, L)."""
    mx = take(b, first_argmax(np.abs(b)))[:, 0]
    mx = np.where(mx != 0, mx, F32(0))  # ggml's max starts at +0.0 and only moves when |v| grows
    d = safe_div(mx, F32(-nmax))
    with np.errstate(invalid="ignore", over="ignore"):
        v = (b * recip_or_zero(d)[:, None] + F32(nmax + 0.5)).astype(F32)
    return d, np.minimum(as_int8(c_int(v)), 2 * nmax - 1)


def _ref_affine(b: np.ndarray, nmax: int):
    """quantize_row_q4_1_ref / q5_1_ref on blocks b[B, 32]: (d, min, L)."""
    mn = take(b, np.argmin(b, axis=1)[:, None])[:, 0]  # the first minimum, like the strict scan
    mx = take(b, first_argmax(b))[:, 0]
    d = safe_div(mx - mn, F32(nmax))
    with np.errstate(invalid="ignore", over="ignore"):
        v = ((b - mn[:, None]) * recip_or_zero(d)[:, None] + F32(0.5)).astype(F32)
    q = as_int8(c_int(v))
    if nmax == 15:  # Q4_1 clamps with MIN(15, ·); Q5_1 stores the byte as is
        q = np.minimum(q, 15)
    return d, mn, q


# ---------------------------------------------------------------- paths with an importance matrix

def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray):
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, w)`` on blocks x[B, n] with weights w[B, n].

    Returns (scale[B], L[B, n]) with L in [0, 2·nmax-1].
    """
    amax_at = first_argmax(np.abs(x))
    amax = take(np.abs(x), amax_at)[:, 0]
    mx = take(x, amax_at)
    fnmax = F32(nmax)

    def trial(iscale):
        with np.errstate(invalid="ignore", over="ignore"):
            l = np.clip(nearest_int((iscale * x).astype(F32)), -nmax, nmax - 1)
            fl = l.astype(F32)
            sumlx = seq_sum((w * x).astype(F32) * fl)
            suml2 = seq_sum((w * fl).astype(F32) * fl)
        return l + nmax, sumlx, suml2

    L, sumlx, suml2 = trial(safe_div(-fnmax, mx))
    scale = np.where(suml2 != 0, safe_div(sumlx, suml2), F32(0))
    with np.errstate(invalid="ignore", over="ignore"):
        best = (scale * sumlx).astype(F32)
        for step in _QX_STEPS:
            Lt, sumlx, suml2 = trial(safe_div(-(fnmax + F32(0.1) * F32(step)), mx))
            better = (suml2 > 0) & ((sumlx * sumlx).astype(F32) > (best * suml2).astype(F32))
            L = np.where(better[:, None], Lt, L)
            scale = np.where(better, safe_div(sumlx, suml2), scale)
            best = np.where(better, (scale * sumlx).astype(F32), best)
    zero = amax < _GROUP_MAX_EPS
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, L)


def make_qkx3_quants(x: np.ndarray, nmax: int, w: np.ndarray, rmin, rdelta, nstep: int):
    """ggml ``make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, use_mad=false)``.

    On blocks x[B, n] with weights w[B, n]; returns (scale[B], the_min[B], L[B, n]), x ≈ scale·L - the_min.
    As in ggml, an accepted trial also moves ``min``, which the later trials' ``iscale`` and levels use.
    """
    n = x.shape[1]
    mn = x[:, 0].copy()
    mx = x[:, 0].copy()
    for i in range(1, n):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
    with np.errstate(invalid="ignore", over="ignore"):
        wx = (w * x).astype(F32)
        sum_w = seq_sum(w[:, 1:], start=w[:, 0])
        sum_x = seq_sum(wx[:, 1:], start=wx[:, 0])
    mn = np.where(mn > 0, F32(0), mn).astype(F32)
    degenerate = mx <= mn  # ggml returns at once: L = 0, scale 0, the_min = -min
    min0 = mn
    fnmax = F32(nmax)

    def weighted_error(scale, mn_, L):
        with np.errstate(invalid="ignore", over="ignore"):
            diff = ((scale[:, None] * L.astype(F32)).astype(F32) + mn_[:, None] - x).astype(F32)
            return seq_sum((w * (diff * diff).astype(F32)).astype(F32))

    def levels(iscale):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.clip(nearest_int((iscale[:, None] * (x - mn[:, None])).astype(F32)), 0, nmax)

    iscale = safe_div(fnmax, mx - mn)
    scale = safe_div(F32(1), iscale)
    L = levels(iscale)
    best = weighted_error(scale, mn, L)
    for step in range(nstep + 1):
        Laux = levels(safe_div(rmin + rdelta * F32(step) + fnmax, mx - mn))
        fl = Laux.astype(F32)
        with np.errstate(invalid="ignore", over="ignore"):
            wl = (w * fl).astype(F32)
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum((wl * fl).astype(F32))
            sum_xl = seq_sum((wl * x).astype(F32))
            D = ((sum_w * sum_l2).astype(F32) - (sum_l * sum_l).astype(F32)).astype(F32)
            this_scale = safe_div((sum_w * sum_xl).astype(F32) - (sum_x * sum_l).astype(F32), D)
            this_min = safe_div((sum_l2 * sum_x).astype(F32) - (sum_l * sum_xl).astype(F32), D)
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min).astype(F32)
        this_scale = np.where(clamp, safe_div(sum_xl, sum_l2), this_scale).astype(F32)
        err = weighted_error(this_scale, this_min, Laux)
        better = (D > 0) & (err < best)
        L = np.where(better[:, None], Laux, L)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(degenerate, F32(0), scale).astype(F32)
    L = np.where(degenerate[:, None], 0, L)
    return scale, (-np.where(degenerate, min0, mn)).astype(F32), L


def _imatrix_weights(x: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """w = imatrix·sqrtf(σ² + x²) with σ² = Σx²/n per row (quantize_row_<t>_impl), shaped [rows·nb, 32]."""
    with np.errstate(over="ignore", invalid="ignore"):
        x2 = (x * x).astype(F32)
        sigma2 = safe_div(seq_sum(x2), F32(x.shape[1]))
        w = (imatrix[None, :] * np.sqrt((sigma2[:, None] + x2).astype(F32))).astype(F32)
    return w.reshape(-1, QK)


# ---------------------------------------------------------------- encoders

def _reference_encoder(qtype: GGMLType):
    nmax, _, affine = _LAYOUT[qtype]

    def encode(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        rows = x.shape[0]
        b = x.reshape(-1, QK)
        if imatrix is None:
            if affine:
                d, mn, L = _ref_affine(b, nmax)
                return _pack(qtype, L, d, mn).reshape(rows, -1)
            d, L = _ref_symmetric(b, nmax)
            return _pack(qtype, L, d, None).reshape(rows, -1)
        w = _imatrix_weights(x, imatrix)
        if affine:
            d, the_min, L = make_qkx3_quants(b, nmax, w, _QKX3_RMIN, _QKX3_RDELTA, _QKX3_NSTEP)
            return _pack(qtype, L, d, -the_min).reshape(rows, -1)
        d, L = make_qx_quants(b, nmax, w)
        return _pack(qtype, L, d, None).reshape(rows, -1)

    encode.__name__ = f"encode_{qtype.name.lower()}_reference"
    return encode


def _fast_encoder(qtype: GGMLType):
    nmax, type_size, affine = _LAYOUT[qtype]

    def encode(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        out = np.empty((x.shape[0], x.shape[1] // QK * type_size), np.uint8)
        if imatrix is None:
            kernel = getattr(nb, qtype.name.lower())  # one kernel per type, compiled for its constants
            over_rows(x.shape[0], lambda r0, r1: kernel(x[r0:r1], out[r0:r1]))
        else:
            over_rows(x.shape[0],
                      lambda r0, r1: nb.with_imatrix(x[r0:r1], imatrix, out[r0:r1], nmax, type_size, affine))
        return out

    encode.__name__ = f"encode_{qtype.name.lower()}"
    return encode


def _encode_q8_0(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    out = np.empty((x.shape[0], x.shape[1] // QK * 34), np.uint8)
    over_rows(x.shape[0], lambda r0, r1: nb.q8_0(x[r0:r1], out[r0:r1]))
    return out


# ---------------------------------------------------------------- decoders (ggml dequantize_row_<t>)

def _unpack(qtype: GGMLType, blocks: np.ndarray):
    """(d, m or None, q[B, 32] unsigned quants) from raw blocks."""
    _, type_size, affine = _LAYOUT[qtype]
    d = blocks[:, 0:2].copy().view("<f2").astype(F32)[:, 0]
    m = blocks[:, 2:4].copy().view("<f2").astype(F32)[:, 0] if affine else None
    pos = 4 if affine else 2
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        qs = blocks[:, pos:pos + 16]
        return d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)
    qh = blocks[:, pos:pos + 4].copy().view("<u4")
    bit5 = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.int32) << 4
    qs = blocks[:, pos + 4:pos + 20]
    return d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32) | bit5


def _reference_decoder(qtype: GGMLType):
    nmax, _, affine = _LAYOUT[qtype]

    def decode(blocks: np.ndarray) -> np.ndarray:
        d, m, q = _unpack(qtype, blocks)
        with np.errstate(invalid="ignore", over="ignore"):
            if affine:
                return ((q.astype(F32) * d[:, None]).astype(F32) + m[:, None]).astype(F32)
            return ((q - nmax).astype(F32) * d[:, None]).astype(F32)

    decode.__name__ = f"decode_{qtype.name.lower()}_reference"
    return decode


def _decode_q8_0_reference(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, 0:2].copy().view("<f2").astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (blocks[:, 2:].view(np.int8).astype(F32) * d).astype(F32)


FORMATS = [
    QuantFormat(GGMLType.Q8_0, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_q8_0_reference,
                encode_fast=_encode_q8_0, decode_reference=_decode_q8_0_reference),
] + [
    QuantFormat(t, imatrix=ImatrixUse.OPTIONAL, encode_reference=_reference_encoder(t), encode_fast=_fast_encoder(t),
                decode_reference=_reference_decoder(t))
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)
]
