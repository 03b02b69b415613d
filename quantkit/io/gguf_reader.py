"""Read GGUF files safely: every length is checked before anything is read or allocated with it.

The layout is specified in :mod:`quantkit.io.gguf`.  Validation happens in layers while parsing: each read is
bounds-checked against the remaining file bytes (a short read is a :class:`TruncatedFileError` naming what was
being read, the offset, and the bytes expected and found); each length and count is also capped by a named
limit (keyword arguments of :class:`GGUFFile`) so a corrupt header cannot make the reader build huge Python
structures; then values are checked for meaning (value types, UTF-8, duplicates, alignment); finally tensor
geometry and payload placement (type known, row a multiple of the block, aligned offsets, every payload inside
the file, no two payloads overlapping).

Tensor payloads are never copied: :meth:`GGUFFile.data` returns a read-only ``uint8`` view of the memory map.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import FormatError, MissingSourceError, TruncatedFileError, UnsupportedError
from .gguf import (ALIGNMENT_KEY, KV, MAGIC, MAX_DIMS, MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES, READ_VERSIONS,
                   SCALAR_DTYPES, SPLIT_COUNT, SPLIT_NO, ArrayOf, GGUFTensor, align, check_alignment,
                   check_tensor_geometry, check_tensor_name, min_value_bytes)

# Caps on what a header may declare.  The remaining-bytes checks already bound every read by the file size;
# these bound the Python objects built from it (a list of N strings costs far more memory than 8·N bytes).
#: ggml's own limit on one string (GGUF_MAX_STRING_LENGTH).
MAX_STRING_BYTES = 1 << 30
#: Items in one metadata array.  Vocabularies and merge lists hold up to ~10⁶ entries.
MAX_ARRAY_ITEMS = 1 << 26
#: Arrays of arrays (ggml itself rejects any nesting; gguf-py writes it).
MAX_ARRAY_DEPTH = 4
#: Metadata entries.  Real files hold tens to a few hundred.
MAX_KV_COUNT = 1 << 16
#: Tensors.  The largest MoE files hold a few thousand (tens of thousands with per-expert tensors).
MAX_TENSOR_COUNT = 1 << 20

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic (what is read next decides if it is a valid one)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


class _Cursor:
    """Bounds-checked little-endian reads; every read names what it reads, for the error message."""

    def __init__(self, buf, size: int, path: Path):
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0
        self.field_start = 0  # offset of the most recent read, where a semantic error points

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        self.field_start = self.pos
        if n > self.remaining:
            raise TruncatedFileError(f"EOF reading {what}: expected {n} bytes, got {self.remaining}",
                                     path=self.path, offset=self.pos)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def string(self, what: str, cap: int, cap_name: str) -> bytes:
        n = self.u64(f"{what} length")
        if n > cap:
            raise FormatError(f"{what} length is {n} bytes, more than the limit of {cap} ({cap_name})",
                              path=self.path, offset=self.field_start)
        return self.take(n, what)

    def strings(self, count: int, what: str, cap: int, cap_name: str) -> list[bytes]:
        """``count`` strings: :meth:`string` in a loop, unrolled because vocabularies hold ~10⁵ of them."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out = []
        for j in range(count):
            n = unpack(buf, pos)[0] if pos + 8 <= size else None
            if n is None or n > cap or pos + 8 + n > size:
                self.pos = pos
                self.string(f"{what} item {j}", cap, cap_name)  # raises the error for what failed above
            out.append(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
        self.pos = pos
        return out

    def error(self, message: str, **fields) -> FormatError:
        return FormatError(message, path=self.path, offset=self.field_start, **fields)


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped).  Use as a context manager or call :meth:`close`.

    Attributes: ``path``, ``version``, ``alignment``, ``data_offset`` (file offset of the data section),
    ``file_size``, ``metadata`` (key → :class:`KV`, in file order) and ``tensors`` (name → :class:`GGUFTensor`,
    in file order).  The keyword arguments cap what the header may declare; raise them to read an unusual
    file.
    """

    def __init__(self, path: str | os.PathLike, *, max_string_bytes: int = MAX_STRING_BYTES,
                 max_array_items: int = MAX_ARRAY_ITEMS, max_array_depth: int = MAX_ARRAY_DEPTH,
                 max_kv_count: int = MAX_KV_COUNT, max_tensor_count: int = MAX_TENSOR_COUNT):
        self.path = Path(path)
        self._max_string_bytes = max_string_bytes
        self._max_array_items = max_array_items
        self._max_array_depth = max_array_depth
        with open(self.path, "rb") as f:
            self.file_size = os.fstat(f.fileno()).st_size
            # mmap refuses empty files; an empty file is reported as truncated by the first read.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else None
        try:
            cur = _Cursor(self._map if self._map is not None else b"", self.file_size, self.path)
            n_tensors, n_kv = self._read_header(cur, max_kv_count, max_tensor_count)
            self.metadata = self._read_metadata(cur, n_kv)
            self.alignment = check_alignment(self.metadata.get(ALIGNMENT_KEY), path=self.path)
            self.tensors = self._read_tensor_infos(cur, n_tensors)
            self.data_offset = align(cur.pos, self.alignment)
            self._check_payloads()
        except BaseException:
            self.close()
            raise

    # -- header ---------------------------------------------------------------------------------------------

    def _read_header(self, cur: _Cursor, max_kv_count: int, max_tensor_count: int) -> tuple[int, int]:
        magic = cur.take(len(MAGIC), "magic")
        if magic != MAGIC:
            raise cur.error(f"not a GGUF file: magic is {magic!r}, expected {MAGIC!r}")
        self.version = cur.u32("version")
        if self.version not in READ_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise cur.error(f"GGUF version {self.version}{hint} is not supported; "
                            f"quantkit reads versions {sorted(READ_VERSIONS)}")
        n_tensors = cur.u64("tensor count")
        if n_tensors > max_tensor_count:
            raise cur.error(f"tensor count {n_tensors} exceeds the limit of {max_tensor_count} (max_tensor_count)")
        n_kv = cur.u64("metadata key/value count")
        if n_kv > max_kv_count:
            raise cur.error(f"metadata key/value count {n_kv} exceeds the limit of {max_kv_count} (max_kv_count)")
        need = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES
        if need > cur.remaining:
            raise TruncatedFileError(f"EOF reading {n_kv} key/value pairs and {n_tensors} tensor infos: expected "
                                     f"at least {need} bytes, got {cur.remaining}", path=self.path, offset=cur.pos)
        return n_tensors, n_kv

    # -- metadata -------------------------------------------------------------------------------------------

    def _read_metadata(self, cur: _Cursor, n_kv: int) -> dict[str, KV]:
        metadata: dict[str, KV] = {}
        for i in range(n_kv):
            raw = cur.string(f"key {i}", self._max_string_bytes, "max_string_bytes")
            try:
                key = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise cur.error(f"key {i} {raw!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not key:
                raise cur.error(f"key {i} is empty")
            if key in metadata:
                raise cur.error(f"duplicate key {key!r} (key {i}; first seen at key {list(metadata).index(key)})")
            vtype = self._read_type(cur, f"key {key!r} value type")
            metadata[key] = self._read_value(cur, vtype, f"key {key!r} value")
        return metadata

    def _read_type(self, cur: _Cursor, what: str) -> GGUFValueType:
        raw = cur.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            known = ", ".join(f"{t.value} {t.name}" for t in GGUFValueType)
            raise cur.error(f"{what} is {raw}, not a GGUF value type ({known})") from None

    def _read_value(self, cur: _Cursor, vtype: GGUFValueType, what: str) -> KV:
        if vtype is GGUFValueType.ARRAY:
            return self._read_array(cur, what, depth=1)
        if vtype is GGUFValueType.STRING:
            raw = cur.string(what, self._max_string_bytes, "max_string_bytes")
            return KV(raw.decode("utf-8", "surrogateescape"), vtype)
        dtype = SCALAR_DTYPES[vtype]
        value = np.frombuffer(cur.take(dtype.itemsize, what), dtype)[0].item()
        if vtype is GGUFValueType.BOOL:
            if value > 1:
                raise cur.error(f"{what} is a BOOL stored as {value}, expected 0 or 1")
            value = bool(value)
        return KV(value, vtype)

    def _read_array(self, cur: _Cursor, what: str, depth: int) -> KV:
        if depth > self._max_array_depth:
            raise cur.error(f"{what} nests arrays {depth} deep, more than the limit of {self._max_array_depth} "
                            f"(max_array_depth)")
        item = self._read_type(cur, f"{what} item type")
        count = cur.u64(f"{what} item count")
        if count > self._max_array_items:
            raise cur.error(f"{what} has {count} items, more than the limit of {self._max_array_items} "
                            f"(max_array_items)")
        vtype = ArrayOf(item)
        need = count * min_value_bytes(item)
        if need > cur.remaining:
            raise TruncatedFileError(f"EOF reading {what}: {count} items of type {item.name} need at least "
                                     f"{need} bytes, got {cur.remaining}", path=self.path, offset=cur.pos)
        if item in SCALAR_DTYPES:
            dtype = SCALAR_DTYPES[item]
            values = np.frombuffer(cur.take(count * dtype.itemsize, f"{what} items"), dtype)
            if item is GGUFValueType.BOOL:
                if count and values.max() > 1:
                    bad = int(np.argmax(values > 1))
                    raise cur.error(f"{what} item {bad} is a BOOL stored as {values[bad]}, expected 0 or 1")
                values = values.astype(bool)
                values.flags.writeable = False  # like every array read: a value, not a buffer to edit
            return KV(values, vtype)
        if item is GGUFValueType.STRING:
            raw = cur.strings(count, what, self._max_string_bytes, "max_string_bytes")
            return KV([r.decode("utf-8", "surrogateescape") for r in raw], vtype)
        # An item of an array of arrays is an array without a type prefix: item type, count, items.
        return KV([self._read_array(cur, f"{what} item {j}", depth + 1) for j in range(count)], vtype)

    # -- tensor infos ---------------------------------------------------------------------------------------

    def _read_tensor_infos(self, cur: _Cursor, n_tensors: int) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        for i in range(n_tensors):
            raw = cur.string(f"tensor info {i} name", self._max_string_bytes, "max_string_bytes")
            name = check_tensor_name(raw, path=self.path, offset=cur.field_start)
            if name in tensors:
                raise cur.error(f"duplicate tensor name {name!r} (tensor info {i}; first seen at tensor info "
                                f"{list(tensors).index(name)})")
            what = f"tensor info {i} ({name!r})"
            n_dims = cur.u32(f"{what} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.error(f"{what} has n_dims {n_dims}, expected 1 to {MAX_DIMS}")
            dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"{what} dims"))
            dims_at = cur.field_start
            type_id = cur.u32(f"{what} type")
            offset = cur.u64(f"{what} data offset")
            shape = tuple(reversed(dims))
            qtype, nbytes = check_tensor_geometry(name, shape, type_id, path=self.path, offset=dims_at)
            tensors[name] = GGUFTensor(name, shape, qtype, offset, nbytes)
        return tensors

    # -- payload placement ----------------------------------------------------------------------------------

    def _check_payloads(self) -> None:
        if self.tensors and self.data_offset > self.file_size:
            raise TruncatedFileError(f"EOF reading the data section: it starts at {self.data_offset} (header "
                                     f"padded to the alignment {self.alignment}), the file has "
                                     f"{self.file_size} bytes", path=self.path, offset=self.file_size)
        for t in self.tensors.values():
            start = self.data_offset + t.offset
            if t.offset % self.alignment:
                raise FormatError(f"data offset {t.offset} is not a multiple of the alignment {self.alignment}",
                                  path=self.path, tensor=t.name)
            if start + t.nbytes > self.file_size:
                got = max(0, self.file_size - start)
                raise TruncatedFileError(f"EOF reading the payload of {t.type.name}{list(t.shape)}: expected "
                                         f"{t.nbytes} bytes at file offset {start}, got {got}",
                                         path=self.path, tensor=t.name, offset=start)
        placed = sorted((t for t in self.tensors.values() if t.nbytes), key=lambda t: t.offset)
        for before, after in zip(placed, placed[1:]):
            if after.offset < before.offset + before.nbytes:
                raise FormatError(f"payload at data offset {after.offset} overlaps tensor {before.name!r} "
                                  f"(data bytes {before.offset}..{before.offset + before.nbytes})",
                                  path=self.path, tensor=after.name)

    # -- access ---------------------------------------------------------------------------------------------

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingSourceError(f"no tensor {name!r} among the file's {len(self.tensors)} tensors",
                                     path=self.path) from None

    def data(self, name: str) -> np.ndarray:
        """The payload of tensor ``name`` as a read-only ``uint8[*shape[:-1], row_bytes]`` view of the file."""
        t = self.tensor(name)
        if self._map is None:
            raise FormatError("the file is closed", path=self.path, tensor=name)
        flat = np.frombuffer(self._map, np.uint8, t.nbytes, self.data_offset + t.offset) if t.nbytes \
            else np.frombuffer(b"", np.uint8)
        return flat.reshape(*t.shape[:-1], t.row_bytes)

    def require_whole_model(self) -> None:
        """Refuse one shard of a llama.cpp split file (``split.count`` > 1) where a whole model is needed: the
        first shard holds the metadata and only some tensors, the others no metadata at all."""
        count = self.metadata.get(SPLIT_COUNT)
        if count is not None and count.value != 1:
            number = self.metadata[SPLIT_NO].value + 1 if SPLIT_NO in self.metadata else "?"
            raise UnsupportedError(f"shard {number} of {count.value} of a llama.cpp split file; running a model "
                                   f"from its shards is not implemented: merge them first (llama-gguf-split --merge, "
                                   f"or quantkit transport assemble with its manifest)", path=self.path)

    def ggml_layout_problem(self) -> str | None:
        """Where the payload placement departs from the contiguous, declaration-ordered layout that ggml's
        loader requires (and quantkit's writer produces); None when it does not."""
        expected = 0
        for t in self.tensors.values():
            if t.offset != expected:
                return f"tensor {t.name!r} is at data offset {t.offset}; ggml expects {expected}"
            expected += align(t.nbytes, self.alignment)
        return None

    def close(self) -> None:
        """Release the memory map.  Views returned by :meth:`data` keep the mapping alive until they are gone."""
        mapped, self._map = self._map, None
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:
                pass  # views still export the buffer; the mapping is released with the last of them

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
