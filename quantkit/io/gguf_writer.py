"""Write GGUF files from a complete plan: payloads in any order, from several workers, resumable.

The layout is specified in :mod:`quantkit.io.gguf`.  Writing has two separate steps:

1. :func:`plan_layout` (pure) checks the metadata and tensor list and computes the header bytes, every tensor's
   offset (declaration order, each payload padded to the alignment) and the total file size.  Dry runs and
   validation use it without writing anything.
2. :class:`GGUFWriter` is a state machine over that plan::

       LAYOUT --write_header()--> HEADER --write_tensor()--> PAYLOADS --finish()--> FINISHED
       LAYOUT --resume()--------> HEADER or PAYLOADS               (close()/abort() --> CLOSED)

   ``write_header`` creates ``<path>.partial`` holding the header and sized to the final length (payload and
   padding bytes read as zeros until written).  ``write_tensor`` writes one payload at its planned offset with
   ``pwrite`` (threads may share a writer; other processes open their own with ``resume``) and returns the
   payload's SHA-256 for the caller's journal.  ``resume`` reopens an existing partial after checking its size
   and header bytes against the same plan, and takes the journal of payloads already written (verifying their
   hashes unless told not to).  ``write_header(overwrite)`` removes an old partial and creates a new file, never
   truncating one another process may still be writing.  ``finish`` checks that every planned tensor was written, fsyncs, and renames the
   partial to ``path``, refusing to replace an existing file unless ``overwrite=True``.

A writer closed or abandoned before ``finish`` (an exception inside ``with``, a killed process) leaves the
partial in place for ``resume`` and never creates ``path``.  :meth:`GGUFWriter.abort` deletes the partial this
writer created or resumed, never one it refused to touch (another run's, found by ``write_header``).
(:func:`quantkit.io.atomic.atomic_output` removes its partial on failure and replaces stale ones, which is
right for files written in one go but would throw away resumable work, so this writer manages its partial
itself.)

Metadata values need explicit GGUF types where Python's are ambiguous: ``bool``, ``str``, numpy scalars and 1-D
numpy arrays, and non-empty lists of ``str`` or of ``bool`` are typed by themselves; a Python ``int``, ``float``
or numeric list must come as ``KV(value, GGUFValueType.UINT32)`` etc.  Arrays of arrays are
``KV([KV(inner, ArrayOf(t)), ...], ArrayOf(GGUFValueType.ARRAY))``.
"""
from __future__ import annotations

import enum
import hashlib
import operator
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import FormatError, MissingSourceError, OutputExistsError, StateError, ValidationError
from ..formats.registry import GGMLType, layout
from .atomic import HASH_CHUNK_BYTES, fsync_path
from .gguf import (ALIGNMENT_KEY, KV, MAGIC, SCALAR_DTYPES, WRITE_VERSION, ArrayOf, GGUFTensor, align,
                   check_alignment, check_tensor_geometry, check_tensor_name, type_name)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
PARTIAL_SUFFIX = ".partial"
#: numpy (kind, itemsize) → GGUF type, for typing numpy scalars and arrays by themselves.
_NUMPY_KINDS = {(dt.kind, dt.itemsize): vt for vt, dt in SCALAR_DTYPES.items() if vt is not GGUFValueType.BOOL}


class TensorSpec(NamedTuple):
    """A tensor to plan: numpy ``shape`` (row last) and ggml type (enum, id or name)."""

    name: str
    shape: tuple[int, ...]
    type: "GGMLType | int | str"


@dataclass(frozen=True)
class Layout:
    """A planned GGUF file: what :func:`plan_layout` computed.  ``tensors`` carry their data offsets."""

    metadata: dict[str, KV]
    tensors: dict[str, GGUFTensor]
    alignment: int
    data_offset: int
    """File offset of the data section."""
    file_size: int
    header: bytes = field(repr=False)
    """Every byte before the data section's padding: magic, version, counts, metadata, tensor infos."""

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"tensor {name!r} is not in the planned layout ({len(self.tensors)} tensors)") \
                from None


# -- metadata encoding --------------------------------------------------------------------------------------

