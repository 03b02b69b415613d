"""Non-linear 4-bit types IQ4_NL (32-weight blocks) and IQ4_XS (256-weight super-blocks) — byte-identical to ggml.

Both store 4-bit indices into the 16 levels ``kvalues_iq4nl`` (-127 … 113; taken from gguf-py's
``gguf.quants.IQ4_NL.kvalues``, the one source — never retyped).  Layouts (byte offsets, d little-endian f16):

- IQ4_NL (18 bytes / 32 weights): d @0, qs[16] @2; weight j (< 16) = low nibble of qs[j], j+16 = its high
  nibble; value ``d · kvalues[q]``.
- IQ4_XS (136 bytes / 256 weights): d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8.  Sub-block ib (32
  weights) has the 6-bit scale ``ls = (scales_l[ib/2] >> 4·(ib%2)) & 0xF | ((scales_h >> 2·ib) & 3) << 4`` and
  its 16 bytes at ``qs[16·ib]`` packed as IQ4_NL; value ``(d·(ls - 32)) · kvalues[q]``.

Encoding (``quantize_iq4_nl`` / ``quantize_iq4_xs`` → ``quantize_row_iq4_nl_impl`` with ntry = 7, float32, no
fused multiply-add):

1. Per super-block (32 for NL, 256 for XS): ``σ² = (Σx², in order) · (2/size)``; per 32-block weights
   ``w = imatrix·sqrtf(σ² + x²)`` with an importance matrix, else ``w = x²``.
2. Per 32-block: ``max`` = first weight of largest |x|; a block with amax < 1e-15 gets scale 0.  Else
   ``d = -max/kvalues[0]``, levels ``l = best_index(x/d)``, ``d = Σw·q·x / Σw·q²``; then for itry = -7..7 the
   trial ``id = (itry + kvalues[0])/max`` replaces d when ``sumqx² > best·sumq2`` (strictly).
   ``best_index_int8`` is a binary search returning the nearer level; a tie after float32 rounding of the
   two distances goes to the upper level.
3. IQ4_NL stores ``d`` as f16 and the levels ``best_index(x · (1/d))`` (``1/d`` in float32; 0 when d = 0).
   IQ4_XS takes ``max_scale``, the first sub-block scale of largest |d|, ``d = -max_scale/32`` (stored f16,
   used unrounded), per sub-block ``l = clamp(nearest_int(scale/d), -32, 31)`` (half to even), ``dl = d·l``
   and levels ``best_index(x · (1/dl))``; ``ls = l + 32``.  An all-zero super-block stores d = -0.0 (0x8000).
"""
from __future__ import annotations

import numpy as np
from ..kernels import nonlinear_numba as nb
from ..kernels.rows import over_rows
from ._ggml_numpy import F32, f16_bits, first_argmax, nearest_int, recip_or_zero, safe_div, seq_sum, take
from .registry import GGMLType, ImatrixUse, QuantFormat

KVALUES_IQ4NL = nb.LEVELS
QK = 32
QK_K = 256
NTRY = nb.NTRY
_GROUP_MAX_EPS = F32(1e-15)


def best_index(x: np.ndarray) -> np.ndarray:
    """ggml best_index_int8(16, kvalues_iq4nl, x) for every element of float32 ``x``."""
    vals = KVALUES_IQ4NL
    mu = np.clip(np.searchsorted(vals, x, side="right"), 1, len(vals) - 1)  # levels <= x; NaN sorts last
    with np.errstate(invalid="ignore"):
        upper = ~((x - vals[mu - 1]).astype(F32) < (vals[mu] - x).astype(F32))
        l = np.where(upper, mu, mu - 1)
        return np.where(x <= vals[0], 0, np.where(x >= vals[-1], len(vals) - 1, l))


def _weights(x: np.ndarray, imatrix: np.ndarray | None, size: int) -> np.ndarray:
    """Per-weight importance as ggml builds it, for x[rows, n] → [rows·n/32, 32]."""
    with np.errstate(over="ignore", invalid="ignore"):
        x2 = (x * x).astype(F32)
        if imatrix is None:
            return x2.reshape(-1, QK)
        sb = x2.reshape(x.shape[0], -1, size)
        sigma2 = (seq_sum(sb) * (F32(2) / F32(size))).astype(F32)
        w = (imatrix.reshape(1, -1, size) * np.sqrt((sigma2[..., None] + sb).astype(F32))).astype(F32)
    return w.reshape(-1, QK)


