"""The inverse of the architecture maps: where each value of a GGUF tensor goes in a transformers model tensor.

:mod:`quantkit.arch` maps a source (transformers) tensor to GGUF tensors through named transform steps.  The
runtime needs the opposite direction and derives it from the same tables, never from a second one:

* **Index steps** (every step of :mod:`quantkit.arch.transforms` that only moves values: halves of a fused
  ``gate_up``, the MLA ``kv_b`` split, V-head reorders, squeezes, slices) are run on the *positions*
  ``arange(n).reshape(shape)`` of the model tensor instead of on its values.  What comes out is, for each value of
  the GGUF tensor, the flat position it came from; scattering the decoded GGUF values to those positions rebuilds
  the model tensor exactly.  The positions of all GGUF tensors that one model tensor feeds must cover it exactly
  once (checked).
* **Value steps** act elementwise and commute with the index steps; :data:`VALUE_INVERSES` inverts them after
  decoding: ``plus_one`` (w + 1) -> ``g - 1`` and ``neg_exp`` (A = -exp(A_log)) -> ``log(-A)``, each one rounding
  away from the source value (1 ulp at most for ``plus_one``; ``log`` in float64 rounded once); ``to_int32`` is
  a cast back to the model tensor's integer type.

Positions are stored factored, per GGUF tensor viewed as ``[rows, row_length]``: position(r, c) =
``rows[r] + cols[c]``.  Row permutations, column permutations and the transposed heads of ``kv_b -> k_b`` all have
that form, so a model tensor's map costs ``rows + row_length`` integers instead of one per value; a step whose
positions do not factor is an :class:`~quantkit.errors.UnsupportedError` naming the tensor.  A GGUF tensor that
is the model tensor unchanged has no map at all (``rows is None``).

Model tensors whose leading axis is the expert axis of every GGUF tensor they come from (fused 3-D experts) are
planned per slice: positions are computed on one- and two-expert shapes, the second checked to be the first
shifted by one slice, so one expert is rebuilt from one slice of each GGUF tensor without touching the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ..arch import TensorMapping, transforms
from ..errors import FormatError, SourceError, UnsupportedError

Shape = tuple[int, ...]

#: Elementwise steps and how to undo them on decoded float32 values (torch tensors); None: only a dtype cast.
VALUE_INVERSES: Mapping[str, Callable | None] = {
    "plus_one": lambda x: x - 1.0,
    "neg_exp": lambda x: (-x.double()).log().float(),
    "to_int32": None,
}


@dataclass(frozen=True)
class Part:
    """One GGUF tensor's share of a model tensor (or of one leading-axis slice of it)."""

    gguf_name: str
    rows: np.ndarray | None
    """int64[rows]: flat position of each GGUF row's first value; None: the GGUF tensor is the model tensor."""
    cols: np.ndarray | None
    """int64[row_length]: offset of each value of a row from the row's position."""
    values: tuple[str, ...]
    """Value steps, undone in reverse order after decoding."""


@dataclass(frozen=True)
class TensorPlan:
    """How to rebuild one model tensor from GGUF tensors."""

    name: str
    shape: Shape
    parts: tuple[Part, ...]
    sliced: bool
    """True: ``parts`` describe one slice of the leading axis, and GGUF slice i rebuilds model slice i."""

    @property
    def gguf_names(self) -> tuple[str, ...]:
        return tuple(p.gguf_name for p in self.parts)


def _split_steps(m: TensorMapping) -> tuple[list[str], tuple[str, ...]]:
    index = [s for s in m.transform if s not in VALUE_INVERSES]
    values = tuple(s for s in m.transform if s in VALUE_INVERSES)
    return index, values


def _positions(name: str, steps: Sequence[str], shape: Shape, hp: Mapping) -> np.ndarray:
    """The index steps run on the positions of a tensor of ``shape``."""
    x = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    for step in steps:
        x = transforms.get_step(step).apply(x, hp)
        if x.dtype != np.int64:
            raise UnsupportedError(f"transform step {step!r} changes values, so it has no index inverse; add it "
                                   f"to quantkit.runtime.inverse.VALUE_INVERSES", tensor=name)
    return x


