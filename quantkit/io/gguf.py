"""GGUF containers: the byte layout quantkit reads and writes, and the pieces its reader and writer share.

Layout (little-endian throughout; quantkit neither reads nor writes the big-endian variant)::

    offset  bytes  field
    0       4      magic b"GGUF"
    4       4      u32 version.  quantkit reads 2 and 3 (identical little-endian layouts) and writes 3.
    8       8      u64 tensor_count
    16      8      u64 kv_count
    24             kv_count key/value pairs, each:
                     string key        u64 byte length + UTF-8 bytes; MUST be non-empty and unique
                     u32 value type    a GGUFValueType
                     value             fixed-size scalars as little-endian numbers; BOOL one byte, 0 or 1;
                                       STRING u64 byte length + bytes;
                                       ARRAY u32 item type + u64 count + count values of that item type
                                       (item type ARRAY nests: each item is item type + count + values)
    ...            tensor_count tensor infos, each:
                     string name       UTF-8, at most 63 bytes (ggml's GGML_MAX_NAME = 64 counts the NUL); unique
                     u32 n_dims        1..4
                     u64 dims[n_dims]  ggml order: dims[0] is the row length, so the numpy shape is dims reversed;
                                       dims[0] MUST be a multiple of the type's block size
                     u32 type          a ggml type id (``quantkit.formats.registry.layout``)
                     u64 offset        relative to the data section; a multiple of the alignment
    pad            zero bytes up to the next multiple of the alignment
    data           the data section: tensor payloads at their offsets

The alignment is the value of ``general.alignment`` (type UINT32, a power of two) or 32 when the key is absent.
Payload bytes of a tensor: rows × (dims[0] / block size) × bytes per block.

The writer places payloads in declaration order, each padded to the alignment, and pads the file's end: the
layout gguf-py and ggml write and the only one ggml's loader accepts.  The reader accepts any order and gaps,
but every payload MUST be aligned, inside the file, and disjoint from every other.

Strings: keys and tensor names MUST be valid UTF-8 (an error otherwise).  String *values* are decoded with
``surrogateescape`` and encoded back the same way, so a vocabulary holding invalid UTF-8 survives a round trip.

Metadata values are :class:`KV` pairs ``(value, type)``; ``type`` is a :class:`GGUFValueType` for scalars and
:class:`ArrayOf` for arrays.  Values as read: scalars as Python ``int``/``float``/``bool``/``str``, numeric and
bool arrays as read-only 1-D numpy arrays, string arrays as lists of ``str``, arrays of arrays as lists of
:class:`KV`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from ..errors import FormatError, UnsupportedError
from ..formats.registry import GGMLType, QuantFormat, layout

MAGIC = b"GGUF"
WRITE_VERSION = 3
#: Versions the reader accepts, and what each means.  v1 (u32 counts) is gone from ggml too.
READ_VERSIONS: dict[int, str] = {
    2: "u64 counts and lengths",
    3: "the v2 layout, also allowed big-endian (quantkit reads the little-endian form only)",
}
ALIGNMENT_KEY = "general.alignment"
#: The keys of a llama.cpp split shard (llama-gguf-split): its number from 0, the shard count, the tensors in all.
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
DEFAULT_ALIGNMENT = GGUF_DEFAULT_ALIGNMENT
#: ggml's GGML_MAX_NAME (64) counts the terminating NUL, so names hold at most 63 bytes.
MAX_NAME_BYTES = 63
#: ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
MAX_DIMS = 4
#: ggml stores dims and element counts as int64.
MAX_ELEMENTS = 2**63 - 1

#: Fixed-size value types: their numpy dtype (BOOL is one byte, checked to be 0 or 1).
SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
STRING_LENGTH_BYTES = 8
ARRAY_HEADER_BYTES = 4 + 8
MIN_KV_BYTES = STRING_LENGTH_BYTES + 1 + 4 + 1          # non-empty key, type, 1-byte value
MIN_TENSOR_INFO_BYTES = STRING_LENGTH_BYTES + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


@dataclass(frozen=True)
class ArrayOf:
    """The type of a GGUF array, e.g. ``ArrayOf(GGUFValueType.STRING)``.

    Each inner array of an array of arrays declares its own item type on the wire, so the outer type is
    ``ArrayOf(GGUFValueType.ARRAY)`` and its value is a list of :class:`KV`, one typed entry per inner array.
    """

    item: GGUFValueType

    def __str__(self) -> str:
        return f"ARRAY[{type_name(self.item)}]"


ValueType = Union[GGUFValueType, ArrayOf]


class KV(NamedTuple):
    """One metadata value with its explicit GGUF type."""

    value: Any
    type: ValueType


def type_name(vtype: ValueType) -> str:
    """``UINT32``, ``ARRAY[STRING]``, ``ARRAY[ARRAY]``."""
    return str(vtype) if isinstance(vtype, ArrayOf) else vtype.name


def min_value_bytes(vtype: ValueType) -> int:
    """Fewest bytes a value of ``vtype`` occupies: bounds how many items the remaining bytes can hold."""
    if isinstance(vtype, ArrayOf) or vtype is GGUFValueType.ARRAY:
        return ARRAY_HEADER_BYTES
    if vtype is GGUFValueType.STRING:
        return STRING_LENGTH_BYTES
    return SCALAR_DTYPES[vtype].itemsize


def ggml_dims(shape) -> tuple[int, ...]:
    """A numpy-order shape as ggml sees it: ``ggml_n_dims`` drops ggml's trailing (numpy's leading) size-1
    dimensions, as llama-quantize writes them ([1, 256, 1, 4] is stored as [256, 1, 4]: the same tensor)."""
    dims = tuple(int(d) for d in shape)
    while len(dims) > 1 and dims[0] == 1:
        dims = dims[1:]
    return dims


def align(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def check_alignment(kv: KV | None, **where) -> int:
    """The data alignment a metadata entry ``general.alignment`` declares (default 32 when absent)."""
    if kv is None:
        return DEFAULT_ALIGNMENT
    if kv.type is not GGUFValueType.UINT32:
        raise FormatError(f"{ALIGNMENT_KEY} must have type UINT32, found {type_name(kv.type)}",
                          field=ALIGNMENT_KEY, **where)
    value = int(kv.value)
    if value <= 0 or value & (value - 1):
        raise FormatError(f"{ALIGNMENT_KEY} must be a power of two, found {value}", field=ALIGNMENT_KEY, **where)
    return value


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor's entry in a GGUF file: numpy ``shape`` (row last), type, and where its payload lies."""

    name: str
    shape: tuple[int, ...]
    type: GGMLType
    offset: int
    """Byte offset relative to the start of the data section."""
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        """ggml order (row length first), as stored in the file."""
        return tuple(reversed(self.shape))

    @property
    def row_bytes(self) -> int:
        return layout(self.type).row_bytes(self.shape[-1])


