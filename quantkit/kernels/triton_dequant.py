"""Triton dequantization kernels (CUDA), bit-identical to the numba decoders of :mod:`quantkit.kernels.dequant`.

:func:`dequantize` turns a CUDA ``uint8`` tensor holding whole blocks of one GGML type into a ``float32`` tensor
of ``n_blocks * block_size`` values.  Types in :data:`TRITON_TYPES` run here; the caller decodes the others on the
CPU (:func:`quantkit.formats.api.decode`).  This module imports torch and triton, so it is imported only by the
CUDA path of :mod:`quantkit.runtime`.

Layouts and formulas are the ones documented in ``dequant_simple``, ``dequant_kquants`` and ``dequant_iq`` (same
byte offsets, same operand order); the tables (IQ grids, sign codes, non-linear levels) are the same arrays
(:mod:`quantkit.kernels.dequant_scalars`), copied to the device once.  Each program decodes a tile of whole blocks,
``[blocks, sub-blocks, values]``, so scale bytes are loaded once per sub-block and broadcast; the grid i-quants
use tiles of grid rows instead (see there).

Bit-identity: every product these formulas take is exact in float32 (see the numba modules' rounding notes), so
the one rounded operation per value (the final ``- dmin * m`` of Q2_K/Q4_K/Q5_K, ``+ m`` of Q4_1/Q5_1) gives the
same bits whether or not the compiler fuses it into an FMA.  Halves are converted by the hardware's f16 -> f32
conversion, which is exact; E8M0 and UE4M3 scales are built from bits as in ggml.  Only NaN payloads may differ
from the CPU decoders (the positions of NaN do not), as they differ between ggml and gguf-py.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType

from ..errors import FormatError
from .dequant_scalars import (GRID_IQ1S, GRID_IQ2S, GRID_IQ2XS, GRID_IQ2XXS, GRID_IQ3S, GRID_IQ3XXS, IQ1S_DELTA,
                              KSIGNS, KVALUES_E2M1X2, KVALUES_IQ4NL)

#: Output values per program: tiles of 4096 floats (16 KiB of stores) keep enough bytes in flight per SM.
VALUES_PER_PROGRAM = 4096
#: Halves (F16/BF16) per program of the flat kernel.
HALVES_PER_PROGRAM = 8192
NUM_WARPS = 4
#: Grid rows per program of the grid i-quant kernels, and their warps (best of a sweep on the H200).
GRID_ROWS_PER_PROGRAM = 256
GRID_NUM_WARPS = 8


# -- scalar helpers ---------------------------------------------------------------------------------------------

@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian half at ``ptr`` as float32 (exact)."""
    bits = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32(ptr, mask):
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _sign(signs, j):
    """+1.0 or -1.0 from bit ``j`` of ``signs``, as ggml multiplies."""
    return tl.where(((signs >> j) & 1) != 0, -1.0, 1.0)


@triton.jit
def _tile(BPP: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr, n_blocks):
    """Block index [BPP,1,1], sub-block [1,NSUB,1], value-in-sub-block [1,1,SUB], block mask [BPP,1,1]."""
    blk = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP).to(tl.int64)[:, None, None]
    sub = tl.arange(0, NSUB)[None, :, None]
    val = tl.arange(0, SUB)[None, None, :]
    return blk, sub, val, blk < n_blocks


@triton.jit
def _store(dst, blk, sub, val, y, mask, NSUB: tl.constexpr, SUB: tl.constexpr):
    tl.store(dst + blk * (NSUB * SUB) + sub * SUB + val, y, mask=mask)


# -- element types ----------------------------------------------------------------------------------------------

@triton.jit
def _f16_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(src + offs, mask=mask, other=0)
    tl.store(dst + offs, h.to(tl.float16, bitcast=True).to(tl.float32), mask=mask)