def typed(value: Any, what: str) -> KV:
    """``value`` with its GGUF type: a :class:`KV` as given, else the type the value states by itself."""
    if isinstance(value, KV):
        return value
    if isinstance(value, (bool, np.bool_)):
        return KV(bool(value), GGUFValueType.BOOL)
    if isinstance(value, str):
        return KV(value, GGUFValueType.STRING)
    if isinstance(value, np.generic) and (value.dtype.kind, value.dtype.itemsize) in _NUMPY_KINDS:
        return KV(value.item(), _NUMPY_KINDS[value.dtype.kind, value.dtype.itemsize])
    if isinstance(value, np.ndarray) and value.ndim == 1:
        if value.dtype.kind == "b":
            return KV(value, ArrayOf(GGUFValueType.BOOL))
        if (value.dtype.kind, value.dtype.itemsize) in _NUMPY_KINDS:
            return KV(value, ArrayOf(_NUMPY_KINDS[value.dtype.kind, value.dtype.itemsize]))
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, str) for v in value):
            return KV(list(value), ArrayOf(GGUFValueType.STRING))
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            return KV(list(value), ArrayOf(GGUFValueType.BOOL))
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:40] + "…"
    raise FormatError(f"{what}: the GGUF type of {type(value).__name__} {shown} is ambiguous; pass "
                      f"KV(value, GGUFValueType.<TYPE>) (for arrays KV(values, ArrayOf(GGUFValueType.<TYPE>)))")


def _encode_string(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise FormatError(f"{what}: expected a str for type STRING, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8", "surrogateescape")  # the reader's escapes turn back into the original bytes
    except UnicodeEncodeError as exc:
        raise FormatError(f"{what}: string is not encodable as UTF-8 ({exc.reason} at character {exc.start})") \
            from None
    return _U64.pack(len(raw)) + raw


_KIND_OF_TYPE = {"b": "a bool", "i": "an integer", "u": "an integer", "f": "a real number"}
#: numpy kinds (and Python types) a value may have to be stored as a given kind without reinterpretation.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_ACCEPTED_PY = {"b": (bool, np.bool_), "i": (int, np.integer), "u": (int, np.integer),
                "f": (int, float, np.integer, np.floating)}


def _encode_numbers(values: Any, vtype: GGUFValueType, what: str) -> bytes:
    """Fixed-size values as little-endian bytes, after checking each fits ``vtype`` exactly."""
    dtype = SCALAR_DTYPES[vtype]
    kind = "b" if vtype is GGUFValueType.BOOL else dtype.kind
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise FormatError(f"{what}: expected a 1-D array, got shape {values.shape}")
        if values.size and values.dtype.kind not in _ACCEPTED_KINDS[kind]:
            raise FormatError(f"{what}: values of numpy dtype {values.dtype} do not fit type {vtype.name}")
    else:
        values = list(values)
        for j, v in enumerate(values):
            if not isinstance(v, _ACCEPTED_PY[kind]) or (kind != "b" and isinstance(v, (bool, np.bool_))):
                raise FormatError(f"{what}: item {j} is {type(v).__name__} {v!r}, type {vtype.name} needs "
                                  f"{_KIND_OF_TYPE[kind]}")
    if not len(values):
        return b""
    if kind in "iu":
        info = np.iinfo(dtype)
        is_array = isinstance(values, np.ndarray)
        low, high = (int(values.min()), int(values.max())) if is_array else (min(values), max(values))
        if low < info.min or high > info.max:
            raise FormatError(f"{what}: values {low}..{high} do not fit type {vtype.name} "
                              f"({info.min}..{info.max})")
        # Python ints go through object arrays: numpy would turn a mix of uint64 and negative ints to float.
        return (values if is_array else np.array(values, dtype=object)).astype(dtype).tobytes()
    wide = np.asarray(values, dtype=np.float64 if kind == "f" else bool)
    with np.errstate(over="ignore"):
        out = wide.astype(dtype)
    if kind == "f" and not np.isfinite(out[np.isfinite(wide)]).all():
        raise FormatError(f"{what}: a finite value overflows type {vtype.name}")
    return out.tobytes()