def check_tensor_name(raw: bytes, **where) -> str:
    """Decode and check a tensor name (UTF-8, at most :data:`MAX_NAME_BYTES` bytes)."""
    if len(raw) > MAX_NAME_BYTES:
        raise FormatError(f"tensor name is {len(raw)} bytes, longer than ggml's limit of {MAX_NAME_BYTES}: "
                          f"{raw[:MAX_NAME_BYTES]!r}…", **where)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"tensor name {raw!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                          **where) from None


def check_tensor_geometry(name: str, shape: tuple[int, ...], type_id: int, **where) -> tuple[GGMLType, int]:
    """Validate a tensor's numpy ``shape`` and type id; return the type and payload size in bytes.

    Checks, in ggml's order: 1..4 dims, each a non-negative int64, element count within int64, type known,
    row length a multiple of the block size.
    """
    where = {"tensor": name, **where}
    if not 1 <= len(shape) <= MAX_DIMS:
        raise FormatError(f"tensor has {len(shape)} dimensions, expected 1 to {MAX_DIMS}", **where)
    for i, d in enumerate(shape):
        if not 0 <= d <= MAX_ELEMENTS:
            raise FormatError(f"dimension {i} of shape {shape} is {d}, expected 0..{MAX_ELEMENTS}", **where)
    n_elements = math.prod(shape)
    if n_elements > MAX_ELEMENTS:
        raise FormatError(f"shape {shape} has {n_elements} elements, more than int64 can count "
                          f"({MAX_ELEMENTS})", **where)
    fmt = _type_format(type_id, **where)
    if shape[-1] % fmt.block_size:
        raise FormatError(f"row length {shape[-1]} is not a multiple of {fmt.name}'s block size "
                          f"{fmt.block_size}", **where)
    return fmt.qtype, n_elements // fmt.block_size * fmt.type_size


def _type_format(type_id: int, **where) -> QuantFormat:
    """The format of a ggml type id; an unknown id is a :class:`FormatError` (the file is not one we can read)."""
    try:
        return layout(int(type_id))
    except UnsupportedError as exc:
        raise FormatError(exc.detail, **where) from None

