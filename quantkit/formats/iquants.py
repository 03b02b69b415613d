"""Grid I-quants IQ2_XXS, IQ2_XS and IQ3_XXS: layouts, ggml's encoder step by step, reference codecs.

Every type has super-blocks of 256 weights.  Multi-byte fields are little-endian; ``d`` is an IEEE half.

* IQ2_XXS (66 bytes, 2.0625 bpw): ``d`` | 8 sub-blocks of 32 weights, each two u32: the first holds four
  grid indices (one byte per group of 8 weights, into a 256-entry grid of 8-vectors over {8, 25, 43}); the
  second holds four 7-bit sign codes (bits 7k..7k+6) and the 4-bit sub-block scale ``ls`` (bits 28..31).
  Weight = ``d * (0.5 + ls) * 0.25 * grid[j] * sign``.
* IQ2_XS (74 bytes, 2.3125 bpw): ``d`` | 32 u16 (9-bit index into a 512-entry grid, 7-bit sign code << 9),
  one per group of 8 | 8 bytes of 4-bit scales, one per 16 weights (low nibble first).
* IQ3_XXS (98 bytes, 3.0625 bpw): ``d`` | 64 bytes of grid indices (a 256-entry grid of 4-vectors over
  {4, 12, ..., 62}), one per 4 weights | 8 u32, one per 32 weights: four 7-bit sign codes and ``ls`` << 28.
  Weight = ``d * (0.5 + ls) * 0.5 * grid[j] * sign``.

Signs: a 7-bit code gives the signs of 8 weights; the 8th is implied by even parity (gguf-py's ``ksigns``
table).  The grids and ``ksigns`` are gguf-py's (see :mod:`quantkit.formats.iq_tables`).

The encoder (``quantize_row_iq2_xxs_impl`` / ``_iq2_xs_impl`` / ``iq3_xxs_impl`` in ggml-quants.c), per
super-block, all arithmetic in IEEE float32 in ggml's operation order (no fused multiply-add: the ggml-base
build we match has none):

1. ``sigma2 = Σx²/256`` (IQ3_XXS: ``2·Σx²/256``), summed in order.  Per sub-block (32 weights; IQ2_XS 16):
   ``weight = imatrix · sqrt(sigma2 + x²)``; IQ3_XXS without an importance vector uses ``weight = x²``.
   IQ2_XXS and IQ2_XS require an importance vector (ggml asserts; :func:`quantkit.encode` refuses).
   ``waux = sqrt(weight)``.
2. Signs, per group of 8: ``xval = |x|`` and the sign bits; an odd count of negatives cannot be stored, so
   the element with the least ``weight·x·x`` (first on ties) keeps its sign wrong: its ``xval`` becomes
   ``-|x|`` and its sign bit flips.  The stored code is the low 7 bits.
3. ``max = MAX chain of xval`` (``a > b ? a : b``).  Below 1e-15 (IQ3_XXS: 1e-8) the sub-block is all
   zero (no grid, signs or scale).
4. Initial scale: IQ2_XXS ``s = make_qp_quants(32, 4, xval, weight)`` and ``eff_max = 3s`` (skip the
   sub-block if ``eff_max <= 0``); IQ2_XS ``max/5``; IQ3_XXS ``max/15``.
5. Trials ``is`` in -6..6 (IQ2_XS -9..9, IQ3_XXS -15..15): ``id = (5 + 0.1·is)/eff_max`` (IQ2_XS
   ``(5 + 0.1·is)/max``, IQ3_XXS ``(15 + 0.2·is)/max``).  Each group of 8 (IQ3_XXS: 4) is rounded to levels
   ``l = clamp(nearest_int(0.5·(id·xval − 1)), 0, kMaxQ−1)`` (kMaxQ 3, IQ3_XXS 8); when its lattice code is
   not a grid point it moves to the listed neighbour of least ``Σ waux·(q/id − xval)²`` with
   ``q = 2l+1`` (the first on ties; ggml aborts if every distance is inf/NaN).  With ``q = 2l+1`` over
   the sub-block, ``sumqx = Σ w·xval·q`` and ``sumq2 = Σ w·q·q``; the trial is kept when
   ``sumq2 > 0 and sumqx² > best·sumq2``, setting ``scale = sumqx/sumq2, best = scale·sumqx``.
6. Refinement at ``id = 1/scale`` when ``scale > 0``: IQ2_XXS re-snaps every group, IQ2_XS and IQ3_XXS only
   the groups that were off the grid in the kept trial (and only if there is one); then
   ``scale = sumqx/sumq2`` if ``sumq2 > 0``.  A negative scale flips the sign codes (of the first four
   groups) and is negated; a NaN scale makes ggml abort.
7. ``d = max_scale/31`` (``max_scale`` by the MAX chain; 0 gives an all-zero block), stored as a half
   (IQ3_XXS stores ``d·1.0125``); each ``ls = clamp(nearest_int(0.5·(scales/d − 1)), 0, 15)`` uses the
   unrounded float ``1/d``.

``nearest_int`` is ggml's magic-number rounding (round half to even below 2²², a fixed wrap-around
beyond; see :mod:`quantkit.kernels.kq_primitives`, shared with the K-quants, as are ``make_qp_quants`` and
the float-to-half conversion).  Where ggml aborts the process (the cases above, reachable only when
``weight·diff²`` overflows float32: Gaussian rows of scale ~1e15, or ~1e12 for IQ3_XXS without importance),
quantkit raises :class:`EncodeError`.

The reference encoders below follow that text per block in plain Python (slow; tests use a few rows); the
fast ones are :mod:`quantkit.kernels.iquants_numba`.  Both are byte-identical to ggml.  The reference
decoders are bit-identical to gguf-py's and to ggml's ``dequantize_row_*``, except that for a NaN ``d`` ggml
applies a minus sign by flipping the NaN's sign bit where gguf-py (and quantkit) multiply by -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from ..errors import EncodeError
from ..kernels import iquants_numba as fast
from ..kernels.kq_primitives import fp32_to_fp16, make_qp_quants, nearest_int
from ..kernels.rows import over_rows
from .iq_tables import KSIGNS, IQTables, tables
from .registry import GGMLType, ImatrixUse, QuantFormat

F32 = np.float32
QK_K = 256
_ZERO = F32(0.0)
_ONE = F32(1.0)
_HALF = F32(0.5)
_QUARTER = F32(0.25)
_FLT_MAX = F32(np.finfo(np.float32).max)
_SCALE_DIV = F32(31.0)
_IQ3_D_FUDGE = F32(1.0125)

# ggml aborts instead of writing a row; the fast kernels report why in a status code.
_ABORT_REASONS = {
    fast.NO_NEIGHBOUR: "every neighbour's weighted distance is inf or NaN (GGML_ASSERT(grid_index >= 0))",
    fast.NAN_SCALE: "a sub-block scale is NaN (GGML_ASSERT(scale >= 0))",
    fast.OFF_GRID: "a group's final quants are not a grid point (\"Oops: found point not on grid\")",
}


@dataclass(frozen=True)
class _Variant:
    """What differs between the three encoders (see the module docstring, steps 1-7)."""

    qtype: GGMLType
    sub: int              # weights per sub-block (one scale)
    kmaxq: int            # levels per element
    base_q: np.float32    # 2·kMaxQ − 1
    step: np.float32      # trial spacing of id·max
    n_steps: int          # trials is = -n_steps..n_steps
    eps: np.float32       # all-zero threshold on max xval
    sigma_mul: np.float32
    refine_all: bool      # refinement re-snaps every group (IQ2_XXS) or only the off-grid ones


# The fast kernels take the same numbers as literals (iquants_numba.encode_rows).
_IQ2_XXS = _Variant(GGMLType.IQ2_XXS, 32, 3, F32(5), F32(0.1), 6, F32(1e-15), F32(1), True)
_IQ2_XS = _Variant(GGMLType.IQ2_XS, 16, 3, F32(5), F32(0.1), 9, F32(1e-15), F32(1), False)
_IQ3_XXS = _Variant(GGMLType.IQ3_XXS, 32, 8, F32(15), F32(0.2), 15, F32(1e-8), F32(2), False)


class _Abort(Exception):
    """ggml would abort the process here (reason in the message)."""


# ------------------------------------------------------------------------------------------ reference encoder

def _mx(a, b):
    """ggml's MAX(a, b): a > b ? a : b (NaN-sensitive, so spelt out)."""
    return a if a > b else b


