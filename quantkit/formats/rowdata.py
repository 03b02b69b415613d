"""Finite scales in every block: the check ggml's ``ggml_validate_row_data`` (ggml/src/ggml-quants.c) makes.

ggml checks one or two scale fields per block, by type, and nothing else (quant codes cannot be invalid):

===========================================  =====================================================================
type                                         fields checked (byte offset in the block; ggml-common.h field order)
===========================================  =====================================================================
F16 / BF16 / F32                             every value: not Inf, not NaN
F64                                          every value converted to float32 (ggml passes each double to its
                                             float check): a finite double beyond float32's range is refused too
Q4_0, Q5_0, Q8_0, Q1_0, IQ1_S, IQ2_XXS,      f16 ``d`` at 0
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS
Q4_1, Q5_1, Q4_K, Q5_K                       f16 ``d`` at 0 and f16 ``m``/``dmin`` at 2
Q2_K                                         f16 ``d``, ``dmin`` after scales[16] and qs[64]: 80 and 82
Q3_K                                         f16 ``d`` after hmask[32], qs[64], scales[12]: 108
Q6_K                                         f16 ``d`` after ql[128], qh[64], scales[16]: 208
TQ1_0                                        f16 ``d`` after qs[48] and qh[4]: 52
TQ2_0                                        f16 ``d`` after qs[64]: 64
Q8_K                                         f32 ``d`` at 0
IQ1_M                                        the f16 scale spread over the top nibbles of the four u16 of
                                             scales[8] at 48: ``(s0>>12) | (s1>>8 & 0xF0) | (s2>>4 & 0xF00) |
                                             (s3 & 0xF000)``
MXFP4                                        E8M0 ``e`` at 0: not 0xFF
NVFP4, I8, I16, I32, I64                     nothing (every UE4M3 byte and integer is valid)
Q8_1                                         refused: ggml's switch has no case for it (an intermediate type)
===========================================  =====================================================================

An f16 is invalid when its exponent bits are all ones (``& 0x7C00 == 0x7C00``: Inf or NaN), a BF16 when
``& 0x7FFF >= 0x7F80``, an f32 when ``& 0x7F800000 == 0x7F800000``, an f64 when ``float32(x)`` is not finite
(round to nearest, as C's double-to-float conversion).
The check here is vectorized over many blocks at once (strided views of the scale fields, no copies); callers
bound memory by passing the payload in chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .registry import GGMLType, layout

QK_K = 256

_F16_EXP = 0x7C00
_BF16_MAG, _BF16_INF = 0x7FFF, 0x7F80
_F32_EXP = 0x7F800000
_E8M0_NAN = 0xFF

# field kinds: (numpy dtype of the field, description for messages)
_KIND_DTYPE = {"f16": "<u2", "bf16": "<u2", "f32": "<u4", "f64": "<f8", "e8m0": "u1", "iq1m": None}


def _d(offset: int = 0) -> tuple[tuple[int, str], ...]:
    return ((offset, "f16"),)


def _dm(offset: int = 0) -> tuple[tuple[int, str], ...]:
    return ((offset, "f16"), (offset + 2, "f16"))


#: type -> ((byte offset in the block, field kind), ...); None: ggml refuses the type.
SCALE_FIELDS: dict[GGMLType, tuple[tuple[int, str], ...] | None] = {
    GGMLType.F32: ((0, "f32"),), GGMLType.F16: ((0, "f16"),), GGMLType.BF16: ((0, "bf16"),),
    GGMLType.F64: ((0, "f64"),),
    GGMLType.Q4_0: _d(), GGMLType.Q5_0: _d(), GGMLType.Q8_0: _d(), GGMLType.Q1_0: _d(),
    GGMLType.Q4_1: _dm(), GGMLType.Q5_1: _dm(), GGMLType.Q4_K: _dm(), GGMLType.Q5_K: _dm(),
    GGMLType.Q2_K: _dm(QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: _d(QK_K // 8 + QK_K // 4 + 12),
    GGMLType.Q6_K: _d(QK_K // 2 + QK_K // 4 + QK_K // 16),
    GGMLType.TQ1_0: _d((QK_K - 4 * QK_K // 64) // 5 + QK_K // 64),
    GGMLType.TQ2_0: _d(QK_K // 4),
    GGMLType.Q8_K: ((0, "f32"),),
    GGMLType.IQ1_S: _d(), GGMLType.IQ2_XXS: _d(), GGMLType.IQ2_XS: _d(), GGMLType.IQ2_S: _d(),
    GGMLType.IQ3_XXS: _d(), GGMLType.IQ3_S: _d(), GGMLType.IQ4_NL: _d(), GGMLType.IQ4_XS: _d(),
    GGMLType.IQ1_M: ((QK_K // 8 + QK_K // 16, "iq1m"),),
    GGMLType.MXFP4: ((0, "e8m0"),),
    GGMLType.NVFP4: (), GGMLType.I8: (), GGMLType.I16: (), GGMLType.I32: (), GGMLType.I64: (),
    GGMLType.Q8_1: None,
}


@dataclass(frozen=True)
class RowDataProblem:
    """Blocks whose scales ggml would refuse, in one stretch of a payload."""

    first_block: int
    """Index of the first bad block, counted from the start of the data passed."""
    count: int
    what: str


def _field(data: np.ndarray, n_blocks: int, type_size: int, offset: int, dtype: str) -> np.ndarray:
    """The field at ``offset`` of every block, as a strided view (no copy)."""
    return np.ndarray((n_blocks,), dtype=dtype, buffer=data, offset=offset, strides=(type_size,))


def _iq1m_scale(data: np.ndarray, n_blocks: int, type_size: int, offset: int) -> np.ndarray:
    s = [_field(data, n_blocks, type_size, offset + 2 * j, "<u2") for j in range(4)]
    return (s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00) | (s[3] & 0xF000)


def _bad(kind: str, v: np.ndarray) -> np.ndarray:
    if kind in ("f16", "iq1m"):
        return (v & _F16_EXP) == _F16_EXP
    if kind == "bf16":
        return (v & _BF16_MAG) >= _BF16_INF
    if kind == "f32":
        return (v & _F32_EXP) == _F32_EXP
    if kind == "f64":
        with np.errstate(over="ignore", invalid="ignore"):
            return ~np.isfinite(v.astype(np.float32))
    return v == _E8M0_NAN


_DESCRIBE = {"f16": "f16 scale is Inf or NaN", "iq1m": "f16 scale is Inf or NaN", "f32": "f32 scale is Inf or NaN",
             "e8m0": "E8M0 scale is 0xFF (NaN)"}


def invalid_blocks(qtype: "GGMLType | int | str", data: np.ndarray) -> np.ndarray:
    """A bool per block of ``data`` (whole blocks of ``qtype``): True where ggml_validate_row_data would fail."""
    fmt = layout(qtype)
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    ts = fmt.type_size
    if data.size % ts:
        raise ValueError(f"{data.size} bytes is not a whole number of {fmt.name} blocks of {ts} bytes")
    n = data.size // ts
    fields = SCALE_FIELDS[fmt.qtype]
    if fields is None:
        return np.ones(n, dtype=bool)
    bad = np.zeros(n, dtype=bool)
    for offset, kind in fields:
        v = _iq1m_scale(data, n, ts, offset) if kind == "iq1m" else _field(data, n, ts, offset, _KIND_DTYPE[kind])
        bad |= _bad(kind, v)
    return bad


def check_row_data(qtype: "GGMLType | int | str", data: np.ndarray) -> RowDataProblem | None:
    """The problem ggml_validate_row_data would report for ``data`` (whole blocks), or None."""
    fmt = layout(qtype)
    fields = SCALE_FIELDS[fmt.qtype]
    if fields is None:
        return RowDataProblem(0, np.asarray(data).size // fmt.type_size,
                              f"ggml_validate_row_data refuses type {fmt.name} (no stored tensor may use it)")
    bad = invalid_blocks(fmt.qtype, data)
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    if fmt.qtype in (GGMLType.F16, GGMLType.BF16, GGMLType.F32, GGMLType.F64):   # a value, not a block's scale
        return RowDataProblem(first, int(bad.sum()), "value is Inf or NaN")
    kinds = sorted({kind for _, kind in fields})
    return RowDataProblem(first, int(bad.sum()), " or ".join(_DESCRIBE[k] for k in kinds))
