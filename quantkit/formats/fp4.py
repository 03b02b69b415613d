"""FP4 block types MXFP4 and NVFP4 (the GGUF layouts) — byte-identical to ggml (``ggml-quants.c``).

Both store 4-bit E2M1 codes that index ``kvalues_mxfp4`` = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6,
-8, -12}: the E2M1 values doubled (taken from gguf-py's ``gguf.quants.MXFP4.kvalues``, never retyped), so the
decoded weight is ``kvalue · scale/2``.  The importance matrix is ignored by both.

- MXFP4 (17 bytes / 32 weights): E8M0 exponent byte ``e`` @0, qs[16] @1; byte j holds weight j (low nibble)
  and weight j+16 (high nibble); weight = ``kvalue · 2^(e-128)`` (``ggml_e8m0_to_fp32_half``: e = 0, 1 give the
  float32 subnormals 2^-128, 2^-127).
- NVFP4 (36 bytes / 64 weights): four UE4M3 scale bytes d[s] @0 (one per 16 weights), qs[32] @4; in group s,
  byte 8s+j holds weight 16s+j (low nibble) and 16s+j+8 (high nibble); weight = ``kvalue · ue4m3(d)/2``.
  ``ggml_ue4m3_to_fp32``: bits 6..3 exponent (bias 7), bits 2..0 mantissa, bit 7 ignored, 0 and 0x7F → 0,
  exponent 0 → ``m·2^-9``.  (GGUF NVFP4 carries no per-tensor scale; a separate ``<name>.scale`` does.)

Encoding, float32, no fused multiply-add:

- MXFP4 pins ggml's (OCP) exponent convention: ``e = amax > 0 ? (uint8)(floorf(log2f(amax)) - 2 + 127) : 0``,
  i.e. the scale 2^(e-127) = 2^(floor(log2 amax) - 2) puts amax in [4, 8)·scale, so the largest magnitude 6
  saturates values above 6·scale (ModelOpt's ceil(log2(amax/6)) differs).  ``log2f`` rounds the few largest
  float32 values below 2^k up to k (|k| ≥ 3: the one float below 8, the 44 largest below 2^100), which moves
  them to the next exponent; numpy's float32 log2, glibc's log2f and the correctly rounded log2 give the same
  floor on every positive float32 (checked exhaustively).  For amax below 2^-125 the byte wraps modulo 256,
  as the C cast does on x86.
- NVFP4: per 16 weights ``ue = ggml_fp32_to_ue4m3(amax / 6)``, which is *not* round-to-nearest-even E4M3:
  inputs above 448 clamp to 448; a normal result keeps 3 mantissa bits and adds bit 19 of the float32 (ties
  round up); any input ≥ 256 gives 0x7E (448); inputs below 2^-6 give ``min(7, (int)(x·512 + 0.5))``, 0 under
  2^-10.  The code search uses ``d = ue4m3(ue)/2``.
- Codes (``best_index_mxfp4``): the first of the 16 kvalues with the smallest ``fabsf(kvalue·d - x)`` in
  float32 — ties go to the smaller magnitude, not to even; x ≥ 0 (and -0.0) gets a code 0..7, x < 0 a code
  9..15 or 0.  When |x| dwarfs d (NVFP4 past its 448 clamp) every error rounds to |x| and the code is 0.

:mod:`quantkit.formats.minifloat` rounds E4M3/E8M0/E2M1 to nearest-even (the OCP/IEEE reading) and so cannot
reproduce these bytes; the ggml conversions are written out here instead.
"""
from __future__ import annotations

import numpy as np
from gguf.quants import MXFP4 as _GGUF_MXFP4

from ..kernels import fp4_numba as nb
from ..kernels.rows import over_rows
from ._ggml_numpy import F32, c_int, safe_div
from .registry import GGMLType, ImatrixUse, QuantFormat

KVALUES_E2M1X2 = np.asarray(_GGUF_MXFP4.kvalues, dtype=F32)
QK_MXFP4 = nb.QK_MXFP4
QK_NVFP4 = nb.QK_NVFP4
NVFP4_SUB = nb.NVFP4_SUB


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e-128), built from bits (e < 2: the subnormals 2^-128, 2^-127)."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(F32)