def _encode_array(values: Any, item: GGUFValueType, what: str) -> bytes:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise FormatError(f"{what}: expected a sequence for type ARRAY[{item.name}], got {type(values).__name__}")
    if item is GGUFValueType.ARRAY:
        parts = []
        for j, v in enumerate(values):
            inner = typed(v, f"{what} item {j}")
            if not isinstance(inner.type, ArrayOf):
                raise FormatError(f"{what} item {j}: an array of arrays holds arrays, got type "
                                  f"{type_name(inner.type)}")
            parts.append(_encode_array(inner.value, inner.type.item, f"{what} item {j}"))
        body = b"".join(parts)
    elif item is GGUFValueType.STRING:
        body = b"".join(_encode_string(v, f"{what} item {j}") for j, v in enumerate(values))
    else:
        body = _encode_numbers(values, item, what)
    return _U32.pack(item) + _U64.pack(len(values)) + body


def _encode_kv(key: str, kv: KV) -> bytes:
    what = f"metadata {key!r}"
    if isinstance(kv.type, ArrayOf):
        value = _U32.pack(GGUFValueType.ARRAY) + _encode_array(kv.value, kv.type.item, what)
    elif kv.type is GGUFValueType.STRING:
        value = _U32.pack(kv.type) + _encode_string(kv.value, what)
    elif isinstance(kv.type, GGUFValueType) and kv.type in SCALAR_DTYPES:
        value = _U32.pack(kv.type) + _encode_numbers([kv.value], kv.type, what)
    else:
        raise FormatError(f"{what}: type {kv.type!r} is not a GGUF value type; arrays are ArrayOf(item type)")
    raw = _name_bytes(key, what)
    return _U64.pack(len(raw)) + raw + value


def _name_bytes(name: Any, what: str) -> bytes:
    """A key or tensor name as UTF-8; names must be non-empty ``str`` (strictly encodable)."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{what}: a name must be a non-empty str, got {name!r}")
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FormatError(f"{what}: name {name!r} is not encodable as UTF-8 ({exc.reason})") from None


# -- planning -----------------------------------------------------------------------------------------------

def plan_layout(metadata: Mapping[str, Any] | Iterable[tuple[str, Any]],
                tensors: Iterable[TensorSpec | GGUFTensor | tuple]) -> Layout:
    """Check metadata and tensors and compute the file's layout, writing nothing.

    ``metadata``: a mapping or ``(key, value)`` pairs (a repeated key is an error); values as described in the
    module docstring.  ``tensors``: :class:`TensorSpec`, ``(name, shape, type)`` tuples, or the tensors of a
    :class:`~quantkit.io.gguf_reader.GGUFFile` (their offsets are recomputed).  Offsets follow the given order.
    """
    pairs = list(metadata.items()) if isinstance(metadata, Mapping) else list(metadata)
    entries: dict[str, KV] = {}
    kv_bytes = []
    for key, value in pairs:
        if key in entries:
            raise FormatError(f"duplicate metadata key {key!r}", field=key)
        entries[key] = typed(value, f"metadata {key!r}")
        kv_bytes.append(_encode_kv(key, entries[key]))
    alignment = check_alignment(entries.get(ALIGNMENT_KEY))

    planned: dict[str, GGUFTensor] = {}
    info_bytes = []
    offset = 0
    for spec in tensors:
        name, shape, qtype = (spec.name, spec.shape, spec.type) if hasattr(spec, "name") else spec
        raw_name = _name_bytes(name, "tensor name")
        check_tensor_name(raw_name, tensor=name)
        if name in planned:
            raise FormatError("duplicate tensor name", tensor=name)
        try:
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise FormatError(f"shape {shape!r} must be a sequence of integers", tensor=name) from None
        qtype, nbytes = check_tensor_geometry(name, shape, layout(qtype).qtype)
        planned[name] = GGUFTensor(name, shape, qtype, offset, nbytes)
        info_bytes.append(_U64.pack(len(raw_name)) + raw_name + _U32.pack(len(shape))
                          + struct.pack(f"<{len(shape)}Q", *reversed(shape)) + _U32.pack(qtype) + _U64.pack(offset))
        offset += align(nbytes, alignment)

    header = b"".join([MAGIC, _U32.pack(WRITE_VERSION), _U64.pack(len(planned)), _U64.pack(len(entries)),
                       *kv_bytes, *info_bytes])
    data_offset = align(len(header), alignment)
    return Layout(entries, planned, alignment, data_offset, data_offset + offset, header)


# -- writing ------------------------------------------------------------------------------------------------

class WriterState(enum.Enum):
    LAYOUT = "layout (nothing written)"
    HEADER = "header written"
    PAYLOADS = "writing payloads"
    FINISHED = "finished"
    CLOSED = "closed unfinished"


def pwrite_all(fd: int, buf, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` of ``fd`` (the converter's workers write payloads in place this way)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):  # pwrite may write less than asked (Linux caps one call near 2 GiB)
        done += os.pwrite(fd, view[done:], offset + done)


def _payload_view(data: Any, t: GGUFTensor) -> memoryview:
    """The raw bytes of a payload, refusing data that would be written in the wrong byte order or layout."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise FormatError("payload array is not C-contiguous; pass np.ascontiguousarray(data)", tensor=t.name)
        if data.dtype.byteorder == ">":
            raise FormatError(f"payload dtype {data.dtype} is big-endian; GGUF is little-endian: pass "
                              f"data.astype(data.dtype.newbyteorder('<'))", tensor=t.name)
        view = memoryview(data.reshape(-1).view(np.uint8))
    else:
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise FormatError(f"payload must be a numpy array or a contiguous bytes-like object, got "
                              f"{type(data).__name__}", tensor=t.name) from None
    if view.nbytes != t.nbytes:
        raise FormatError(f"payload is {view.nbytes} bytes, the layout planned {t.nbytes} for "
                          f"{t.type.name}{list(t.shape)}", tensor=t.name)
    return view