def _factor(name: str, gguf_name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    grid = positions.reshape(-1, positions.shape[-1]) if positions.ndim else positions.reshape(1, 1)
    rows = grid[:, 0].copy()
    cols = grid[0, :] - grid[0, 0]
    if not np.array_equal(grid, rows[:, None] + cols[None, :]):
        raise UnsupportedError(f"the values of {gguf_name!r} do not land on rows + columns of the model tensor; "
                               f"the runtime has no compact inverse for its transform", tensor=name)
    return rows, cols


def _check_cover(name: str, positions: list[np.ndarray], n: int) -> None:
    flat = np.concatenate([p.reshape(-1) for p in positions]) if positions else np.zeros(0, np.int64)
    counts = np.bincount(flat, minlength=n) if flat.size else np.zeros(n, np.int64)
    if counts.size != n or not (counts == 1).all():
        missing = int((counts[:n] == 0).sum())
        raise SourceError(f"the GGUF tensors it comes from cover {n - missing} of its {n} values "
                          f"({int((counts > 1).sum())} more than once)", tensor=name)


def _is_identity(rows: np.ndarray, cols: np.ndarray) -> bool:
    width = cols.size
    return (np.array_equal(cols, np.arange(width))
            and np.array_equal(rows, np.arange(rows.size, dtype=np.int64) * width))


def _stored_shape(stored: Mapping[str, Shape], name: str, gguf_name: str) -> Shape:
    if gguf_name not in stored:
        raise SourceError(f"needs GGUF tensor {gguf_name!r}, which the file does not hold", tensor=name)
    return tuple(stored[gguf_name])


def _significant(shape: Shape) -> Shape:
    """``shape`` without its leading 1s (ggml's trailing ``ne`` of 1: llama-quantize writes a [256, 1, 4] conv
    kernel that the converter wrote as [1, 256, 1, 4])."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _parts(name: str, shape: Shape, mappings: Sequence[TensorMapping], hp: Mapping,
           stored: Mapping[str, Shape]) -> tuple[Part, ...]:
    parts, positions = [], []
    for m in mappings:
        index, values = _split_steps(m)
        expected = _stored_shape(stored, name, m.gguf_name)
        p = _positions(name, index, shape, hp)
        if tuple(p.shape) != tuple(expected) and _significant(p.shape) == _significant(expected):
            p = p.reshape(expected)     # ggml's dimensions of size 1 past the last significant one carry nothing
        if tuple(p.shape) != tuple(expected):
            raise SourceError(f"its transform to {m.gguf_name!r} gives shape {tuple(p.shape)}, the file holds "
                              f"{tuple(expected)}", tensor=name)
        rows, cols = _factor(name, m.gguf_name, p)
        parts.append(Part(m.gguf_name, rows, cols, values))
        positions.append(p)
    _check_cover(name, positions, math.prod(shape))
    if len(parts) == 1 and _is_identity(parts[0].rows, parts[0].cols):
        parts = [Part(parts[0].gguf_name, None, None, parts[0].values)]
    return tuple(parts)


def _sliceable(shape: Shape, mappings: Sequence[TensorMapping], stored: Mapping[str, Shape]) -> bool:
    return len(shape) == 3 and all(m.gguf_name in stored and len(stored[m.gguf_name]) == 3
                                   and stored[m.gguf_name][0] == shape[0] for m in mappings)


def _sliced_parts(name: str, shape: Shape, mappings: Sequence[TensorMapping], hp: Mapping,
                  stored: Mapping[str, Shape]) -> tuple[Part, ...] | None:
    """Parts of one leading-axis slice, if slice i of every GGUF tensor rebuilds slice i of the model tensor."""
    one, two = (1, *shape[1:]), (2, *shape[1:])
    size = math.prod(shape[1:])
    for m in mappings:
        index, _ = _split_steps(m)
        p1 = _positions(name, index, one, hp)
        p2 = _positions(name, index, two, hp)
        if p1.shape[0] != 1 or p2.shape[0] != 2 or not (np.array_equal(p2[0], p1[0])
                                                         and np.array_equal(p2[1], p1[0] + size)):
            return None
    one_slice = {m.gguf_name: (1, *stored[m.gguf_name][1:]) for m in mappings}
    return _parts(name, one, mappings, hp, one_slice)


def plan_tensor(name: str, shape: Shape, mappings: Sequence[TensorMapping], hp: Mapping,
                stored: Mapping[str, Shape]) -> TensorPlan:
    """How model tensor ``name`` of ``shape`` is rebuilt from the GGUF tensors its ``mappings`` name."""
    shape = tuple(int(d) for d in shape)
    if not mappings or any(m.gguf_name is None for m in mappings):
        raise SourceError("has no GGUF tensor to be built from", tensor=name)
    if _sliceable(shape, mappings, stored):
        parts = _sliced_parts(name, shape, mappings, hp, stored)
        if parts is not None:
            return TensorPlan(name, shape, parts, True)
    # A GGUF tensor that is the model tensor unchanged needs no positions (the output head can be 10^9 values).
    if len(mappings) == 1 and not _split_steps(mappings[0])[0]:
        found = _stored_shape(stored, name, mappings[0].gguf_name)
        if math.prod(found) != math.prod(shape) or found[-1:] != shape[-1:]:
            raise FormatError(f"the file holds {mappings[0].gguf_name!r} with shape {found}, the model tensor "
                              f"has shape {shape}", tensor=name)
        return TensorPlan(name, shape, (Part(mappings[0].gguf_name, None, None, _split_steps(mappings[0])[1]),),
                          False)
    return TensorPlan(name, shape, _parts(name, shape, mappings, hp, stored), False)
