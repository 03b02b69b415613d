"""safetensors files: a strict, bounded header parser with memory-mapped tensor views, and a writer.

Format (https://github.com/huggingface/safetensors, ``safetensors/src/tensor.rs``), all little-endian:

1. 8 bytes: N, u64, the header length.  We refuse N above ``max_header_bytes`` (default
   :data:`DEFAULT_MAX_HEADER_BYTES`, the library's own 100 MB cap) and N past the end of the file BEFORE reading.
2. N bytes: UTF-8 JSON object.  Each key is a tensor name mapping to exactly
   ``{"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}``; the optional key ``__metadata__`` maps
   to a str -> str object.  We reject duplicate keys, NaN/Infinity literals and unknown fields.  Writers pad
   the header with spaces to a multiple of 8 bytes.
3. The data buffer: offsets are relative to its start.  Sorted by begin, the tensors MUST start at 0, be
   contiguous (each begins where the previous ended) and end exactly at the end of the file.  Each tensor's
   byte length MUST equal prod(shape) * bits(dtype) / 8, and that bit count MUST be a multiple of 8.

Dtypes (:data:`DTYPES`): F64 F32 F16 BF16 F8_E4M3 F8_E5M2 F8_E8M0 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F4.
``F4`` shapes count logical FP4 elements, two per byte (element 2i in the low nibble).

Views (:meth:`SafetensorsFile.array`): read-only numpy arrays over a memory map, no copy.  BF16 and the F8
types come back as their ``ml_dtypes`` dtypes (``.view(np.uint8)`` gives the codes; ``.astype(np.float32)``
decodes).  F4 comes back as packed ``uint8`` with the last dimension halved; we require an even last
dimension for that view.

Writer (:func:`write_safetensors`): tensors in the library's order (dtype rank descending, then name), so
every tensor stays aligned to its element size and the bytes equal ``safetensors``' own output for the same
input; compact JSON with ``__metadata__`` first (its keys sorted); written through :func:`atomic_output`.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import FormatError, MissingSourceError, TruncatedFileError
from . import jsontext
from .atomic import atomic_output

#: Largest header we parse; a longer length field is corruption or abuse (the safetensors library's cap).
DEFAULT_MAX_HEADER_BYTES = 100_000_000
HEADER_LENGTH_BYTES = 8
HEADER_ALIGNMENT = 8
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class DType:
    """A safetensors dtype: element bits, numpy storage dtype, and its rank in the library's Dtype enum."""

    name: str
    bits: int
    storage: np.dtype
    rank: int   # the writer orders by rank descending, as safetensors' ``prepare`` does


def _dtypes() -> dict[str, DType]:
    # Listed in the order of safetensors' ``enum Dtype`` (that order is the writer's sort key).
    specs = [("BOOL", 8, np.bool_), ("F4", 4, np.uint8), ("U8", 8, np.uint8), ("I8", 8, np.int8),
             ("F8_E5M2", 8, ml_dtypes.float8_e5m2), ("F8_E4M3", 8, ml_dtypes.float8_e4m3fn),
             ("F8_E8M0", 8, ml_dtypes.float8_e8m0fnu), ("I16", 16, np.int16), ("U16", 16, np.uint16),
             ("F16", 16, np.float16), ("BF16", 16, ml_dtypes.bfloat16), ("I32", 32, np.int32),
             ("U32", 32, np.uint32), ("F32", 32, np.float32), ("F64", 64, np.float64), ("I64", 64, np.int64),
             ("U64", 64, np.uint64)]
    return {name: DType(name, bits, np.dtype(storage), rank) for rank, (name, bits, storage) in enumerate(specs)}


DTYPES = _dtypes()
#: numpy dtype -> safetensors dtype, for arrays written without an explicit dtype (F4 is never inferred).
_INFERRED = {d.storage: d.name for d in DTYPES.values() if d.name != "F4"}


