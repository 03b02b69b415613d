"""numba decoders for the K-quants (256-weight super-blocks), mirroring ggml's ``dequantize_row_q{2..6}_K``.

Each kernel takes ``b: uint8[n_blocks, type_size]`` and writes ``y: float32[n_blocks, 256]``, parallel over
super-blocks.  Layouts (byte offsets; d/dmin are little-endian f16):

- Q2_K (84 B): scales[16] @0 (low nibble scale, high nibble min, one per 16 weights), qs[64] @16, d @80,
  dmin @82.  Weights 128h + 32s + l (l < 32) take bits 2s..2s+1 of qs[32h + l] and sub-block 8h + 2s + l//16:
  ``(d * sc) * q - dmin * m``.
- Q3_K (110 B): hmask[32] @0, qs[64] @32, scales[12] @96, d @108.  Sixteen 6-bit scales: scale k = 4g + r has
  its low nibble in byte r (g=0) / 4+r (g=1) / r high nibble (g=2) / 4+r high nibble (g=3) and its top two bits
  at bits 2g of byte 8+r.  Weight 128h + 32s + l: 2 bits as in Q2_K, minus 4 unless bit 4h+s of hmask[l] is set;
  ``(d * (scale - 32)) * q``.
- Q4_K (144 B): d @0, dmin @2, scales[12] @4 (eight 6-bit scale/min pairs, ggml's ``get_scale_min_k4``),
  qs[128] @16.  Weights 64c + l take the low nibble of qs[32c + l], 64c + 32 + l the high nibble;
  ``(d * sc) * q - dmin * m``.
- Q5_K (176 B): as Q4_K with qh[32] @16 and qs[128] @48; the 5th bit of weight 64c + 32t + l is bit 2c + t of
  qh[l].
- Q6_K (210 B): ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208.  Half h: weight 128h + 32k + l takes
  nibble (k >= 2) of ql[64h + 32(k % 2) + l] and bits 2k of qh[32h + l], minus 32;
  ``(d * scale[8h + 2k + l//16]) * q``.

Q2_K and Q3_K read their 16-weight trip count from ``y.shape`` at run time and hoist offsets and shifts out of
the inner loop: with literal counts LLVM unrolls the loops fully and, unable to prove that ``y`` and ``b`` do not
overlap, leaves them scalar (2x slower).  Q4_K..Q6_K vectorize as written.

Rounding: every product is exact in float32 (f16 mantissa of 11 bits times a scale of at most 8 bits times a
quant of at most 6), so the one rounding left is the final subtraction of Q2_K/Q4_K/Q5_K, done as ggml does.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dequant_scalars import load_f16


@njit(cache=True)
def _scale_min_k4(b, i, base, j):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 bytes at ``base``."""
    if j < 4:
        return np.int32(b[i, base + j]) & 63, np.int32(b[i, base + j + 4]) & 63
    sc = (np.int32(b[i, base + j + 4]) & 0xF) | ((np.int32(b[i, base + j - 4]) >> 6) << 4)
    m = (np.int32(b[i, base + j + 4]) >> 4) | ((np.int32(b[i, base + j]) >> 6) << 4)
    return sc, m


@njit(cache=True, nogil=True)
def q2_k(b, y):
    n16 = y.shape[1] // 16
    for i in range(b.shape[0]):
        d = load_f16(b, i, 80)
        dmin = load_f16(b, i, 82)
        for h in range(2):
            for s in range(4):
                shift = 2 * s
                for half in range(2):
                    sc = np.int32(b[i, 8 * h + 2 * s + half])
                    dl = d * np.float32(sc & 0xF)
                    ml = dmin * np.float32(sc >> 4)
                    dst = 128 * h + 32 * s + 16 * half
                    src = 16 + 32 * h + 16 * half
                    for l in range(n16):
                        y[i, dst + l] = dl * np.float32((np.int32(b[i, src + l]) >> shift) & 3) - ml


@njit(cache=True)
def _q3_k_scale(b, i, k):
    """Q3_K's 6-bit scale k (0..15) unpacked from the 12 bytes at 96, as ggml's kmask shuffle does."""
    g = k // 4
    r = k % 4
    low = (np.int32(b[i, 96 + (g % 2) * 4 + r]) >> (4 * (g // 2))) & 0xF
    high = (np.int32(b[i, 96 + 8 + r]) >> (2 * g)) & 3
    return low | (high << 4)


@njit(cache=True, nogil=True)
def q3_k(b, y):
    n16 = y.shape[1] // 16
    for i in range(b.shape[0]):
        d_all = load_f16(b, i, 108)
        for h in range(2):
            for s in range(4):
                shift = 2 * s
                mask = 1 << (4 * h + s)
                for half in range(2):
                    dl = d_all * np.float32(_q3_k_scale(b, i, 8 * h + 2 * s + half) - 32)
                    dst = 128 * h + 32 * s + 16 * half
                    src = 32 + 32 * h + 16 * half
                    for l in range(n16):
                        lo = (np.int32(b[i, src + l]) >> shift) & 3
                        hi = 0 if np.int32(b[i, 16 * half + l]) & mask else 4
                        y[i, dst + l] = dl * np.float32(lo - hi)


@njit(cache=True, nogil=True)
def q4_k(b, y):
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        dmin = load_f16(b, i, 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, i, 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, i, 4, 2 * c + 1)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            d2 = d * np.float32(sc2)
            dm2 = dmin * np.float32(m2)
            for l in range(32):
                q = np.int32(b[i, 16 + 32 * c + l])
                y[i, 64 * c + l] = d1 * np.float32(q & 0xF) - dm1
                y[i, 64 * c + 32 + l] = d2 * np.float32(q >> 4) - dm2


@njit(cache=True, nogil=True)
def q5_k(b, y):
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        dmin = load_f16(b, i, 2)
        for c in range(4):
            sc1, m1 = _scale_min_k4(b, i, 4, 2 * c)
            sc2, m2 = _scale_min_k4(b, i, 4, 2 * c + 1)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            d2 = d * np.float32(sc2)
            dm2 = dmin * np.float32(m2)
            for l in range(32):
                q = np.int32(b[i, 48 + 32 * c + l])
                qh = np.int32(b[i, 16 + l]) >> (2 * c)
                y[i, 64 * c + l] = d1 * np.float32((q & 0xF) + ((qh & 1) << 4)) - dm1
                y[i, 64 * c + 32 + l] = d2 * np.float32((q >> 4) + ((qh & 2) << 3)) - dm2


@njit(cache=True, nogil=True)
def q6_k(b, y):
    sc = b.view(np.int8)
    for i in range(b.shape[0]):
        d = load_f16(b, i, 208)
        for h in range(2):
            for k in range(4):
                for l in range(32):
                    low = (np.int32(b[i, 64 * h + 32 * (k % 2) + l]) >> (4 * (k // 2))) & 0xF
                    high = (np.int32(b[i, 128 + 32 * h + l]) >> (2 * k)) & 3
                    q = (low | (high << 4)) - 32
                    scale = d * np.float32(sc[i, 192 + 8 * h + 2 * k + l // 16])
                    y[i, 128 * h + 32 * k + l] = scale * np.float32(q)
