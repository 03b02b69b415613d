"""numba decoders for the element types and the block types without grids or K-quant scale packing.

Each kernel takes ``b: uint8[n_blocks, type_size]`` and writes ``y: float32[n_blocks, block_size]``, parallel
over blocks (F16 and BF16 take the flat ``uint16`` view and a flat ``y``).  Layouts (byte offsets inside one
block; halves are little-endian IEEE f16):

- F16: one half.  BF16: one bfloat16, decoded as ``bits << 16`` (ggml_bf16_to_fp32; NaN payloads kept).
- Q4_0 (18 B): d f16 @0, qs[16] @2; weight j = low nibble of qs[j], weight j+16 = high nibble; ``(q - 8) * d``.
- Q4_1 (20 B): d @0, m @2, qs[16] @4; ``q * d + m``.
- Q5_0 (22 B): d @0, qh u32 @2, qs[16] @6; bit j of qh is the 5th bit of weight j; ``(q - 16) * d``.
- Q5_1 (24 B): d @0, m @2, qh u32 @4, qs[16] @8; ``q * d + m``.
- Q8_0 (34 B): d @0, int8 qs[32] @2; ``q * d``.
- Q1_0 (18 B, 128 weights): d @0, qs[16] @2; bit j%8 of qs[j/8] set gives d, clear gives -d.
- Q8_K (292 B, 256 weights): d f32 @0, int8 qs[256] @4, then int16 bsums (unused); ``d * q``.
- TQ1_0 (54 B): qs[48] @0 (base-3 digits packed 5 per byte as ceil(v * 256 / 243)), qh[4] @48 (4 per byte),
  d f16 @52; digit n of byte x is ``((x * 3^n mod 256) * 3) >> 8``; weight ``(digit - 1) * d``.
- TQ2_0 (66 B): qs[64] @0 (2 bits each), d @64; ``(q - 1) * d``.
- IQ4_NL (18 B): d @0, qs[16] @2, nibble -> kvalues_iq4nl; ``d * kvalue``.
- IQ4_XS (136 B, 256 weights): d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; 6-bit sub-block scale
  ``ls = nibble(scales_l) | 2 bits(scales_h) << 4``, ``(d * (ls - 32)) * kvalue``.
- MXFP4 (17 B): E8M0 e @0, qs[16] @1; ``kvalue_e2m1x2 * 2^(e-128)``.
- NVFP4 (36 B, 64 weights): UE4M3 d[4] @0 (one per 16), qs[32] @4; in each 16-group byte j holds weight j
  (low nibble) and j+8 (high); ``kvalue_e2m1x2 * ue4m3(d)/2``.

Loop trip counts are read from ``y.shape`` at run time on purpose: with literal counts LLVM unrolls the short
inner loops completely and, unable to prove that ``y`` and ``b`` do not overlap, leaves them scalar; with a
runtime count it vectorizes them behind one overlap check (4-5x faster).

Rounding: every product here is exact in float32 (an 11-bit f16 mantissa times at most 8 more bits, or an E2M1
value times a power of two), except Q8_K's f32 ``d * q``, which is one correctly rounded multiply as in ggml.
Sums (Q4_1/Q5_1 ``q * d + m``) are one rounded add after an exact product, so fused multiply-add or not cannot
change a bit.  Operand order still follows ggml.  Only with non-finite scales can a NaN's payload differ from
ggml's (C leaves the operand order of ``+`` to the compiler; ggml and gguf-py differ there too).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dequant_scalars import (e8m0_to_f32_half, f16_to_f32, f32_from_bits, load_f16, load_u16, load_u32,
                              ue4m3_to_f32_half)

@njit(cache=True, nogil=True)
def f16(h, y):
    """F16 on flat arrays: ``h: uint16[n]`` (the blocks viewed as halves), ``y: float32[n]``."""
    for i in range(h.shape[0]):
        y[i] = f16_to_f32(h[i])


@njit(cache=True, nogil=True)
def bf16(h, y):
    """BF16 on flat arrays: ``h: uint16[n]``, ``y: float32[n]``."""
    for i in range(h.shape[0]):
        y[i] = f32_from_bits(np.uint32(np.uint32(h[i]) << np.uint32(16)))


@njit(cache=True, nogil=True)
def q4_0(b, y):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for j in range(half):
            q = np.int32(b[i, 2 + j])
            y[i, j] = np.float32((q & 0xF) - 8) * d
            y[i, j + half] = np.float32((q >> 4) - 8) * d


@njit(cache=True, nogil=True)
def q4_1(b, y):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        m = load_f16(b, i, 2)
        for j in range(half):
            q = np.int32(b[i, 4 + j])
            y[i, j] = np.float32(q & 0xF) * d + m
            y[i, j + half] = np.float32(q >> 4) * d + m


@njit(cache=True, nogil=True)
def q5_0(b, y):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        qh = load_u32(b, i, 2)
        for j in range(half):
            q = np.int32(b[i, 6 + j])
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            y[i, j] = np.float32(((q & 0xF) | h0) - 16) * d
            y[i, j + half] = np.float32(((q >> 4) | h1) - 16) * d


@njit(cache=True, nogil=True)
def q5_1(b, y):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        m = load_f16(b, i, 2)
        qh = load_u32(b, i, 4)
        for j in range(half):
            q = np.int32(b[i, 8 + j])
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            y[i, j] = np.float32((q & 0xF) | h0) * d + m
            y[i, j + half] = np.float32((q >> 4) | h1) * d + m


@njit(cache=True, nogil=True)
def q8_0(b, y):
    s = b.view(np.int8)
    qk = y.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for j in range(qk):
            y[i, j] = np.float32(s[i, 2 + j]) * d


@njit(cache=True, nogil=True)
def q1_0(b, y):
    qk = y.shape[1]
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        neg_d = -d
        for j in range(qk):
            y[i, j] = d if (b[i, 2 + j // 8] >> (j % 8)) & 1 else neg_d


@njit(cache=True, nogil=True)
def q8_k(b, y):
    s = b.view(np.int8)
    qk = y.shape[1]
    for i in range(b.shape[0]):
        d = f32_from_bits(load_u32(b, i, 0))
        for j in range(qk):
            y[i, j] = d * np.float32(s[i, 4 + j])


@njit(cache=True)
def _trit(x, pow3):
    """The base-3 digit of a TQ1_0 byte picked by ``pow3`` = 3^n, minus one: ((x * 3^n mod 256) * 3) >> 8."""
    q = (np.int32(x) * pow3) & 0xFF
    return np.float32(((q * 3) >> 8) - 1)


@njit(cache=True, nogil=True)
def tq1_0(b, y):
    n32 = y.shape[1] // 8
    for i in range(b.shape[0]):
        d = load_f16(b, i, 52)
        for n in range(5):
            pow3 = 3 ** n
            for m in range(n32):
                y[i, n * 32 + m] = _trit(b[i, m], pow3) * d
        for n in range(5):
            pow3 = 3 ** n
            for m in range(n32 // 2):
                y[i, 160 + n * 16 + m] = _trit(b[i, 32 + m], pow3) * d
        for n in range(4):
            pow3 = 3 ** n
            for j in range(n32 // 8):
                y[i, 240 + n * 4 + j] = _trit(b[i, 48 + j], pow3) * d


@njit(cache=True, nogil=True)
def tq2_0(b, y):
    n32 = y.shape[1] // 8
    for i in range(b.shape[0]):
        d = load_f16(b, i, 64)
        for h in range(2):
            for shift in range(4):
                for m in range(n32):
                    q = (np.int32(b[i, 32 * h + m]) >> (2 * shift)) & 3
                    y[i, 128 * h + 32 * shift + m] = np.float32(q - 1) * d


@njit(cache=True, nogil=True)
def iq4_nl(b, y, kvalues):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        for j in range(half):
            q = b[i, 2 + j]
            y[i, j] = d * kvalues[q & 0xF]
            y[i, j + half] = d * kvalues[q >> 4]


@njit(cache=True, nogil=True)
def iq4_xs(b, y, kvalues):
    n16 = y.shape[1] // 16
    for i in range(b.shape[0]):
        d = load_f16(b, i, 0)
        scales_h = load_u16(b, i, 2)
        for ib in range(8):
            ls = ((np.int32(b[i, 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) \
                | (np.int32((scales_h >> np.uint32(2 * ib)) & np.uint32(3)) << 4)
            dl = d * np.float32(ls - 32)
            for j in range(n16):
                q = b[i, 8 + 16 * ib + j]
                y[i, 32 * ib + j] = dl * kvalues[q & 0xF]
                y[i, 32 * ib + 16 + j] = dl * kvalues[q >> 4]


@njit(cache=True, nogil=True)
def mxfp4(b, y, kvalues):
    half = y.shape[1] // 2
    for i in range(b.shape[0]):
        d = e8m0_to_f32_half(b[i, 0])
        for j in range(half):
            q = b[i, 1 + j]
            y[i, j] = kvalues[q & 0xF] * d
            y[i, j + half] = kvalues[q >> 4] * d


@njit(cache=True, nogil=True)
def nvfp4(b, y, kvalues):
    n8 = y.shape[1] // 8
    for i in range(b.shape[0]):
        for s in range(4):
            d = ue4m3_to_f32_half(b[i, s])
            for j in range(n8):
                q = b[i, 4 + 8 * s + j]
                y[i, 16 * s + j] = kvalues[q & 0xF] * d
                y[i, 16 * s + 8 + j] = kvalues[q >> 4] * d