@dataclass(frozen=True)
class TensorEntry:
    """One header entry; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _element_bits(shape: tuple[int, ...], bits: int, limit: int) -> int:
    """prod(shape) * bits, or ``limit + 1`` as soon as the product passes ``limit`` (no giant products)."""
    if 0 in shape:
        return 0
    total = bits
    for dim in shape:
        total *= dim
        if total > limit:
            return limit + 1
    return total


def _parse_entry(path: Path, name: str, raw) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(raw, dict) or set(raw) != set(_ENTRY_KEYS):
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise FormatError(f"header entry must have exactly the keys {list(_ENTRY_KEYS)}, found {found!r}",
                          path=path, tensor=name)
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}", path=path, tensor=name)

    def is_count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise FormatError(f"shape must be a list of non-negative ints, found {shape!r}", path=path, tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(v) for v in offsets)):
        raise FormatError(f"data_offsets must be [begin, end] non-negative ints, found {offsets!r}",
                          path=path, tensor=name)
    begin, end = offsets
    if end < begin:
        raise FormatError(f"data_offsets end {end} is before begin {begin}", path=path, tensor=name)
    nbits = _element_bits(tuple(shape), DTYPES[dtype].bits, 8 * (end - begin))
    if nbits > 8 * (end - begin):
        raise FormatError(f"dtype {dtype} shape {shape} needs more bytes than data_offsets [{begin}, {end}] "
                          f"hold", path=path, tensor=name)
    if nbits % 8:
        raise FormatError(f"dtype {dtype} shape {shape} is {nbits} bits, not a whole number of bytes",
                          path=path, tensor=name)
    if nbits // 8 != end - begin:
        raise FormatError(f"dtype {dtype} shape {shape} needs {nbits // 8} bytes but data_offsets "
                          f"[{begin}, {end}] hold {end - begin}", path=path, tensor=name)
    if dtype == "F4" and (not shape or shape[-1] % 2):
        raise FormatError(f"F4 shape {shape} must have an even last dimension to be viewed as packed bytes",
                          path=path, tensor=name)
    return dtype, tuple(shape), begin, end


def _reject_duplicates(pairs):
    found = dict(pairs)
    if len(found) != len(pairs):
        keys = [k for k, _ in pairs]
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {dup!r}")
    return found


def _reject_constant(token: str):
    raise ValueError(f"non-standard JSON constant {token}")


class SafetensorsFile:
    """A parsed safetensors file.  Only the header is read at construction; data is mapped on first access."""

    def __init__(self, path: str | os.PathLike, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
        self.path = Path(path)
        self._map: np.memmap | None = None
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise MissingSourceError("no such safetensors file", path=self.path) from None
        with f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                raise TruncatedFileError(f"EOF reading the header length: expected {HEADER_LENGTH_BYTES} bytes, "
                                         f"got {len(head)}", path=self.path, offset=0)
            (n,) = struct.unpack("<Q", head)
            if n > max_header_bytes:
                raise FormatError(f"header length {n} exceeds the cap of {max_header_bytes} bytes (pass "
                                  f"max_header_bytes= to raise it if the file is genuine)", path=self.path, offset=0)
            if HEADER_LENGTH_BYTES + n > file_size:
                raise TruncatedFileError(f"header length {n} runs past the end of the file ({file_size} bytes)",
                                         path=self.path, offset=0)
            raw = f.read(n)
        if len(raw) != n:
            raise TruncatedFileError(f"EOF reading the header: expected {n} bytes, got {len(raw)}",
                                     path=self.path, offset=HEADER_LENGTH_BYTES)
        self.data_offset = HEADER_LENGTH_BYTES + n
        self.file_size = file_size
        self.metadata, self.entries = self._parse_header(raw, file_size - self.data_offset)

    def _parse_header(self, raw: bytes, data_size: int) -> tuple[dict[str, str], dict[str, TensorEntry]]:
        try:
            header = jsontext.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates,
                                    parse_constant=_reject_constant)
        except ValueError as e:   # UnicodeDecodeError included
            raise FormatError(f"header is not valid UTF-8 JSON: {e}", path=self.path,
                              offset=HEADER_LENGTH_BYTES) from None
        if not isinstance(header, dict):
            raise FormatError(f"header must be a JSON object, found {type(header).__name__}", path=self.path)
        metadata = header.pop(METADATA_KEY, {})
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise FormatError("__metadata__ must be an object of string to string", path=self.path,
                              field=METADATA_KEY)
        parsed = sorted(((name,) + _parse_entry(self.path, name, info) for name, info in header.items()),
                        key=lambda e: (e[3], e[4]))
        expected = 0
        entries = {}
        for name, dtype, shape, begin, end in parsed:
            if begin != expected:
                what = "overlaps the previous tensor" if begin < expected else "leaves a gap after the previous"
                raise FormatError(f"data_offsets [{begin}, {end}] {what} (expected begin {expected}); offsets "
                                  f"must be contiguous from 0", path=self.path, tensor=name)
            if end > data_size:
                raise TruncatedFileError(f"data_offsets [{begin}, {end}] run past the end of the data buffer "
                                         f"({data_size} bytes)", path=self.path, tensor=name)
            expected = end
            entries[name] = TensorEntry(name, dtype, shape, self.data_offset + begin, self.data_offset + end)
        if expected != data_size:
            raise FormatError(f"{data_size - expected} bytes after the last tensor: the data buffer must be "
                              f"covered exactly", path=self.path, offset=self.data_offset + expected)
        return metadata, entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise FormatError("no such tensor in this file", path=self.path, tensor=name) from None

    def array(self, name: str) -> np.ndarray:
        """Read-only view of a tensor's data (see the module docstring for the dtypes)."""
        e = self.entry(name)
        dtype = DTYPES[e.dtype]
        shape = e.shape[:-1] + (e.shape[-1] // 2,) if e.dtype == "F4" else e.shape
        if e.nbytes == 0:   # nothing to map (and a file may be all header)
            empty = np.zeros(shape, dtype=dtype.storage)
            empty.flags.writeable = False
            return empty
        if self._map is None:
            # A file changed since the header was read would make the views lie; refuse it.
            if os.path.getsize(self.path) != self.file_size:
                raise TruncatedFileError(f"file size changed since opening (was {self.file_size})", path=self.path)
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return np.asarray(self._map[e.begin:e.end]).view(dtype.storage).reshape(shape)

    def close(self) -> None:
        """Drop our reference to the map; views already handed out keep it alive until they are freed."""
        self._map = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# writer

def _resolve_dtype(name: str, arr: np.ndarray, explicit: str | None) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype and header shape of one array."""
    if explicit is None:
        dtype = _INFERRED.get(arr.dtype.newbyteorder("="))
        if dtype is None:
            raise FormatError(f"cannot store numpy dtype {arr.dtype} in safetensors; convert it or pass "
                              f"dtypes={{{name!r}: ...}}", tensor=name)
        return dtype, arr.shape
    if explicit not in DTYPES:
        raise FormatError(f"unknown dtype {explicit!r}; supported: {', '.join(DTYPES)}", tensor=name)
    if explicit == "F4":
        if arr.dtype.itemsize != 1 or arr.ndim == 0:
            raise FormatError(f"F4 is written from packed bytes (uint8/int8 [..., n/2]); got {arr.dtype} "
                              f"shape {arr.shape}", tensor=name)
        return "F4", arr.shape[:-1] + (2 * arr.shape[-1],)
    if 8 * arr.dtype.itemsize != DTYPES[explicit].bits:
        raise FormatError(f"dtype {explicit} needs {DTYPES[explicit].bits // 8}-byte elements, the array has "
                          f"{arr.dtype} ({arr.dtype.itemsize} bytes)", tensor=name)
    return explicit, arr.shape


def _little_endian_bytes(arr: np.ndarray) -> np.ndarray:
    """The array's elements in C order and little-endian, as a flat uint8 array (no copy when already so)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def safetensors_header(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None, *,
                       dtypes: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The padded header bytes (without the length prefix) and the order the data must follow."""
    dtypes = dict(dtypes or {})
    unknown = sorted(set(dtypes) - set(tensors))
    if unknown:
        raise FormatError(f"dtypes names tensors that are not being written: {unknown}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError("metadata must map str to str; convert values with str() or json.dumps()",
                          field=METADATA_KEY)
    resolved = {}
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise FormatError(f"invalid tensor name {name!r}")
        if not isinstance(arr, np.ndarray):
            raise FormatError(f"expected a numpy array, got {type(arr).__name__}", tensor=name)
        resolved[name] = _resolve_dtype(name, arr, dtypes.get(name))
    order = sorted(resolved, key=lambda n: (-DTYPES[resolved[n][0]].rank, n))
    header: dict[str, object] = {}
    if metadata is not None:
        header[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        dtype, shape = resolved[name]
        end = offset + tensors[name].nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % HEADER_ALIGNMENT), order


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None, *, dtypes: Mapping[str, str] | None = None,
                      overwrite: bool = False) -> Path:
    """Write ``tensors`` to ``path`` atomically; returns the path.

    The safetensors dtype is inferred from each array's numpy dtype (ml_dtypes included) unless ``dtypes``
    names it: then any array with the same element width is accepted as raw bits (uint8 codes as F8_E4M3,
    uint16 as BF16, ...); ``"F4"`` takes packed bytes ``[..., n/2]`` and records the logical shape ``[..., n]``.
    Arrays are written in C order whatever their memory layout.
    """
    header, order = safetensors_header(tensors, metadata, dtypes=dtypes)
    final = Path(path)
    with atomic_output(final, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name in order:
            f.write(_little_endian_bytes(tensors[name]))
        f.flush()
    return final
