"""A safetensors file written from a plan: header first, then each tensor at its planned offset.

The header comes from :func:`quantkit.io.safetensors.safetensors_header` (same order, alignment and bytes as
``write_safetensors``) applied to zero-stride stand-ins of the planned arrays, so the file is laid out before any
tensor is encoded and tensors can be written in any order while only one fused group is in memory.  Every planned
tensor must be written exactly once, with the planned dtype and shape; :meth:`PlannedSafetensors.finish` refuses a
file with a tensor missing.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..errors import FormatError, StateError
from ..io.safetensors import DTYPES, safetensors_header


@dataclass(frozen=True)
class Planned:
    """One planned tensor: safetensors dtype and shape (F4 is not used by sidecars)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype of the arrays written for it (uint8 codes for the 1-byte float types)."""
        return np.dtype(np.uint8) if DTYPES[self.dtype].bits == 8 else DTYPES[self.dtype].storage

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.storage.itemsize


class PlannedSafetensors:
    """Writes ``specs`` into the open binary file ``f`` (see the module docstring)."""

    def __init__(self, f: BinaryIO, specs: Mapping[str, Planned], metadata: Mapping[str, str] | None = None):
        self._f = f
        self._specs = dict(specs)
        stand_ins = {name: np.broadcast_to(np.zeros((), dtype=s.storage), s.shape) for name, s in self._specs.items()}
        header, order = safetensors_header(stand_ins, metadata,
                                           dtypes={name: s.dtype for name, s in self._specs.items()})
        self._offsets: dict[str, int] = {}
        position = 8 + len(header)
        for name in order:
            self._offsets[name] = position
            position += self._specs[name].nbytes
        self.size = position
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.truncate(position)
        self._written: set[str] = set()

    def write(self, name: str, array: np.ndarray) -> None:
        spec = self._specs.get(name)
        if spec is None:
            raise StateError("tensor is not in the plan of this file", tensor=name)
        if name in self._written:
            raise StateError("tensor written twice", tensor=name)
        a = np.asarray(array)
        # 1-byte types are written from their codes (uint8, int8 or an ml_dtypes float8 view)
        if not (a.dtype == spec.storage or (spec.storage.itemsize == 1 and a.dtype.itemsize == 1)):
            raise FormatError(f"planned {spec.dtype} (numpy {spec.storage}), got {a.dtype}", tensor=name)
        if tuple(a.shape) != spec.shape:
            raise FormatError(f"planned shape {list(spec.shape)}, got {list(a.shape)}", tensor=name)
        data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
        self._f.seek(self._offsets[name])
        self._f.write(memoryview(data))
        self._written.add(name)

    def finish(self) -> None:
        missing = sorted(set(self._specs) - self._written)
        if missing:
            raise StateError(f"{len(missing)} planned tensors were not written (first {missing[0]!r})")
        self._f.flush()
