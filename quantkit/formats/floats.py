"""Element types F32, F16 and BF16 — byte-identical to ggml's ``ggml_quantize_chunk`` for them.

One weight per "block"; little-endian.

- F32 (4 bytes): the float32 bits, copied (``memcpy``).
- F16 (2 bytes): IEEE binary16, ``ggml_fp32_to_fp16_row`` = ``ggml_compute_fp32_to_fp16``: round to nearest,
  ties to even, subnormal halves kept, |x| ≥ 65520 → ±inf.  numpy's float32 → float16 cast rounds the same way.
- BF16 (2 bytes): the upper 16 bits of the float32 after ``ggml_fp32_to_bf16_row_ref`` =
  ``ggml_compute_fp32_to_bf16``: ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16``, i.e. round to nearest, ties to
  even, on the bit pattern (subnormals kept; values past the largest bfloat16 carry into ±inf).  ggml also
  quiets NaN there; encoders never see NaN (``quantkit.formats.api`` rejects non-finite input).

Decoding is exact: F16 widens (``ggml_compute_fp16_to_fp32``, whose float multiply turns a signaling-NaN half
into the quiet NaN with the same payload — gguf-py's numpy cast keeps it signaling, the one place the two
references differ), BF16 is ``bits << 16`` (``ggml_bf16_to_fp32``, NaN bits kept as they are).  The importance
matrix is ignored.  numpy is already fast here, so the reference encoders are also the fast ones.
"""
from __future__ import annotations

import numpy as np

from .registry import GGMLType, ImatrixUse, QuantFormat

_F32_QUIET_BIT = 0x00400000


def _encode_f32(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    return x.astype("<f4").view(np.uint8).reshape(x.shape[0], -1)


def _encode_f16(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = x.astype("<f2")
    return h.view(np.uint8).reshape(x.shape[0], -1)


def _encode_bf16(x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    bits = x.view(np.uint32)
    # No overflow in uint32: the largest finite pattern 0xFF7FFFFF plus 0x8000 stays below 2**32.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").view(np.uint8).reshape(x.shape[0], -1)


def _decode_f32(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)


def _decode_f16(blocks: np.ndarray) -> np.ndarray:
    y = np.ascontiguousarray(blocks).view("<f2").astype(np.float32)
    # ggml widens through a float multiply, which quiets a signaling NaN (numpy's cast keeps it signaling)
    bits = y.view(np.uint32)
    return np.where(np.isnan(y), bits | np.uint32(_F32_QUIET_BIT), bits).view(np.float32)


def _decode_bf16(blocks: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32)


FORMATS = [
    QuantFormat(GGMLType.F32, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_f32, encode_fast=_encode_f32,
                decode_reference=_decode_f32),
    QuantFormat(GGMLType.F16, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_f16, encode_fast=_encode_f16,
                decode_reference=_decode_f16),
    QuantFormat(GGMLType.BF16, imatrix=ImatrixUse.IGNORED, encode_reference=_encode_bf16,
                encode_fast=_encode_bf16, decode_reference=_decode_bf16),
]
FORMATS_BY_TYPE = {fmt.qtype: fmt for fmt in FORMATS}
