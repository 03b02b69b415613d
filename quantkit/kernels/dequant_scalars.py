"""Scalar pieces shared by the numba decoders: bit casts, ggml's scale conversions, little-endian loads, tables.

Every conversion here is exact and mirrors ggml (``ggml-impl.h``) bit for bit:

- ``f16_to_f32``: ``ggml_compute_fp16_to_fp32`` (the tests check all 65536 halves against ggml).  Normal halves
  are re-biased in the integer domain and scaled by 2^-112 (an exact float multiply); subnormals OR their
  10 mantissa bits into 0.5 and subtract 0.5 (= m * 2^-24, exact).  Inf stays inf; a NaN comes out of the
  multiply quieted, as it does in ggml on x86.
- ``e8m0_to_f32_half``: ``ggml_e8m0_to_fp32_half``, 2^(e-128) built from bits; e < 2 gives the subnormals
  2^-128 and 2^-127; 0xFF gives 2^127 (ggml does not map it to NaN, nor does gguf-py).
- ``ue4m3_to_f32_half``: ``ggml_ue4m3_to_fp32``: 0 and 0x7F give 0; exponent field 0 gives man * 2^-9, else
  (1 + man/8) * 2^(exp-7); the result is halved to match the doubled E2M1 table.  Bit 7 is ignored.  Every
  step is exact in float32, so computing it with float32 multiplies equals ggml's ``ldexpf``.

Tables are never retyped: they come from gguf-py's ``gguf.quants`` classes (the grids through the classes' own
``init_grid`` unpacking), the one source the encoders use too.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as gq
from numba import njit

_F16_EXP_OFFSET = np.uint32(0xE0 << 23)        # re-bias a half's exponent field (15) to float's (127) minus 112
_F16_EXP_SCALE = np.float32(2.0 ** -112)       # undoes the 112 kept out of the re-bias (and quiets NaN)
_F16_MAGIC_MASK = np.uint32(126 << 23)         # 0.5 as a float; OR-ing the mantissa gives 0.5 + m * 2^-24
_F16_MAGIC_BIAS = np.float32(0.5)
_F16_DENORMAL_CUTOFF = np.uint32(1 << 27)      # two_w below this: exponent field 0 (subnormal or zero)
_TWO_POW_M9 = np.float32(2.0 ** -9)
_ONE_EIGHTH = np.float32(0.125)
_HALF = np.float32(0.5)


@njit(cache=True)
def f32_from_bits(bits):
    """Reinterpret 32 bits as float32 (no conversion)."""
    return np.uint32(bits).view(np.float32)


@njit(cache=True)
def f32_to_bits(value):
    """Reinterpret a float32 as its 32 bits."""
    return np.float32(value).view(np.uint32)


@njit(cache=True)
def f16_to_f32(h):
    """ggml_compute_fp16_to_fp32 on the half whose bits are ``h`` (any unsigned int holding 16 bits)."""
    w = np.uint32(h) << np.uint32(16)
    sign = w & np.uint32(0x80000000)
    two_w = np.uint32((np.uint64(h) << np.uint64(17)) & np.uint64(0xFFFFFFFF))
    normalized = f32_from_bits(np.uint32((two_w >> np.uint32(4)) + _F16_EXP_OFFSET)) * _F16_EXP_SCALE
    denormalized = f32_from_bits(np.uint32((two_w >> np.uint32(17)) | _F16_MAGIC_MASK)) - _F16_MAGIC_BIAS
    magnitude = f32_to_bits(denormalized) if two_w < _F16_DENORMAL_CUTOFF else f32_to_bits(normalized)
    return f32_from_bits(sign | magnitude)


@njit(cache=True)
def load_u16(b, i, k):
    return np.uint32(np.uint32(b[i, k]) | (np.uint32(b[i, k + 1]) << np.uint32(8)))


@njit(cache=True)
def load_u32(b, i, k):
    return np.uint32(np.uint32(b[i, k]) | (np.uint32(b[i, k + 1]) << np.uint32(8))
                     | (np.uint32(b[i, k + 2]) << np.uint32(16)) | (np.uint32(b[i, k + 3]) << np.uint32(24)))


@njit(cache=True)
def load_f16(b, i, k):
    """The little-endian half at bytes k, k+1 of block row i, as float32."""
    return f16_to_f32(load_u16(b, i, k))


@njit(cache=True)
def e8m0_to_f32_half(e):
    """ggml_e8m0_to_fp32_half: 2^(e-128) from its bits."""
    if e < 2:
        return f32_from_bits(np.uint32(0x00200000) << np.uint32(e))
    return f32_from_bits(np.uint32(e - 1) << np.uint32(23))


@njit(cache=True)
def ue4m3_to_f32_half(x):
    """ggml_ue4m3_to_fp32: unsigned E4M3 (bias 7) times 0.5."""
    if x == 0 or x == 0x7F:
        return np.float32(0.0)
    exp = (np.int32(x) >> 3) & 0xF
    man = np.float32(np.int32(x) & 0x7)
    if exp == 0:
        raw = man * _TWO_POW_M9
    else:
        # 2^(exp-7) for exp in 1..15 is a normal float: build it from bits (exact, like ldexpf)
        pow2 = f32_from_bits(np.uint32(exp + 120) << np.uint32(23))
        raw = (np.float32(1.0) + man * _ONE_EIGHTH) * pow2
    return raw * _HALF


def _grid(cls) -> np.ndarray:
    """gguf-py's grid for an IQ class as float32[n_entries, entry_len] (its own hex unpacking)."""
    cls.init_grid()
    return np.ascontiguousarray(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape))


KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # 7-bit sign code -> 8 sign bits, even parity
KVALUES_IQ4NL = np.asarray(gq.IQ4_NL.kvalues, dtype=np.float32)  # non-linear 4-bit levels
KVALUES_E2M1X2 = np.asarray(gq.MXFP4.kvalues, dtype=np.float32)  # E2M1 doubled; ggml uses it for NVFP4 too
IQ1S_DELTA = np.float32(gq.IQ1_S.delta)
GRID_IQ2XXS = _grid(gq.IQ2_XXS)
GRID_IQ2XS = _grid(gq.IQ2_XS)
GRID_IQ2S = _grid(gq.IQ2_S)
GRID_IQ3XXS = _grid(gq.IQ3_XXS)
GRID_IQ3S = _grid(gq.IQ3_S)
GRID_IQ1S = _grid(gq.IQ1_S)                                            # IQ1_M uses the same grid