@triton.jit
def _bf16_bits(h):
    """bfloat16 bits (any integer type, low 16 bits) as float32: the bits shifted into the high half (exact)."""
    return ((h.to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(src + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
    tl.store(dst + offs, _bf16_bits(h), mask=mask)


@triton.jit
def f32_values(base, one, j, m):
    """Value ``j`` of 32 consecutive float32 values at byte address ``base`` (the fused products' 128-byte
    pseudo-block of F32 rows; :func:`dequantize` reinterprets F32 bytes instead)."""
    return _u32(base + 4 * j, m).to(tl.float32, bitcast=True)


@triton.jit
def bf16_values(base, one, j, m):
    """Value ``j`` of 32 consecutive bfloat16 values at byte address ``base`` (the fused products' 64-byte
    pseudo-block of BF16 rows)."""
    return _bf16_bits(_u8(base + 2 * j, m) | (_u8(base + 2 * j + 1, m) << 8))


# -- 32-value legacy blocks: weight j < 16 is the low nibble of qs[j], weight j + 16 the high one ----------------

@triton.jit
def _q4_0_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    base = src + blk * 18
    d = _f16(base, m)
    q = (_u8(base + 2 + j, m) >> (4 * half)) & 0xF
    _store(dst, blk, half, j, (q - 8).to(tl.float32) * d, m, 2, 16)


@triton.jit
def _q4_1_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    base = src + blk * 20
    d = _f16(base, m)
    mn = _f16(base + 2, m)
    q = (_u8(base + 4 + j, m) >> (4 * half)) & 0xF
    _store(dst, blk, half, j, q.to(tl.float32) * d + mn, m, 2, 16)


@triton.jit
def _q5_0_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    base = src + blk * 22
    d = _f16(base, m)
    qh = _u32(base + 2, m)
    h = (((qh >> (j + 16 * half).to(tl.uint32)) & 1) << 4).to(tl.int32)
    q = ((_u8(base + 6 + j, m) >> (4 * half)) & 0xF) | h
    _store(dst, blk, half, j, (q - 16).to(tl.float32) * d, m, 2, 16)


@triton.jit
def _q5_1_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    base = src + blk * 24
    d = _f16(base, m)
    mn = _f16(base + 2, m)
    qh = _u32(base + 4, m)
    h = (((qh >> (j + 16 * half).to(tl.uint32)) & 1) << 4).to(tl.int32)
    q = ((_u8(base + 8 + j, m) >> (4 * half)) & 0xF) | h
    _store(dst, blk, half, j, q.to(tl.float32) * d + mn, m, 2, 16)


# Each ``*_values(base, sub, val, mask, ...)`` below decodes value ``val`` of sub-tile ``sub`` of the block at byte
# address ``base`` (broadcast shapes); the dequantization kernels store them, the fused products of
# :mod:`.triton_matmul` multiply them, so both hold the same bits.

@triton.jit
def q8_0_values(base, one, j, m):
    d = _f16(base, m)
    q = tl.load(base + 2 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return q * d


@triton.jit
def _q8_0_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, one, j, m = _tile(BPP, 1, 32, n_blocks)
    _store(dst, blk, one, j, q8_0_values(src + blk * 34, one, j, m), m, 1, 32)


@triton.jit
def _iq4_nl_kernel(src, dst, n_blocks, kvalues, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    base = src + blk * 18
    d = _f16(base, m)
    q = (_u8(base + 2 + j, m) >> (4 * half)) & 0xF
    _store(dst, blk, half, j, d * tl.load(kvalues + q), m, 2, 16)


@triton.jit
def _e8m0_half(e):
    """ggml_e8m0_to_fp32_half from the bits: 2^(e-128), subnormal for e < 2."""
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_values(base, half, j, m, kvalues):
    d = _e8m0_half(_u8(base, m))
    q = (_u8(base + 1 + j, m) >> (4 * half)) & 0xF
    return tl.load(kvalues + q) * d


@triton.jit
def _mxfp4_kernel(src, dst, n_blocks, kvalues, BPP: tl.constexpr):
    blk, half, j, m = _tile(BPP, 2, 16, n_blocks)
    _store(dst, blk, half, j, mxfp4_values(src + blk * 17, half, j, m, kvalues), m, 2, 16)


@triton.jit
def _ue4m3_half(x):
    """ggml_ue4m3_to_fp32 (halved): 0 and 0x7F give 0, exponent 0 gives man * 2^-9, else (1 + man/8) * 2^(e-7)."""
    exp = (x >> 3) & 0xF
    man = (x & 7).to(tl.float32)
    pow2 = ((exp + 120) << 23).to(tl.int32).to(tl.float32, bitcast=True)
    raw = tl.where(exp == 0, man * 0.001953125, (1.0 + man * 0.125) * pow2)
    return tl.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)


@triton.jit
def nvfp4_values(base, s, v, m, kvalues):
    # four 16-value groups; in group s byte 4 + 8s + j holds value j (low nibble) and j + 8 (high nibble)
    d = _ue4m3_half(_u8(base + s, m))
    q = (_u8(base + 4 + 8 * s + (v % 8), m) >> (4 * (v // 8))) & 0xF
    return tl.load(kvalues + q) * d


@triton.jit
def _nvfp4_kernel(src, dst, n_blocks, kvalues, BPP: tl.constexpr):
    blk, s, v, m = _tile(BPP, 4, 16, n_blocks)
    _store(dst, blk, s, v, nvfp4_values(src + blk * 36, s, v, m, kvalues), m, 4, 16)


# -- K-quants (256-value super-blocks) ----------------------------------------------------------------------------

@triton.jit
def q2_k_values(base, sb, e, m):
    # sub-block sb of 16 values = 8h + 2s + half
    d = _f16(base + 80, m)
    dmin = _f16(base + 82, m)
    h = sb // 8
    shift = 2 * ((sb % 8) // 2)
    sc = _u8(base + sb, m)
    q = (_u8(base + 16 + 32 * h + 16 * (sb % 2) + e, m) >> shift) & 3
    dl = d * (sc & 0xF).to(tl.float32)
    ml = dmin * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q2_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, sb, e, m = _tile(BPP, 16, 16, n_blocks)
    _store(dst, blk, sb, e, q2_k_values(src + blk * 84, sb, e, m), m, 16, 16)


@triton.jit
def _q3_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, sb, e, m = _tile(BPP, 16, 16, n_blocks)
    base = src + blk * 110
    d_all = _f16(base + 108, m)
    h = sb // 8
    s = (sb % 8) // 2
    half = sb % 2
    g = sb // 4
    r = sb % 4
    low = (_u8(base + 96 + (g % 2) * 4 + r, m) >> (4 * (g // 2))) & 0xF
    high = (_u8(base + 96 + 8 + r, m) >> (2 * g)) & 3
    dl = d_all * ((low | (high << 4)) - 32).to(tl.float32)
    lo = (_u8(base + 32 + 32 * h + 16 * half + e, m) >> (2 * s)) & 3
    hi = tl.where((_u8(base + 16 * half + e, m) & (1 << (4 * h + s))) != 0, 0, 4)
    _store(dst, blk, sb, e, dl * (lo - hi).to(tl.float32), m, 16, 16)


@triton.jit
def _scale_min_k4(base, sb, m):
    """ggml's get_scale_min_k4 for sub-block ``sb`` (0..7) of the 12 scale bytes at ``base``."""
    a = _u8(base + sb, m)
    b = _u8(base + sb + 4, m)
    c = _u8(base + tl.where(sb >= 4, sb - 4, sb), m)
    sc = tl.where(sb < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(sb < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def q4_k_values(base, sb, l, m):
    # sub-block sb = 2c + t of 32 values
    d = _f16(base, m)
    dmin = _f16(base + 2, m)
    sc, mn = _scale_min_k4(base + 4, sb, m)
    q = (_u8(base + 16 + 32 * (sb // 2) + l, m) >> (4 * (sb % 2))) & 0xF
    d1 = d * sc.to(tl.float32)
    dm1 = dmin * mn.to(tl.float32)
    return d1 * q.to(tl.float32) - dm1


@triton.jit
def _q4_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, sb, l, m = _tile(BPP, 8, 32, n_blocks)
    _store(dst, blk, sb, l, q4_k_values(src + blk * 144, sb, l, m), m, 8, 32)


@triton.jit
def _q5_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, sb, l, m = _tile(BPP, 8, 32, n_blocks)
    base = src + blk * 176
    d = _f16(base, m)
    dmin = _f16(base + 2, m)
    sc, mn = _scale_min_k4(base + 4, sb, m)
    q = (_u8(base + 48 + 32 * (sb // 2) + l, m) >> (4 * (sb % 2))) & 0xF
    q = q + (((_u8(base + 16 + l, m) >> sb) & 1) << 4)
    d1 = d * sc.to(tl.float32)
    dm1 = dmin * mn.to(tl.float32)
    _store(dst, blk, sb, l, d1 * q.to(tl.float32) - dm1, m, 8, 32)


@triton.jit
def _q6_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    blk, sb, e, m = _tile(BPP, 16, 16, n_blocks)   # sub-block sb = 8h + 2k + half
    base = src + blk * 210
    d = _f16(base + 208, m)
    h = sb // 8
    k = (sb % 8) // 2
    l = 16 * (sb % 2) + e
    low = (_u8(base + 64 * h + 32 * (k % 2) + l, m) >> (4 * (k // 2))) & 0xF
    high = (_u8(base + 128 + 32 * h + l, m) >> (2 * k)) & 3
    q = (low | (high << 4)) - 32
    sc = tl.load(base + 192 + sb, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    _store(dst, blk, sb, e, (d * sc) * q.to(tl.float32), m, 16, 16)


@triton.jit
def _iq4_xs_kernel(src, dst, n_blocks, kvalues, BPP: tl.constexpr):
    blk, ib, e, m = _tile(BPP, 8, 32, n_blocks)
    base = src + blk * 136
    d = _f16(base, m)
    scales_h = _u8(base + 2, m) | (_u8(base + 3, m) << 8)
    ls = ((_u8(base + 4 + ib // 2, m) >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).to(tl.float32)
    q = (_u8(base + 8 + 16 * ib + (e % 16), m) >> (4 * (e // 16))) & 0xF
    _store(dst, blk, ib, e, dl * tl.load(kvalues + q), m, 8, 32)


# -- grid i-quants ---------------------------------------------------------------------------------------------------
# 2-D tiles of grid rows ([NR rows, W values]; W = 8, or 4 for IQ3): the grid index, sign code and scales are
# per-row quantities, and each row's W values are one contiguous gather from the grid table and one contiguous store.
# (Measured on the H200: 3-D [blocks, sub-blocks, 32] tiles with per-value lookups reach ~0.5-0.67 of a copy's
# bandwidth, these 0.8-0.87.)

@triton.jit
def _rowtile(NR: tl.constexpr, W: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr, n_blocks):
    """Block [NR,1], row within the block [NR,1], value within the row [1,W], mask, flat output offsets."""
    r = tl.program_id(0).to(tl.int64) * NR + tl.arange(0, NR).to(tl.int64)[:, None]
    val = tl.arange(0, W)[None, :]
    return r // ROWS_PER_BLOCK, (r % ROWS_PER_BLOCK).to(tl.int32), val, r // ROWS_PER_BLOCK < n_blocks, r * W + val


@triton.jit
def iq2_xxs_values(base, row_in_block, jj, m, grid, ksigns):
    ib = row_in_block // 4
    l = row_in_block % 4
    d = _f16(base, m)
    aux1 = _u32(base + 2 + 8 * ib + 4, m)
    db = d * (0.5 + (aux1 >> 28).to(tl.float32)) * 0.25
    row = _u8(base + 2 + 8 * ib + l, m)
    signs = tl.load(ksigns + ((aux1 >> (7 * l).to(tl.uint32)) & 127)).to(tl.int32)
    return db * tl.load(grid + row * 8 + jj) * _sign(signs, jj)


@triton.jit
def _iq2_xxs_kernel(src, dst, n_blocks, grid, ksigns, NR: tl.constexpr):
    blk, row_in_block, jj, m, out = _rowtile(NR, 8, 32, n_blocks)
    tl.store(dst + out, iq2_xxs_values(src + blk * 66, row_in_block, jj, m, grid, ksigns), mask=m)


@triton.jit
def _iq2_xs_kernel(src, dst, n_blocks, grid, ksigns, NR: tl.constexpr):
    blk, row_in_block, jj, m, out = _rowtile(NR, 8, 32, n_blocks)
    ib = row_in_block // 4
    l = row_in_block % 4
    base = src + blk * 74
    d = _f16(base, m)
    sc = _u8(base + 66 + ib, m)
    dl = d * (0.5 + tl.where(l < 2, sc & 0xF, sc >> 4).to(tl.float32)) * 0.25
    q = _u8(base + 2 + 2 * (4 * ib + l), m) | (_u8(base + 3 + 2 * (4 * ib + l), m) << 8)
    signs = tl.load(ksigns + (q >> 9)).to(tl.int32)
    tl.store(dst + out, dl * tl.load(grid + (q & 511) * 8 + jj) * _sign(signs, jj), mask=m)


@triton.jit
def _iq2_s_kernel(src, dst, n_blocks, grid, NR: tl.constexpr):
    blk, row_in_block, jj, m, out = _rowtile(NR, 8, 32, n_blocks)
    ib = row_in_block // 4
    l = row_in_block % 4
    base = src + blk * 82
    d = _f16(base, m)
    sc = _u8(base + 74 + ib, m)
    dl = d * (0.5 + tl.where(l < 2, sc & 0xF, sc >> 4).to(tl.float32)) * 0.25
    qh = _u8(base + 66 + ib, m)
    row = _u8(base + 2 + 4 * ib + l, m) | ((qh << (8 - 2 * l)) & 0x300)
    signs = _u8(base + 34 + 4 * ib + l, m)
    tl.store(dst + out, dl * tl.load(grid + row * 8 + jj) * _sign(signs, jj), mask=m)


@triton.jit
def _iq3_xxs_kernel(src, dst, n_blocks, grid, ksigns, NR: tl.constexpr):
    # 4-wide grid rows, 64 per block: row r of sub-block ib holds values 4r..4r+3, sign bits 4(r % 2) + j4 of the
    # sign code of 8-value group r // 2
    blk, row_in_block, j4, m, out = _rowtile(NR, 4, 64, n_blocks)
    ib = row_in_block // 8
    r = row_in_block % 8
    base = src + blk * 98
    d = _f16(base, m)
    aux = _u32(base + 66 + 4 * ib, m)
    db = d * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    signs = tl.load(ksigns + ((aux >> (7 * (r // 2)).to(tl.uint32)) & 127)).to(tl.int32)
    row = _u8(base + 2 + 8 * ib + r, m)
    tl.store(dst + out, db * tl.load(grid + row * 4 + j4) * _sign(signs, 4 * (r % 2) + j4), mask=m)


@triton.jit
def _iq3_s_kernel(src, dst, n_blocks, grid, NR: tl.constexpr):
    blk, row_in_block, j4, m, out = _rowtile(NR, 4, 64, n_blocks)
    ib = row_in_block // 8
    r = row_in_block % 8
    l = r // 2
    base = src + blk * 110
    d = _f16(base, m)
    db = d * (1 + 2 * ((_u8(base + 106 + ib // 2, m) >> (4 * (ib % 2))) & 0xF)).to(tl.float32)
    qh = _u8(base + 66 + ib, m)
    row = _u8(base + 2 + 8 * ib + r, m) | ((qh << (8 - 2 * l - r % 2)) & 256)
    signs = _u8(base + 74 + 4 * ib + l, m)
    tl.store(dst + out, db * tl.load(grid + row * 4 + j4) * _sign(signs, 4 * (r % 2) + j4), mask=m)


@triton.jit
def _iq1_s_kernel(src, dst, n_blocks, grid, delta, NR: tl.constexpr):
    blk, row_in_block, jj, m, out = _rowtile(NR, 8, 32, n_blocks)
    ib = row_in_block // 4
    l = row_in_block % 4
    base = src + blk * 50
    d = _f16(base, m)
    qh = _u8(base + 34 + 2 * ib, m) | (_u8(base + 35 + 2 * ib, m) << 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    dt = tl.where((qh & 0x8000) != 0, -delta, delta)
    row = _u8(base + 2 + 4 * ib + l, m) | (((qh >> (3 * l)) & 7) << 8)
    tl.store(dst + out, dl * (tl.load(grid + row * 8 + jj) + dt), mask=m)


@triton.jit
def _iq1_m_kernel(src, dst, n_blocks, grid, delta, NR: tl.constexpr):
    blk, row_in_block, jj, m, out = _rowtile(NR, 8, 32, n_blocks)
    ib = row_in_block // 4
    l = row_in_block % 4
    base = src + blk * 56
    sc0 = _u8(base + 48, m) | (_u8(base + 49, m) << 8)
    sc1 = _u8(base + 50, m) | (_u8(base + 51, m) << 8)
    sc2 = _u8(base + 52, m) | (_u8(base + 53, m) << 8)
    sc3 = _u8(base + 54, m) | (_u8(base + 55, m) << 8)
    # the f16 super-block scale is spread over the top nibbles of the four scale words
    dbits = (sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00) | (sc3 & 0xF000)
    d = dbits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    s = _u8(base + 48 + 2 * (ib // 2), m) | (_u8(base + 49 + 2 * (ib // 2), m) << 8)
    dl = d * (2 * ((s >> (6 * (ib % 2) + 3 * (l // 2))) & 7) + 1).to(tl.float32)
    qh = _u8(base + 32 + 2 * ib + l // 2, m) >> (4 * (l % 2))
    dt = tl.where((qh & 0x08) != 0, -delta, delta)
    row = _u8(base + 4 * ib + l, m) | ((qh & 7) << 8)
    tl.store(dst + out, dl * (tl.load(grid + row * 8 + jj) + dt), mask=m)


# -- dispatch ------------------------------------------------------------------------------------------------------

_BLOCK_KERNELS = {
    GGMLType.Q4_0: (_q4_0_kernel, ()), GGMLType.Q4_1: (_q4_1_kernel, ()), GGMLType.Q5_0: (_q5_0_kernel, ()),
    GGMLType.Q5_1: (_q5_1_kernel, ()), GGMLType.Q8_0: (_q8_0_kernel, ()),
    GGMLType.IQ4_NL: (_iq4_nl_kernel, ("kvalues_iq4nl",)), GGMLType.MXFP4: (_mxfp4_kernel, ("kvalues_e2m1",)),
    GGMLType.NVFP4: (_nvfp4_kernel, ("kvalues_e2m1",)),
    GGMLType.Q2_K: (_q2_k_kernel, ()), GGMLType.Q3_K: (_q3_k_kernel, ()), GGMLType.Q4_K: (_q4_k_kernel, ()),
    GGMLType.Q5_K: (_q5_k_kernel, ()), GGMLType.Q6_K: (_q6_k_kernel, ()),
    GGMLType.IQ4_XS: (_iq4_xs_kernel, ("kvalues_iq4nl",)),
    GGMLType.IQ2_XXS: (_iq2_xxs_kernel, ("grid_iq2xxs", "ksigns")),
    GGMLType.IQ2_XS: (_iq2_xs_kernel, ("grid_iq2xs", "ksigns")),
    GGMLType.IQ2_S: (_iq2_s_kernel, ("grid_iq2s",)),
    GGMLType.IQ3_XXS: (_iq3_xxs_kernel, ("grid_iq3xxs", "ksigns")),
    GGMLType.IQ3_S: (_iq3_s_kernel, ("grid_iq3s",)),
    GGMLType.IQ1_S: (_iq1_s_kernel, ("grid_iq1s", "iq1s_delta")),
    GGMLType.IQ1_M: (_iq1_m_kernel, ("grid_iq1s", "iq1s_delta")),
}
_HALF_KERNELS = {GGMLType.F16: _f16_kernel, GGMLType.BF16: _bf16_kernel}

#: Types decoded on the GPU; F32 needs no kernel (its bytes are reinterpreted).
TRITON_TYPES = frozenset(_BLOCK_KERNELS) | frozenset(_HALF_KERNELS) | {GGMLType.F32}

#: Grid i-quants run on row tiles: values per grid row.
_GRID_ROW_WIDTH = {GGMLType.IQ2_XXS: 8, GGMLType.IQ2_XS: 8, GGMLType.IQ2_S: 8, GGMLType.IQ1_S: 8, GGMLType.IQ1_M: 8,
                   GGMLType.IQ3_XXS: 4, GGMLType.IQ3_S: 4}


_TABLES = {"kvalues_iq4nl": KVALUES_IQ4NL, "kvalues_e2m1": KVALUES_E2M1X2, "ksigns": KSIGNS,
           "grid_iq2xxs": GRID_IQ2XXS, "grid_iq2xs": GRID_IQ2XS, "grid_iq2s": GRID_IQ2S,
           "grid_iq3xxs": GRID_IQ3XXS, "grid_iq3s": GRID_IQ3S, "grid_iq1s": GRID_IQ1S}


@functools.lru_cache(maxsize=None)
def table(name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(_TABLES[name]).reshape(-1)).to(device)


def _table_args(names: tuple[str, ...], device: torch.device) -> list:
    return [float(IQ1S_DELTA) if name == "iq1s_delta" else table(name, device) for name in names]


def dequantize(data: torch.Tensor, qtype: "GGMLType | int", out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode the whole blocks in CUDA ``uint8`` tensor ``data`` to a new (or the given) flat float32 tensor."""
    qtype = GGMLType(int(qtype))
    if qtype not in TRITON_TYPES:
        raise FormatError(f"no Triton kernel for {qtype.name}; decode it on the CPU")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.dtype != torch.uint8 or not data.is_cuda:
        raise FormatError(f"{qtype.name} kernel expects a CUDA uint8 tensor, got {data.dtype} on {data.device}")
    flat = data.reshape(-1)
    if flat.numel() % type_size:
        raise FormatError(f"{qtype.name} payload of {flat.numel()} bytes is not a whole number of "
                          f"{type_size}-byte blocks")
    n_blocks = flat.numel() // type_size
    n_values = n_blocks * block_size
    if out is None:
        out = torch.empty(n_values, dtype=torch.float32, device=data.device)
    elif out.dtype != torch.float32 or out.numel() != n_values or not out.is_contiguous():
        raise FormatError(f"output must be a contiguous float32 tensor of {n_values} values")
    if n_values == 0:
        return out
    if qtype is GGMLType.F32:
        out.copy_(flat.view(torch.float32))
        return out
    if qtype in _HALF_KERNELS:
        grid = (triton.cdiv(n_values, HALVES_PER_PROGRAM),)
        _HALF_KERNELS[qtype][grid](flat.view(torch.int16), out, n_values, BLOCK=HALVES_PER_PROGRAM,
                                   num_warps=NUM_WARPS)
        return out
    kernel, tables = _BLOCK_KERNELS[qtype]
    tables = _table_args(tables, data.device)
    if qtype in _GRID_ROW_WIDTH:
        rows = n_blocks * (block_size // _GRID_ROW_WIDTH[qtype])
        kernel[(triton.cdiv(rows, GRID_ROWS_PER_PROGRAM),)](flat, out, n_blocks, *tables, NR=GRID_ROWS_PER_PROGRAM,
                                                             num_warps=GRID_NUM_WARPS)
        return out
    bpp = max(1, VALUES_PER_PROGRAM // block_size)
    kernel[(triton.cdiv(n_blocks, bpp),)](flat, out, n_blocks, *tables, BPP=bpp, num_warps=NUM_WARPS)
    return out