def _seq_sum(values) -> np.float32:
    """Σ in index order with float32 rounding at every step (numpy's sum is pairwise)."""
    s = _ZERO
    for v in values:
        s = F32(s + v)
    return s


def _fold_signs(xb: np.ndarray, weight: np.ndarray, xval: np.ndarray) -> int:
    """Step 2 for one group of 8 (views): fills xval, returns the 7-bit sign code."""
    s = 0
    for i in range(8):
        xval[i] = xb[i] if xb[i] >= 0 else -xb[i]
        if xb[i] < 0:
            s |= 1 << i
    if bin(s).count("1") % 2:
        cost = [weight[i] * xb[i] * xb[i] for i in range(8)]
        imin = 0
        for i in range(1, 8):
            if cost[i] < cost[imin]:
                imin = i
        xval[imin] = -xval[imin]
        s ^= 1 << imin
    return s & 127


def _best_neighbour(t: IQTables, code: int, scale, xval: np.ndarray, waux: np.ndarray) -> int:
    """iq2/iq3_find_best_neighbour: the first listed grid point of least Σ waux·(scale·q − x)²."""
    best_d2, best = _FLT_MAX, -1
    for g in t.neighbours(code):
        d2 = _ZERO
        for i in range(t.dim):
            diff = F32(scale * F32(2 * int(t.levels[g, i]) + 1) - xval[i])
            d2 = F32(d2 + waux[i] * diff * diff)
        if d2 < best_d2:
            best_d2, best = d2, int(g)
    if best < 0:
        raise _Abort(_ABORT_REASONS[fast.NO_NEIGHBOUR])
    return best