class GGUFWriter:
    """Writes one planned GGUF file; see the module docstring for the states.  Thread-safe for ``write_tensor``.

    ``overwrite``: replace an existing file at ``path`` at ``finish`` (and an existing partial at
    ``write_header``); without it both are refused with :class:`OutputExistsError`.
    """

    def __init__(self, path: str | os.PathLike, layout: Layout, *, overwrite: bool = False):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.layout = layout
        self.overwrite = overwrite
        self.state = WriterState.LAYOUT
        self._fd: int | None = None
        self._owns_partial = False   # created or resumed here: only then may abort() delete it
        self._written: dict[str, str] = {}
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()

    @property
    def written(self) -> dict[str, str]:
        """Tensor name → SHA-256 hex of its payload, for every payload written (or resumed) so far."""
        with self._lock:
            return dict(self._written)

    def _expect(self, operation: str, *states: WriterState) -> None:
        if self.state not in states:
            expected = " or ".join(repr(s.value) for s in states)
            raise StateError(f"{operation}() needs the writer in state {expected}, but it is "
                              f"{self.state.value!r}", path=self.partial)

    def _refuse_existing_output(self) -> None:
        if not self.overwrite and self.path.exists():
            raise OutputExistsError("output exists; pass overwrite=True to replace it", path=self.path)

    def write_header(self) -> None:
        """Create the partial file: header, zero padding, and room for every payload."""
        self._expect("write_header", WriterState.LAYOUT)
        self._refuse_existing_output()
        if self.overwrite:   # a new file, never a truncated one: a process still writing the old partial keeps
            self.partial.unlink(missing_ok=True)   # its own inode instead of mixing bytes into this one
        try:
            self._fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise OutputExistsError("an unfinished partial output exists; resume it (GGUFWriter.resume) or pass "
                                    "overwrite=True to start over", path=self.partial) from None
        self._owns_partial = True
        pwrite_all(self._fd, self.layout.header, 0)
        os.ftruncate(self._fd, self.layout.file_size)
        self.state = WriterState.HEADER

    def resume(self, done: Mapping[str, str] | None = None, *, verify: bool = True, threads: int = 1,
               redo_damaged: bool = False) -> list[str]:
        """Reopen the partial an earlier writer of the same layout left.

        ``done``: tensor name → SHA-256 hex of payloads already written (the journal).  With ``verify`` their
        bytes are re-read and hashed (in ``threads`` threads); a mismatch is a :class:`ValidationError`, or with
        ``redo_damaged`` that tensor is left to be written again (a page lost in a crash after its journal line):
        the names so left are returned.
        """
        self._expect("resume", WriterState.LAYOUT)
        self._refuse_existing_output()
        try:
            fd = os.open(self.partial, os.O_RDWR)
        except FileNotFoundError:
            raise MissingSourceError("no partial output to resume", path=self.partial) from None
        try:
            damaged = self._check_partial(fd, done or {}, verify, threads, redo_damaged)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._owns_partial = True
        self._written = {name: sha for name, sha in (done or {}).items() if name not in damaged}
        self.state = WriterState.PAYLOADS if self._written else WriterState.HEADER
        return damaged

    def _check_partial(self, fd: int, done: Mapping[str, str], verify: bool, threads: int, redo_damaged: bool
                       ) -> list[str]:
        size = os.fstat(fd).st_size
        if size != self.layout.file_size:
            raise FormatError(f"partial is {size} bytes, the layout needs {self.layout.file_size}: it was written "
                              f"for another layout", path=self.partial)
        header = self.layout.header
        found = os.pread(fd, len(header), 0)
        if found != header:
            at = next(i for i, (a, b) in enumerate(zip(found, header)) if a != b)
            raise FormatError("partial's header differs from the planned layout: it was written for another "
                              "layout", path=self.partial, offset=at)
        tensors = [self.layout.tensor(name) for name in done]
        damaged: list[str] = []
        if not verify:
            return damaged
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="quantkit-verify") as pool:
            for t, found in zip(tensors, pool.map(lambda t: self._hash_payload(fd, t), tensors)):
                if found != done[t.name]:
                    if not redo_damaged:
                        raise ValidationError(f"payload does not match its journal hash {done[t.name]}",
                                              path=self.partial, tensor=t.name)
                    damaged.append(t.name)
        return damaged

    def _hash_payload(self, fd: int, t: GGUFTensor) -> str:
        digest = hashlib.sha256()
        start = self.layout.data_offset + t.offset
        for at in range(start, start + t.nbytes, HASH_CHUNK_BYTES):
            digest.update(os.pread(fd, min(HASH_CHUNK_BYTES, start + t.nbytes - at), at))
        return digest.hexdigest()

    def write_tensor(self, name: str, data: Any) -> str:
        """Write tensor ``name``'s payload (raw bytes of exactly the planned size); return its SHA-256 hex."""
        with self._lock:
            self._expect("write_tensor", WriterState.HEADER, WriterState.PAYLOADS)
            t = self.layout.tensor(name)
            if name in self._written or name in self._in_flight:
                raise FormatError("payload written twice", path=self.partial, tensor=name)
            self._in_flight.add(name)
        try:
            view = _payload_view(data, t)
            pwrite_all(self._fd, view, self.layout.data_offset + t.offset)
            digest = hashlib.sha256(view).hexdigest()
        finally:
            with self._lock:
                self._in_flight.discard(name)
        with self._lock:
            self._written[name] = digest
            self.state = WriterState.PAYLOADS
        return digest

    def finish(self) -> dict[str, str]:
        """Check every payload was written, fsync, rename to the final path; return name → SHA-256 hex."""
        with self._lock:
            self._expect("finish", WriterState.HEADER, WriterState.PAYLOADS)
            if self._in_flight:
                raise FormatError(f"payloads still being written: {sorted(self._in_flight)}", path=self.partial)
            missing = [n for n in self.layout.tensors if n not in self._written]
        if missing:
            listed = ", ".join(map(repr, missing[:5])) + (", …" if len(missing) > 5 else "")
            raise FormatError(f"{len(missing)} of {len(self.layout.tensors)} tensors were never written: "
                              f"{listed}", path=self.partial)
        size = os.fstat(self._fd).st_size
        if size != self.layout.file_size:
            raise FormatError(f"partial is {size} bytes, the layout needs {self.layout.file_size}: it was changed "
                              f"by someone else", path=self.partial)
        os.fsync(self._fd)
        self.close()
        self._refuse_existing_output()
        os.replace(self.partial, self.path)
        self._owns_partial = False   # a file under that name from now on is someone else's
        fsync_path(self.path.parent, directory=True)
        self.state = WriterState.FINISHED
        return self.written

    def close(self) -> None:
        """Close without finishing: the partial stays for :meth:`resume`."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self.state is not WriterState.FINISHED:
            self.state = WriterState.CLOSED

    def abort(self) -> None:
        """Close and delete the partial if this writer created or resumed it (a partial :meth:`write_header`
        refused is another run's: left as it is)."""
        self.close()
        if self._owns_partial:
            self.partial.unlink(missing_ok=True)

    def __enter__(self) -> "GGUFWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