def _block_scales(b: np.ndarray, w: np.ndarray):
    """The searched scale of every 32-block b[B, 32] and whether the block is non-zero."""
    absb = np.abs(b)
    at = first_argmax(absb)
    mx = take(b, at)
    nonzero = take(absb, at)[:, 0] >= _GROUP_MAX_EPS
    vals = KVALUES_IQ4NL

    def sums(iscale):
        with np.errstate(over="ignore", invalid="ignore"):
            q = vals[best_index((iscale * b).astype(F32))]
            wq = (w * q).astype(F32)
            return seq_sum((wq * b).astype(F32)), seq_sum((wq * q).astype(F32))

    sumqx, sumq2 = sums(recip_or_zero(safe_div(-mx, vals[0])))
    d = np.where(sumq2 > 0, safe_div(sumqx, sumq2), F32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        best = (d * sumqx).astype(F32)
        for itry in range(-NTRY, NTRY + 1):
            sumqx, sumq2 = sums(safe_div(F32(itry + int(vals[0])), mx))
            better = (sumq2 > 0) & ((sumqx * sumqx).astype(F32) > (best * sumq2).astype(F32))
            d = np.where(better, safe_div(sumqx, sumq2), d)
            best = np.where(better, (d * sumqx).astype(F32), best)
    return np.where(nonzero, d, F32(0)).astype(F32), nonzero


def _pack_levels(L: np.ndarray) -> np.ndarray:
    """[B, 32] level indices → [B, 16] bytes (L[j] | L[j+16] << 4)."""
    return (L[:, :16] | (L[:, 16:] << 4)).astype(np.uint8)


def _encode_iq4_nl_reference(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    rows = x.shape[0]
    b = x.reshape(-1, QK)
    d, _ = _block_scales(b, _weights(x, imatrix, QK))
    with np.errstate(over="ignore", invalid="ignore"):
        L = best_index((b * recip_or_zero(d)[:, None]).astype(F32))
    return np.concatenate([f16_bits(d), _pack_levels(L)], axis=1).reshape(rows, -1)


def _encode_iq4_xs_reference(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    rows = x.shape[0]
    n_sub = QK_K // QK
    b = x.reshape(-1, QK)
    scales, nonzero = _block_scales(b, _weights(x, imatrix, QK_K))
    scales, nonzero = scales.reshape(-1, n_sub), nonzero.reshape(-1, n_sub)
    # max_scale: the first scale of largest |d| (ggml skips all-zero blocks; NaN never compares greater)
    with np.errstate(invalid="ignore"):
        absd = np.where(nonzero & (np.abs(scales) > 0), np.abs(scales), F32(0))
    at = first_argmax(absd)
    max_scale = np.where(take(absd, at)[:, 0] > 0, take(scales, at)[:, 0], F32(0)).astype(F32)
    d = (-max_scale / F32(32)).astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        l = np.clip(nearest_int((recip_or_zero(d)[:, None] * scales).astype(F32)), -32, 31)
        dl = (d[:, None] * l.astype(F32)).astype(F32)
        L = best_index((b.reshape(-1, n_sub, QK) * recip_or_zero(dl)[:, :, None]).astype(F32))
    ls = l + 32
    scales_l = (ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)
    scales_h = ((ls >> 4) << (2 * np.arange(n_sub))).sum(axis=1).astype("<u2")
    blocks = np.concatenate([f16_bits(d), scales_h.view(np.uint8).reshape(-1, 2), scales_l.astype(np.uint8),
                             _pack_levels(L.reshape(-1, QK)).reshape(-1, n_sub * 16)], axis=1)
    return blocks.reshape(rows, -1)


def _fast_encoder(kernel, block_size: int, type_size: int):
    def encode(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        out = np.empty((x.shape[0], x.shape[1] // block_size * type_size), np.uint8)
        qw = imatrix if imatrix is not None else np.zeros(1, F32)
        use_qw = imatrix is not None
        over_rows(x.shape[0], lambda r0, r1: kernel(x[r0:r1], qw, use_qw, out[r0:r1]))
        return out

    encode.__name__ = f"encode_{kernel.__name__}"
    return encode


def _decode_iq4_nl_reference(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, 0:2].copy().view("<f2").astype(F32)
    qs = blocks[:, 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        return (d * KVALUES_IQ4NL[q]).astype(F32)


def _decode_iq4_xs_reference(blocks: np.ndarray) -> np.ndarray:
    n_sub = QK_K // QK
    d = blocks[:, 0:2].copy().view("<f2").astype(F32)
    scales_h = blocks[:, 2:4].copy().view("<u2").astype(np.int32)
    ib = np.arange(n_sub)
    ls = ((blocks[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
    qs = blocks[:, 8:].reshape(-1, n_sub, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    with np.errstate(over="ignore", invalid="ignore"):
        dl = (d * (ls - 32).astype(F32)).astype(F32)
        return (dl[:, :, None] * KVALUES_IQ4NL[q]).astype(F32).reshape(-1, QK_K)


FORMATS = [
    QuantFormat(GGMLType.IQ4_NL, imatrix=ImatrixUse.OPTIONAL, encode_reference=_encode_iq4_nl_reference,
                encode_fast=_fast_encoder(nb.iq4_nl, QK, 18), decode_reference=_decode_iq4_nl_reference),
    QuantFormat(GGMLType.IQ4_XS, imatrix=ImatrixUse.OPTIONAL, encode_reference=_encode_iq4_xs_reference,
                encode_fast=_fast_encoder(nb.iq4_xs, QK_K, 136), decode_reference=_decode_iq4_xs_reference),
]
