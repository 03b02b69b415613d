"""Lossless repacking of block-scaled FP4 sources into GGUF blocks: a nibble permutation, scale bytes carried over.

Both source encodings store E2M1 codes two per byte, element ``2i`` in the low nibble of byte ``i`` and element
``2i+1`` in the high nibble (OCP MX / ModelOpt / compressed-tensors packing).  The 4-bit code is the same in GGUF
(sign bit 3, magnitude index 0..7): ggml's ``kvalues_mxfp4`` are the E2M1 values doubled and every GGUF FP4
scale decodes at half its value, so ``kvalue · scale/2 == e2m1 · scale`` and no value changes.

**Packed FP4 + E8M0 per 32 → MXFP4** (17 bytes / 32 weights).  Source: packed ``[rows, n/2]`` and E8M0 codes
``[rows, n/32]``.  Block ``b`` of a row: byte 0 is the E8M0 code copied; byte ``1 + j`` (j < 16) holds element
``32b + j`` in its low nibble and element ``32b + j + 16`` in its high nibble.  An E8M0 code 0xFF (NaN) has no
GGUF meaning and is refused.

**NVFP4 → GGUF NVFP4** (36 bytes / 64 weights).  Source: packed ``[rows, n/2]``, E4M3 block scales ``[rows,
n/16]``.  Super-block ``b``: bytes 0..3 are the four block scales of its 64 elements as UE4M3 (the E4M3 code
without its sign bit, what llama.cpp's converter writes); byte ``4 + 8s + j`` (s < 4, j < 8) holds element
``64b + 16s + j`` in its low nibble and ``64b + 16s + j + 8`` in its high nibble.  Block scales that are NaN
(0x7F, 0xFF) or negative (sign bit set on a non-zero magnitude) are refused: stripping the sign would change the
weights.  The per-tensor scale becomes the F32 tensor ``<name>.scale``, a multiplier (:func:`nvfp4_tensor_scale`):
ModelOpt's ``weight_scale_2`` as stored, compressed-tensors' ``weight_global_scale`` (a divisor) as its float32
reciprocal (``1.0 / gs``, what llama.cpp's converter computes).
"""
from __future__ import annotations

import numpy as np

from ..errors import EncodeError

MX_BLOCK = 32
MXFP4_BLOCK_BYTES = 1 + MX_BLOCK // 2
NVFP4_GROUP = 16
NVFP4_SUPER = 64
NVFP4_BLOCK_BYTES = NVFP4_SUPER // NVFP4_GROUP + NVFP4_SUPER // 2
_E8M0_NAN = 0xFF
_E4M3_MAGNITUDE = 0x7F   # also E4M3's NaN code (with either sign)
_SIGN = 0x80


def _codes(packed: np.ndarray, scales: np.ndarray, group: int, what: str, tensor: str | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Unpacked codes ``uint8[rows, n]`` and scale bytes ``uint8[rows, n/group]`` after shape checks."""
    packed = np.ascontiguousarray(packed).view(np.uint8)
    scales = np.ascontiguousarray(scales).view(np.uint8)
    if packed.ndim != 2 or scales.ndim != 2:
        raise EncodeError(f"{what}: expected 2-D packed weights and scales, got shapes {packed.shape} and "
                          f"{scales.shape}", tensor=tensor)
    rows, half = packed.shape
    if scales.shape != (rows, 2 * half // group) or (2 * half) % group:
        raise EncodeError(f"{what}: scales of shape {scales.shape} do not fit packed weights of shape "
                          f"{packed.shape} (expected ({rows}, {2 * half // group}) with {group} weights per scale)",
                          tensor=tensor)
    codes = np.empty((rows, 2 * half), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes, scales


def mxfp4_from_fp4_e8m0(packed, scales, *, tensor: str | None = None) -> np.ndarray:
    """Packed FP4 ``[rows, n/2]`` + E8M0 ``[rows, n/32]`` → GGUF MXFP4 blocks ``uint8[rows, n/32 · 17]``."""
    codes, scales = _codes(packed, scales, MX_BLOCK, "FP4+E8M0 to MXFP4", tensor)
    if (scales == _E8M0_NAN).any():
        row = int(np.argwhere(scales == _E8M0_NAN)[0][0])
        raise EncodeError(f"E8M0 scale 0xFF (NaN) in row {row}: no MXFP4 block can hold it", tensor=tensor)
    rows, n = codes.shape
    blocks = codes.reshape(rows, n // MX_BLOCK, 2, MX_BLOCK // 2)
    out = np.empty((rows, n // MX_BLOCK, MXFP4_BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)
    return out.reshape(rows, -1)


def nvfp4_from_modelopt_layout(packed, block_scales, *, tensor: str | None = None) -> np.ndarray:
    """Packed FP4 ``[rows, n/2]`` + E4M3 ``[rows, n/16]`` → GGUF NVFP4 blocks ``uint8[rows, n/64 · 36]``."""
    codes, scales = _codes(packed, block_scales, NVFP4_GROUP, "NVFP4 repack", tensor)
    rows, n = codes.shape
    if n % NVFP4_SUPER:
        raise EncodeError(f"NVFP4 repack: row length {n} is not a multiple of GGUF NVFP4's {NVFP4_SUPER}",
                          tensor=tensor)
    magnitude = scales & _E4M3_MAGNITUDE
    bad = (magnitude == _E4M3_MAGNITUDE) | ((scales & _SIGN) != 0) & (magnitude != 0)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise EncodeError(f"E4M3 block scale 0x{int(scales[row, col]):02X} (NaN or negative) in row {row}, block "
                          f"{col}: GGUF NVFP4 scales are unsigned", tensor=tensor)
    groups = codes.reshape(rows, n // NVFP4_SUPER, NVFP4_SUPER // NVFP4_GROUP, 2, NVFP4_GROUP // 2)
    out = np.empty((rows, n // NVFP4_SUPER, NVFP4_BLOCK_BYTES), dtype=np.uint8)
    out[..., :4] = magnitude.reshape(rows, n // NVFP4_SUPER, 4)
    out[..., 4:] = (groups[..., 0, :] | (groups[..., 1, :] << 4)).reshape(rows, n // NVFP4_SUPER, -1)
    return out.reshape(rows, -1)


def nvfp4_tensor_scale(global_scale, convention: str, *, tensor: str | None = None) -> np.float32:
    """The multiplier stored as ``<name>.scale``: ModelOpt's ``weight_scale_2`` itself, compressed-tensors'
    ``weight_global_scale`` inverted (float32 ``1 / gs``)."""
    g = np.asarray(global_scale)
    if g.size != 1 or g.dtype != np.float32:
        raise EncodeError(f"NVFP4 global scale must be one float32 value, got {g.dtype}{list(g.shape)}",
                          tensor=tensor)
    g = np.float32(g.reshape(()))
    if not np.isfinite(g) or g <= 0:
        raise EncodeError(f"NVFP4 global scale must be finite and positive, got {g}", tensor=tensor)
    if convention == "modelopt":
        return g
    if convention == "compressed-tensors":
        return np.float32(np.float32(1.0) / g)
    raise EncodeError(f"unknown NVFP4 convention {convention!r}", tensor=tensor)