def _snap(t: IQTables, v: _Variant, inv_scale, scale, xval: np.ndarray, waux: np.ndarray, L: np.ndarray) -> bool:
    """Round one group to levels at inv_scale, move it onto the grid; writes L, returns whether it was on it."""
    code = 0
    for i in range(t.dim):
        L[i] = max(0, min(v.kmaxq - 1, nearest_int(_HALF * (inv_scale * xval[i] - _ONE))))
        code |= int(L[i]) << (t.bits * i)
    g = int(t.kmap[code])
    if g >= 0:
        return True
    L[:] = t.levels[_best_neighbour(t, code, scale, xval, waux)]
    return False


def _lsq(weight: np.ndarray, xval: np.ndarray, L: np.ndarray):
    """(Σ w·x·q, Σ w·q·q) with q = 2L+1, in order."""
    q = (2 * L + 1).astype(np.float32)
    return _seq_sum(weight * xval * q), _seq_sum(weight * q * q)


def _search(t: IQTables, v: _Variant, xval, weight, waux, scale, denom):
    """Steps 5 and 6: returns (scale, levels)."""
    dim = t.dim
    groups = range(len(xval) // dim)
    L = np.zeros(len(xval), np.int64)
    on_grid = [True] * len(groups)
    best = _ZERO
    for step_i in range(-v.n_steps, v.n_steps + 1):
        inv_scale = F32((v.base_q + F32(step_i) * v.step) / denom)
        this_scale = F32(_ONE / inv_scale)
        Laux = np.zeros(len(xval), np.int64)
        hits = [_snap(t, v, inv_scale, this_scale, xval[k * dim:(k + 1) * dim], waux[k * dim:(k + 1) * dim],
                      Laux[k * dim:(k + 1) * dim]) for k in groups]
        sumqx, sumq2 = _lsq(weight, xval, Laux)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = F32(sumqx / sumq2)
            best = F32(scale * sumqx)
            L, on_grid = Laux, hits
    redo = [k for k in groups if v.refine_all or not on_grid[k]]
    if redo and scale > 0:
        inv_scale = F32(_ONE / scale)
        for k in redo:
            _snap(t, v, inv_scale, scale, xval[k * dim:(k + 1) * dim], waux[k * dim:(k + 1) * dim],
                  L[k * dim:(k + 1) * dim])
        sumqx, sumq2 = _lsq(weight, xval, L)
        if sumq2 > 0:
            scale = F32(sumqx / sumq2)
    return scale, L


def _encode_sub_block(t: IQTables, v: _Variant, xb: np.ndarray, qwb: Optional[np.ndarray], sigma2):
    """Steps 1-6 for one sub-block: (scale, grid indices per group, sign codes per 8) or None if all zero."""
    if qwb is not None:
        weight = qwb * np.sqrt(sigma2 + xb * xb)
    else:
        weight = xb * xb
    waux = np.sqrt(weight)
    xval = np.empty_like(xb)
    signs = [_fold_signs(xb[k:k + 8], weight[k:k + 8], xval[k:k + 8]) for k in range(0, len(xb), 8)]
    max_x = xval[0]
    for val in xval[1:]:
        max_x = _mx(max_x, val)
    if max_x < v.eps:
        return None
    if v.qtype == GGMLType.IQ2_XXS:
        scale = make_qp_quants(32, v.kmaxq + 1, xval, np.zeros(32, np.uint8), weight)
        denom = F32(scale * F32(v.kmaxq))
        if denom <= 0:
            return None
    else:
        denom = max_x
        scale = F32(max_x / v.base_q)
    scale, L = _search(t, v, xval, weight, waux, scale, denom)
    if scale != scale:
        raise _Abort(_ABORT_REASONS[fast.NAN_SCALE])
    if scale < 0:
        scale = -scale
        signs[:4] = [~s & 127 for s in signs[:4]]
    codes = (L.reshape(-1, t.dim) << (t.bits * np.arange(t.dim))).sum(axis=1)
    grid = t.kmap[codes]
    if (grid < 0).any():
        raise _Abort(_ABORT_REASONS[fast.OFF_GRID])
    return scale, [int(g) for g in grid], signs


def _encode_super_block(v: _Variant, xbl: np.ndarray, qw: Optional[np.ndarray]) -> bytes:
    t = tables(v.qtype)
    sigma2 = F32(v.sigma_mul * _seq_sum(xbl * xbl) / F32(QK_K))
    n_sub = QK_K // v.sub
    scales = [_ZERO] * n_sub
    subs = []
    max_scale = _ZERO
    for ib in range(n_sub):
        sl = slice(ib * v.sub, (ib + 1) * v.sub)
        sub = _encode_sub_block(t, v, xbl[sl], None if qw is None else qw[sl], sigma2)
        subs.append(sub)
        if sub is not None:
            scales[ib] = sub[0]
            max_scale = _mx(max_scale, sub[0])
    if max_scale == 0:
        return bytes(GGML_QUANT_SIZES[v.qtype][1])
    d = F32(max_scale / _SCALE_DIV)
    inv_d = F32(_ONE / d)
    ls = [max(0, min(15, nearest_int(_HALF * (inv_d * s - _ONE)))) for s in scales]
    stored_d = F32(d * _IQ3_D_FUDGE) if v.qtype == GGMLType.IQ3_XXS else d
    head = int(fp32_to_fp16(stored_d)).to_bytes(2, "little")
    if v.qtype == GGMLType.IQ2_XXS:
        words = []
        for ib, sub in enumerate(subs):
            grid, signs = (sub[1], sub[2]) if sub else ([0] * 4, [0] * 4)
            words.append(sum(g << (8 * k) for k, g in enumerate(grid)))
            words.append(sum(s << (7 * k) for k, s in enumerate(signs)) | ls[ib] << 28)
        return head + np.asarray(words, "<u4").tobytes()
    if v.qtype == GGMLType.IQ2_XS:
        qs = []
        for sub in subs:
            qs += [g | s << 9 for g, s in zip(sub[1], sub[2])] if sub else [0, 0]
        nibbles = bytes(ls[2 * j] | ls[2 * j + 1] << 4 for j in range(8))
        return head + np.asarray(qs, "<u2").tobytes() + nibbles
    grid_bytes, words = [], []
    for ib, sub in enumerate(subs):
        grid, signs = (sub[1], sub[2]) if sub else ([0] * 8, [0] * 4)
        grid_bytes += grid
        words.append(sum(s << (7 * k) for k, s in enumerate(signs)) | ls[ib] << 28)
    return head + bytes(grid_bytes) + np.asarray(words, "<u4").tobytes()


def _reference_encoder(v: _Variant):
    def encode(x: np.ndarray, imatrix: Optional[np.ndarray]) -> np.ndarray:
        rows = []
        for r, row in enumerate(x):
            try:
                with np.errstate(all="ignore"):             # inf/NaN propagate as in C
                    rows.append(b"".join(_encode_super_block(v, row[i:i + QK_K],
                                                             None if imatrix is None else imatrix[i:i + QK_K])
                                         for i in range(0, row.size, QK_K)))
            except _Abort as exc:
                raise _abort_error(v.qtype, r, str(exc)) from None
        return np.frombuffer(b"".join(rows), np.uint8).reshape(len(x), -1).copy()
    encode.__name__ = f"encode_{v.qtype.name.lower()}_reference"
    return encode


def _abort_error(qtype: GGMLType, row: int, reason: str) -> EncodeError:
    return EncodeError(f"{qtype.name} cannot encode row {row}: ggml aborts on it ({reason}); this happens when "
                       f"|weights| are so large that its weighted distances overflow float32 (rescale the tensor or "
                       f"choose another type)")


# ------------------------------------------------------------------------------------------------ fast encoder

def _fast_encoder(qtype: GGMLType):
    def encode(x: np.ndarray, imatrix: Optional[np.ndarray]) -> np.ndarray:
        t = tables(qtype)
        out = np.empty((x.shape[0], (x.shape[1] // QK_K) * GGML_QUANT_SIZES[qtype][1]), np.uint8)
        status = np.zeros(x.shape[0], np.int8)
        use_qw = imatrix is not None
        qw = imatrix if use_qw else np.zeros(x.shape[1], np.float32)
        over_rows(x.shape[0], lambda r0, r1: fast.encode_rows(
            int(qtype), x[r0:r1], qw, use_qw, out[r0:r1], status[r0:r1], t.kmap, t.nb_start, t.nb_count, t.nb_pos))
        failed = np.flatnonzero(status)
        if failed.size:
            row = int(failed[0])
            raise _abort_error(qtype, row, _ABORT_REASONS[int(status[row])])
        return out
    encode.__name__ = f"encode_{qtype.name.lower()}"
    return encode


# ------------------------------------------------------------------------------------------ reference decoders

def _sign_matrix(codes: np.ndarray) -> np.ndarray:
    """7-bit sign codes [...] → float32 ±1 [..., 8] through ksigns (bit j set: weight j negative)."""
    bits = (KSIGNS[codes][..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 1, F32(-1), F32(1))


def _half(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, :2].copy().view(np.float16).astype(np.float32)


def _quiet(decoder):
    """inf/NaN scales decode to inf/NaN weights, as in ggml, without numpy warnings."""
    def decode(blocks: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return decoder(blocks)
    decode.__name__, decode.__doc__ = decoder.__name__, decoder.__doc__
    return decode


@_quiet
def decode_iq2_xxs_reference(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_iq2_xxs: y = d·(0.5 + ls)·0.25 · grid[j] · sign, per group of 8."""
    n = blocks.shape[0]
    d = _half(blocks)                                               # [n, 1]
    words = blocks[:, 2:].copy().view("<u4").reshape(n, 8, 2)
    db = d * (_HALF + (words[..., 1] >> 28).astype(np.float32)) * _QUARTER          # [n, 8]
    idx = blocks[:, 2:].reshape(n, 8, 8)[..., :4]                                   # bytes of the first u32
    codes = (words[..., 1:] >> (7 * np.arange(4, dtype=np.uint32))) & 127           # [n, 8, 4]
    grid = tables(GGMLType.IQ2_XXS).values[idx]                                     # [n, 8, 4, 8]
    return (db[..., None, None] * grid * _sign_matrix(codes)).reshape(n, QK_K)


@_quiet
def decode_iq2_xs_reference(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_iq2_xs: per 16 weights its own 4-bit scale, y = d·(0.5 + ls)·0.25 · grid · sign."""
    n = blocks.shape[0]
    d = _half(blocks)
    qs = blocks[:, 2:66].copy().view("<u2").reshape(n, 32)
    nib = blocks[:, 66:74]
    ls = np.stack([nib & 15, nib >> 4], axis=-1).reshape(n, 16).astype(np.float32)
    db = d * (_HALF + ls) * _QUARTER                                                 # [n, 16]
    grid = tables(GGMLType.IQ2_XS).values[qs & 511].reshape(n, 16, 2, 8)
    signs = _sign_matrix(qs >> 9).reshape(n, 16, 2, 8)
    return (db[..., None, None] * grid * signs).reshape(n, QK_K)


@_quiet
def decode_iq3_xxs_reference(blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_iq3_xxs: y = d·(0.5 + ls)·0.5 · grid[j] · sign, grid entries of 4."""
    n = blocks.shape[0]
    d = _half(blocks)
    idx = blocks[:, 2:66].reshape(n, 8, 4, 2)                                        # two 4-vectors per 8
    words = blocks[:, 66:98].copy().view("<u4").reshape(n, 8)
    db = d * (_HALF + (words >> 28).astype(np.float32)) * _HALF
    codes = (words[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127           # [n, 8, 4]
    grid = tables(GGMLType.IQ3_XXS).values[idx].reshape(n, 8, 4, 8)
    return (db[..., None, None] * grid * _sign_matrix(codes)).reshape(n, QK_K)


FORMATS = [
    QuantFormat(GGMLType.IQ2_XXS, ImatrixUse.REQUIRED, encode_reference=_reference_encoder(_IQ2_XXS),
                encode_fast=_fast_encoder(GGMLType.IQ2_XXS), decode_reference=decode_iq2_xxs_reference),
    QuantFormat(GGMLType.IQ2_XS, ImatrixUse.REQUIRED, encode_reference=_reference_encoder(_IQ2_XS),
                encode_fast=_fast_encoder(GGMLType.IQ2_XS), decode_reference=decode_iq2_xs_reference),
    QuantFormat(GGMLType.IQ3_XXS, ImatrixUse.OPTIONAL, encode_reference=_reference_encoder(_IQ3_XXS),
                encode_fast=_fast_encoder(GGMLType.IQ3_XXS), decode_reference=decode_iq3_xxs_reference),
]
