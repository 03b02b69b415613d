"""The registry of GGML tensor types: one entry per wire id.

Wire ids, block sizes and bytes per block come from gguf-py's constants (the same numbers ggml uses), so they
are never retyped here.  Each numeric family module (``floats``, ``legacy``, ``kquants``, ``iquants``,
``nonlinear``, ``fp4``)
declares a :class:`QuantFormat` per type it implements: its reference encoder/decoder (readable numpy) and its
fast ones (numba), plus how it uses an importance matrix.  The family modules are listed explicitly in
:data:`FAMILIES`; there is no registration by import side effect.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import UnsupportedError

GGMLType = GGMLQuantizationType
"""ggml's type ids (e.g. ``GGMLType.Q4_K == 12``), shared with gguf-py."""

# (x: float32[rows, n_per_row], imatrix: float32[n_per_row] | None) -> uint8[rows, row_bytes]
Encoder = Callable[[np.ndarray, Optional[np.ndarray]], np.ndarray]
# (blocks: uint8[n_blocks, type_size]) -> float32[n_blocks, block_size]
Decoder = Callable[[np.ndarray], np.ndarray]


class ImatrixUse(enum.Enum):
    IGNORED = "ignored"     # the encoder never looks at importance (Q8_0, F16, ...)
    OPTIONAL = "optional"   # a different, weighted algorithm runs when given (K-quants, legacy)
    REQUIRED = "required"   # ggml refuses to quantize without one (IQ2_XXS, IQ2_XS, IQ1_S)


@dataclass(frozen=True)
class QuantFormat:
    """One GGML type: layout, capabilities, and its reference and fast codecs."""

    qtype: GGMLType
    imatrix: ImatrixUse = ImatrixUse.IGNORED
    encode_reference: Optional[Encoder] = None
    encode_fast: Optional[Encoder] = None
    decode_reference: Optional[Decoder] = None
    decode_fast: Optional[Decoder] = None

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    @property
    def can_encode(self) -> bool:
        return self.encode_reference is not None or self.encode_fast is not None

    def row_bytes(self, n_per_row: int) -> int:
        return (n_per_row // self.block_size) * self.type_size


def _family_formats() -> dict[GGMLType, QuantFormat]:
    from . import floats, fp4, iquants, kquants, legacy, nonlinear

    declared: dict[GGMLType, QuantFormat] = {}
    for family in (floats, legacy, kquants, iquants, nonlinear, fp4):
        for fmt in family.FORMATS:
            if fmt.qtype in declared:
                raise RuntimeError(f"GGML type {fmt.qtype.name} declared twice (second in {family.__name__})")
            declared[fmt.qtype] = fmt
    # Fast decoders live in one numba module for every type; a family may still name its own.
    from ..kernels.dequant import FAST_DECODERS

    formats = {}
    # Every type gguf-py knows is listed; the ones no family implements can still be decoded through gguf-py.
    for t in GGMLType:
        if t not in GGML_QUANT_SIZES:
            continue
        fmt = declared.get(t, QuantFormat(t))
        if fmt.decode_fast is None and t in FAST_DECODERS:
            fmt = replace(fmt, decode_fast=FAST_DECODERS[t])
        formats[t] = fmt
    return formats


_FORMATS: dict[GGMLType, QuantFormat] | None = None


def all_formats() -> dict[GGMLType, QuantFormat]:
    global _FORMATS
    if _FORMATS is None:
        _FORMATS = _family_formats()
    return _FORMATS


def _lookup(qtype: "GGMLType | int | str") -> GGMLType:
    try:
        key = GGMLType[qtype.upper()] if isinstance(qtype, str) else GGMLType(int(qtype))
        if key in GGML_QUANT_SIZES:
            return key
    except (KeyError, ValueError):
        pass
    known = ", ".join(t.name for t in GGMLType if t in GGML_QUANT_SIZES)
    raise UnsupportedError(f"unknown GGML type {qtype!r}; known types: {known}")


def get_format(qtype: "GGMLType | int | str") -> QuantFormat:
    """Look a type up by enum, wire id or name (case-insensitive); a miss lists what exists."""
    return all_formats()[_lookup(qtype)]


def layout(qtype: "GGMLType | int | str") -> QuantFormat:
    """A type's block geometry without its codecs: cheap, and independent of the kernels (readers use this)."""
    return QuantFormat(_lookup(qtype))
