"""Fast decoders for every GGML type gguf-py can dequantize (plus ggml's Q1_0 and Q8_K): numba, CPU.

:data:`FAST_DECODERS` maps a type to ``decode(blocks: uint8[n_blocks, type_size]) -> float32[n_blocks,
block_size]``.  The registry wires each one in as that type's ``decode_fast``.  Output is always a new array.

Every decoder is bit-identical to ggml's ``dequantize_row_<type>`` (and to gguf-py's ``quants.dequantize``, which
matches ggml) for every block whose f16 scales are finite; with non-finite scales the NaN/inf positions agree
too.  The kernels (layouts and rounding in their modules' docstrings) are split by family:
``dequant_simple`` (element types, 32-blocks, ternary, FP4, IQ4), ``dequant_kquants``, ``dequant_iq``, with the
exact scalar conversions and the gguf-py tables in ``dequant_scalars``.  They run parallel over blocks on
threads (:func:`quantkit.kernels.rows.over_rows`); blocks are independent, so the result does not depend on the thread count.  No fastmath.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType

from ..errors import FormatError
from .rows import over_rows
from . import dequant_iq as iq
from . import dequant_kquants as kq
from . import dequant_simple as simple
from .dequant_scalars import (GRID_IQ1S, GRID_IQ2S, GRID_IQ2XS, GRID_IQ2XXS, GRID_IQ3S, GRID_IQ3XXS,
                              IQ1S_DELTA, KSIGNS, KVALUES_E2M1X2, KVALUES_IQ4NL)


def _check_blocks(blocks, qtype: GGMLType, type_size: int) -> np.ndarray:
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != type_size:
        raise FormatError(f"{qtype.name} decoder expects uint8[n_blocks, {type_size}] blocks, "
                          f"got {blocks.dtype}{list(blocks.shape)}")
    # One numba specialization per kernel: always hand it a C-contiguous, read-only view.
    view = np.ascontiguousarray(blocks).view()
    view.flags.writeable = False
    return view


def _decoder(qtype: GGMLType, kernel, *tables) -> Callable[[np.ndarray], np.ndarray]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]

    def decode(blocks: np.ndarray) -> np.ndarray:
        b = _check_blocks(blocks, qtype, type_size)
        y = np.empty((b.shape[0], block_size), dtype=np.float32)
        over_rows(b.shape[0], lambda r0, r1: kernel(b[r0:r1], y[r0:r1], *tables))
        return y

    decode.__name__ = decode.__qualname__ = f"decode_{qtype.name.lower()}"
    decode.__doc__ = f"{qtype.name}: uint8[n_blocks, {type_size}] -> float32[n_blocks, {block_size}]."
    return decode


def _decode_f32(blocks: np.ndarray) -> np.ndarray:
    """F32: uint8[n, 4] -> float32[n, 1], a copy of the little-endian bits."""
    return _check_blocks(blocks, GGMLType.F32, 4).view(np.float32).copy()


def _half_decoder(qtype: GGMLType, kernel) -> Callable[[np.ndarray], np.ndarray]:
    """F16/BF16: the kernels run on the flat uint16 view (2-byte rows would keep LLVM from vectorizing)."""

    def decode(blocks: np.ndarray) -> np.ndarray:
        halves = _check_blocks(blocks, qtype, 2).view(np.uint16).reshape(-1)
        y = np.empty(halves.shape[0], dtype=np.float32)
        over_rows(halves.shape[0], lambda r0, r1: kernel(halves[r0:r1], y[r0:r1]))
        return y.reshape(-1, 1)

    decode.__name__ = decode.__qualname__ = f"decode_{qtype.name.lower()}"
    decode.__doc__ = f"{qtype.name}: uint8[n, 2] -> float32[n, 1]."
    return decode


FAST_DECODERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: _decode_f32,
    GGMLType.F16: _half_decoder(GGMLType.F16, simple.f16),
    GGMLType.BF16: _half_decoder(GGMLType.BF16, simple.bf16),
    GGMLType.Q4_0: _decoder(GGMLType.Q4_0, simple.q4_0),
    GGMLType.Q4_1: _decoder(GGMLType.Q4_1, simple.q4_1),
    GGMLType.Q5_0: _decoder(GGMLType.Q5_0, simple.q5_0),
    GGMLType.Q5_1: _decoder(GGMLType.Q5_1, simple.q5_1),
    GGMLType.Q8_0: _decoder(GGMLType.Q8_0, simple.q8_0),
    GGMLType.Q1_0: _decoder(GGMLType.Q1_0, simple.q1_0),
    GGMLType.Q8_K: _decoder(GGMLType.Q8_K, simple.q8_k),
    GGMLType.TQ1_0: _decoder(GGMLType.TQ1_0, simple.tq1_0),
    GGMLType.TQ2_0: _decoder(GGMLType.TQ2_0, simple.tq2_0),
    GGMLType.IQ4_NL: _decoder(GGMLType.IQ4_NL, simple.iq4_nl, KVALUES_IQ4NL),
    GGMLType.IQ4_XS: _decoder(GGMLType.IQ4_XS, simple.iq4_xs, KVALUES_IQ4NL),
    GGMLType.MXFP4: _decoder(GGMLType.MXFP4, simple.mxfp4, KVALUES_E2M1X2),
    GGMLType.NVFP4: _decoder(GGMLType.NVFP4, simple.nvfp4, KVALUES_E2M1X2),
    GGMLType.Q2_K: _decoder(GGMLType.Q2_K, kq.q2_k),
    GGMLType.Q3_K: _decoder(GGMLType.Q3_K, kq.q3_k),
    GGMLType.Q4_K: _decoder(GGMLType.Q4_K, kq.q4_k),
    GGMLType.Q5_K: _decoder(GGMLType.Q5_K, kq.q5_k),
    GGMLType.Q6_K: _decoder(GGMLType.Q6_K, kq.q6_k),
    GGMLType.IQ2_XXS: _decoder(GGMLType.IQ2_XXS, iq.iq2_xxs, GRID_IQ2XXS, KSIGNS),
    GGMLType.IQ2_XS: _decoder(GGMLType.IQ2_XS, iq.iq2_xs, GRID_IQ2XS, KSIGNS),
    GGMLType.IQ2_S: _decoder(GGMLType.IQ2_S, iq.iq2_s, GRID_IQ2S),
    GGMLType.IQ3_XXS: _decoder(GGMLType.IQ3_XXS, iq.iq3_xxs, GRID_IQ3XXS, KSIGNS),
    GGMLType.IQ3_S: _decoder(GGMLType.IQ3_S, iq.iq3_s, GRID_IQ3S),
    GGMLType.IQ1_S: _decoder(GGMLType.IQ1_S, iq.iq1_s, GRID_IQ1S, IQ1S_DELTA),
    GGMLType.IQ1_M: _decoder(GGMLType.IQ1_M, iq.iq1_m, GRID_IQ1S, IQ1S_DELTA),
}