def ue4m3_to_fp32_half(u: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32: the UE4M3 value times 0.5 (exact)."""
    u = np.asarray(u, dtype=np.int64)
    exp = (u >> 3) & 0xF
    man = (u & 0x7).astype(np.float64)
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1.0 + man / 8.0, exp - 7))
    return np.where((u == 0) | (u == 0x7F), 0.0, raw * 0.5).astype(F32)


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3 on float32 ``x`` (uint8 codes), rules in the module docstring."""
    x = np.minimum(np.asarray(x, dtype=F32), F32(448.0))
    bits = x.view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    sub = np.minimum(c_int((x * F32(512.0) + F32(0.5)).astype(F32)), 7)
    sub = np.where(sub >= 1, sub, 0)
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    carry = man > 7
    exp_n = np.where(carry, exp + 1, exp)
    normal = np.where(exp_n >= 15, 0x7E, (exp_n << 3) | np.where(carry, 0, man))
    code = np.where(exp <= 0, sub, np.where(exp >= 15, 0x7E, normal))
    return np.where(x > 0, code, 0).astype(np.uint8)


def best_index(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml best_index_mxfp4, literally: the first argmin over the 16 codes of |kvalue·d - x| (float32)."""
    with np.errstate(over="ignore", invalid="ignore"):
        grid = (KVALUES_E2M1X2 * d[..., None]).astype(F32)
        err = np.abs((grid - x[..., None]).astype(F32))
    return np.argmin(err, axis=-1).astype(np.uint8)


def _encode_mxfp4_reference(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    rows = x.shape[0]
    b = x.reshape(-1, QK_MXFP4)
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(amax))
    e = np.where(amax > 0, (np.where(amax > 0, exponent, 0).astype(np.int64) + 125) & 0xFF, 0)
    codes = best_index(b, np.broadcast_to(e8m0_to_fp32_half(e)[:, None], b.shape))
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([e.astype(np.uint8)[:, None], qs], axis=1).reshape(rows, -1)


def _encode_nvfp4_reference(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    rows = x.shape[0]
    g = x.reshape(-1, QK_NVFP4 // NVFP4_SUB, NVFP4_SUB)  # [blocks, 4 groups, 16]
    ue = fp32_to_ue4m3(safe_div(np.abs(g).max(axis=2), F32(6.0)))
    codes = best_index(g, np.broadcast_to(ue4m3_to_fp32_half(ue)[..., None], g.shape))
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(-1, QK_NVFP4 // 2)
    return np.concatenate([ue, qs], axis=1).reshape(rows, -1)


def _encode_mxfp4(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    out = np.empty((x.shape[0], x.shape[1] // QK_MXFP4 * 17), np.uint8)
    over_rows(x.shape[0], lambda r0, r1: nb.mxfp4(x[r0:r1], out[r0:r1]))
    return out


def _encode_nvfp4(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    out = np.empty((x.shape[0], x.shape[1] // QK_NVFP4 * 36), np.uint8)
    over_rows(x.shape[0], lambda r0, r1: nb.nvfp4(x[r0:r1], out[r0:r1]))
    return out


def _decode_mxfp4_reference(blocks: np.ndarray) -> np.ndarray:
    d = e8m0_to_fp32_half(blocks[:, 0])
    qs = blocks[:, 1:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    with np.errstate(over="ignore"):  # e = 0xFF is 2^127 in ggml, not NaN: 12·2^126 overflows to inf
        return (KVALUES_E2M1X2[q] * d[:, None]).astype(F32)


def _decode_nvfp4_reference(blocks: np.ndarray) -> np.ndarray:
    d = ue4m3_to_fp32_half(blocks[:, :4])
    qs = blocks[:, 4:].reshape(-1, 4, 8)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return (KVALUES_E2M1X2[q] * d[:, :, None]).astype(F32).reshape(-1, QK_NVFP4)


FORMATS = [
    QuantFormat(GGMLType.MXFP4, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_mxfp4_reference,
                encode_fast=_encode_mxfp4, decode_reference=_decode_mxfp4_reference),
    QuantFormat(GGMLType.NVFP4, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_nvfp4_reference,
                encode_fast=_encode_nvfp4, decode_reference=_decode_nvfp4_reference),
]
