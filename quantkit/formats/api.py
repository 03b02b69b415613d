"""encode / decode: input checks, then dispatch to a type's fast codec (or its reference when it has none).

Checks happen here once, so the codecs can assume clean input: float32, C-contiguous, 2-D, finite, rows a
multiple of the block, and an importance vector of the right length that is finite and non-negative.  ggml
would silently write garbage (or assert) on any of these.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import EncodeError, FormatError, UnsupportedError
from . import floats
from .registry import GGMLType, ImatrixUse, QuantFormat, get_format, layout


def tensor_nbytes(qtype: "GGMLType | int | str", shape: tuple[int, ...], *, error=EncodeError) -> int:
    """Bytes of a tensor of numpy ``shape`` (last axis = row) stored as ``qtype``; ``error`` is raised for a row
    length that is not a multiple of the block (an EncodeError when planning, a FormatError when reading)."""
    fmt = layout(qtype)
    n_per_row = int(shape[-1]) if shape else 1
    if n_per_row % fmt.block_size:
        raise error(f"row length {n_per_row} is not a multiple of {fmt.name}'s block size {fmt.block_size}")
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * fmt.row_bytes(n_per_row)


def _check_rows(x: np.ndarray, fmt: QuantFormat, name: str | None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise EncodeError(f"expected a 2-D [rows, n_per_row] array, got shape {x.shape}", tensor=name)
    if x.shape[1] % fmt.block_size:
        raise EncodeError(f"row length {x.shape[1]} is not a multiple of {fmt.name}'s block size "
                          f"{fmt.block_size}; choose a fallback type for this tensor", tensor=name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    from ..kernels.checks import first_nonfinite_row   # numba: imported by the first encode, not by every command

    row = first_nonfinite_row(x)
    if row >= 0:
        raise EncodeError(f"non-finite weight (NaN or Inf) in row {row}", tensor=name)
    return x


def _check_imatrix(imatrix, n_per_row: int, fmt: QuantFormat, name: str | None) -> np.ndarray | None:
    if imatrix is None:
        if fmt.imatrix is ImatrixUse.REQUIRED:
            raise EncodeError(f"{fmt.name} requires an importance matrix (imatrix or bootstrap importance)",
                              tensor=name)
        return None
    if fmt.imatrix is ImatrixUse.IGNORED:
        return None
    im = np.ascontiguousarray(imatrix, dtype=np.float32)
    if im.shape != (n_per_row,):
        raise EncodeError(f"imatrix has shape {im.shape}, expected ({n_per_row},)", tensor=name)
    if not np.isfinite(im).all():
        raise EncodeError(f"imatrix has a non-finite entry at column {int(np.argmax(~np.isfinite(im)))}",
                          tensor=name)
    if (im < 0).any():
        raise EncodeError(f"imatrix has a negative entry at column {int(np.argmax(im < 0))}", tensor=name)
    return im


def encode(x, qtype: "GGMLType | int | str", imatrix=None, *, name: str | None = None,
           reference: bool = False) -> np.ndarray:
    """Encode float32 ``x[rows, n_per_row]`` to ``uint8[rows, row_bytes]``, byte-identical to ggml.

    ``imatrix`` is the importance vector (length ``n_per_row``) for types that use one.  ``reference=True``
    runs the readable reference implementation instead of the fast kernel (same bytes, slower).
    """
    fmt = get_format(qtype)
    if not fmt.can_encode:
        raise UnsupportedError(f"quantkit has no encoder for {fmt.name}", tensor=name)
    x = _check_rows(x, fmt, name)
    im = _check_imatrix(imatrix, x.shape[1], fmt, name)
    encoder = fmt.encode_reference if (reference or fmt.encode_fast is None) else fmt.encode_fast
    if encoder is None:
        raise UnsupportedError(f"{fmt.name} has no reference encoder", tensor=name)
    try:
        out = encoder(x, im)
    except EncodeError as exc:
        if exc.tensor is not None or name is None:
            raise
        raise EncodeError(exc.detail, tensor=name) from None  # codecs know rows, the caller knows the tensor
    expected = (x.shape[0], fmt.row_bytes(x.shape[1]))
    if out.shape != expected or out.dtype != np.uint8:
        raise RuntimeError(f"{fmt.name} encoder returned {out.dtype}{out.shape}, expected uint8{expected}")
    return out


def encode_experts(w, qtype: "GGMLType | int | str", imatrix=None, *, name: str | None = None,
                   reference: bool = False) -> np.ndarray:
    """Encode ``w[E, rows, n]`` expert by expert with ``imatrix[E, n]`` (one importance vector per expert)."""
    w = np.asarray(w)
    if w.ndim != 3:
        raise EncodeError(f"expected [experts, rows, n_per_row], got shape {w.shape}", tensor=name)
    if imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=np.float32)
        if imatrix.shape != (w.shape[0], w.shape[2]):
            raise EncodeError(f"expert imatrix has shape {imatrix.shape}, expected {(w.shape[0], w.shape[2])}",
                              tensor=name)
    parts = [encode(w[e], qtype, None if imatrix is None else imatrix[e],
                    name=f"{name}[expert {e}]" if name else f"expert {e}", reference=reference)
             for e in range(w.shape[0])]
    return np.stack(parts) if parts else np.zeros((0, w.shape[1], 0), np.uint8)


#: Element-type (F32, F16, BF16) tensors of fewer values decode with their numpy reference decoders, the same
#: bits as the numba ones (tested on every pattern): a process that decodes only small float tensors (a small
#: model's load) then never imports numba and the format kernels (~0.4 s).
NUMPY_DECODE_VALUES = 1 << 21


def decode(data, qtype: "GGMLType | int | str", shape: tuple[int, ...], *, reference: bool = False) -> np.ndarray:
    """Decode raw bytes of a tensor of numpy ``shape`` stored as ``qtype`` into float32 of that shape."""
    small = floats.FORMATS_BY_TYPE.get(layout(qtype).qtype)
    fmt = small if small is not None and math.prod(shape) < NUMPY_DECODE_VALUES else get_format(qtype)
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(fmt.qtype, shape, error=FormatError)
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) if not isinstance(data, np.ndarray) \
        else data.reshape(-1).view(np.uint8)
    if raw.size != nbytes:
        raise FormatError(f"{fmt.name} tensor of shape {shape} needs {nbytes} bytes, got {raw.size}")
    blocks = raw.reshape(-1, fmt.type_size)
    decoder = fmt.decode_reference if reference else (fmt.decode_fast or fmt.decode_reference)
    if decoder is None:
        from gguf.quants import dequantize  # bit-identical to ggml for every type gguf-py knows
        return np.asarray(dequantize(raw, fmt.qtype), dtype=np.float32).reshape(shape)
    return decoder(blocks).reshape(shape)
