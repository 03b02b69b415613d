"""Importance-matrix files: llama.cpp's GGUF imatrix and the legacy ``.dat``, read and written.

GGUF imatrix (what ``llama-imatrix`` writes by default), a GGUF file (:mod:`quantkit.io.gguf`) holding

* ``general.type`` = ``"imatrix"`` (a file whose ``general.type`` is something else is refused: a model GGUF
  passed by mistake), ``imatrix.datasets`` (ARRAY[STRING]), ``imatrix.chunk_count`` and ``imatrix.chunk_size``
  (UINT32; any integer type is read);
* per weight ``W``: ``W.in_sum2`` F32 with ggml dims ``[n, n_mat]`` (raw Σx²), ``W.counts`` F32 ``[1, n_mat]`` and
  optionally ``W.in_sum`` F32 ``[n, n_mat]``.  As llama.cpp's loader does, ``n_mat`` is the number of counts and
  ``n = elements(in_sum2) / n_mat``; counts are whole numbers stored as floats.
* quantkit adds its provenance keys (:mod:`quantkit.imatrix.provenance`).  Entries are written in name order
  (in_sum2, counts, in_sum), like llama-imatrix.

Legacy ``.dat`` (little-endian)::

    i32 n_entries (>= 1)
    n_entries times:  i32 name length, name bytes (UTF-8), i32 ncall, i32 nval (>= 1),
                      f32 values[nval] = Σx² / count * ncall   (one ncall per entry, in chunks)
    optional:         i32 chunk count, i32 length, dataset name bytes

``ncall`` is ``ceil(max count / chunk size)``; an unobserved expert is written as mean 1.0 (value ``ncall``).
Reading keeps ``values`` as ``in_sum2`` and ``ncall`` as the count (``counts_unit = "chunks"``), which preserves
the importance ``values / ncall`` exactly.  Entries with no observation at all are left out (llama-imatrix does
the same); quantkit writes its dataset names joined by newlines, prefixed ``synthetic:`` for a synthetic imatrix.

:func:`load_imatrix` tells the formats apart by content (the GGUF magic), not by file name.  Writers go through
a temporary file renamed into place, so a failure leaves nothing under the output name.  Commands claim their
output with :func:`imatrix_output` before any work.
"""
from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType

from .. import __version__
from ..errors import FormatError, OutputExistsError, TruncatedFileError
from ..formats.registry import GGMLType
from ..io.atomic import LOCK_SUFFIX, atomic_output, check_output, output_lock, sha256_file
from ..io.gguf import KV, MAGIC, ArrayOf, type_name
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import PARTIAL_SUFFIX, GGUFWriter, TensorSpec, plan_layout
from .model import Entry, Imatrix, make_imatrix
from .provenance import (COUNTS_UNIT_KEY, KEY_PREFIX, SYNTHETIC_KEY, SYNTHETIC_PREFIX, datasets_are_synthetic)

GENERAL_TYPE = "imatrix"
DATASETS_KEY = "imatrix.datasets"
CHUNK_COUNT_KEY = "imatrix.chunk_count"
CHUNK_SIZE_KEY = "imatrix.chunk_size"
SUFFIXES = (".in_sum2", ".counts", ".in_sum")
FORMATS = ("gguf", "dat")
#: Legacy names are unbounded in the format; real ones are tensor names (< 64 bytes).
MAX_LEGACY_NAME_BYTES = 4096
MAX_LEGACY_DATASET_BYTES = 1 << 20
_I32 = struct.Struct("<i")
_INTEGER_TYPES = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                            GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64})


# -- loading ----------------------------------------------------------------------------------------------------

def load_imatrix(path: str | os.PathLike) -> Imatrix:
    """Read a GGUF imatrix or a legacy ``.dat`` (detected by content); every value is checked."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if not head:
        raise TruncatedFileError("EOF reading the first bytes: the file is empty", path=path, offset=0)
    with ThreadPoolExecutor(1, thread_name_prefix="quantkit-imatrix-hash") as hashing:   # beside the parsing
        digest = hashing.submit(sha256_file, path)
        imatrix = read_gguf_imatrix(path) if head == MAGIC else read_legacy_imatrix(path)
        imatrix.sha256 = digest.result()
    return imatrix


def read_gguf_imatrix(path: str | os.PathLike) -> Imatrix:
    path = Path(path)
    with GGUFFile(path) as f:
        meta = f.metadata
        gtype = meta.get("general.type")
        if gtype is not None and gtype.value != GENERAL_TYPE:
            raise FormatError(f"general.type is {gtype.value!r}, expected {GENERAL_TYPE!r}: not an imatrix file",
                              path=path, field="general.type")
        datasets = _string_array(meta.get(DATASETS_KEY), DATASETS_KEY, path)
        chunk_count = _integer(meta.get(CHUNK_COUNT_KEY), CHUNK_COUNT_KEY, path)
        chunk_size = _integer(meta.get(CHUNK_SIZE_KEY), CHUNK_SIZE_KEY, path)
        parts: dict[str, dict[str, np.ndarray]] = {}
        for name, t in f.tensors.items():
            suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                raise FormatError(f"unexpected tensor in an imatrix (entries are <weight>{'/'.join(SUFFIXES)})",
                                  path=path, tensor=name)
            if t.type is not GGMLType.F32:
                raise FormatError(f"imatrix tensors must be F32, found {t.type.name}", path=path, tensor=name)
            parts.setdefault(name[: -len(suffix)], {})[suffix] = np.array(f.data(name).view("<f4")).reshape(-1)
        synthetic_kv = meta.get(SYNTHETIC_KEY)
        unit_kv = meta.get(COUNTS_UNIT_KEY)
        provenance = {k[len(KEY_PREFIX):]: str(kv.value) for k, kv in meta.items()
                      if k.startswith(KEY_PREFIX) and k not in (SYNTHETIC_KEY, COUNTS_UNIT_KEY)}
    if not parts:
        raise FormatError("no imatrix entries (no tensors) in the file", path=path)
    entries = {name: _gguf_entry(name, p, path) for name, p in sorted(parts.items())}
    if synthetic_kv is not None and synthetic_kv.type is not GGUFValueType.BOOL:
        raise FormatError(f"must be a BOOL, found {type_name(synthetic_kv.type)}", path=path, field=SYNTHETIC_KEY)
    synthetic = bool(synthetic_kv.value) if synthetic_kv is not None else False
    return make_imatrix(entries, datasets=datasets, chunk_count=chunk_count, chunk_size=chunk_size,
                        synthetic=synthetic or datasets_are_synthetic(datasets),
                        counts_unit=str(unit_kv.value) if unit_kv is not None else "tokens",
                        provenance=provenance, path=path)


def _gguf_entry(name: str, parts: dict[str, np.ndarray], path: Path) -> Entry:
    for needed in (".in_sum2", ".counts"):
        if needed not in parts:
            raise FormatError(f"entry has no {needed} tensor (mismatched sums and counts)", path=path, tensor=name)
    in_sum2, counts = parts[".in_sum2"], parts[".counts"]
    n_mat = counts.size
    if n_mat == 0 or in_sum2.size == 0 or in_sum2.size % n_mat:
        raise FormatError(f"{in_sum2.size} sums do not divide into {n_mat} matrices (mismatched expert counts)",
                          path=path, tensor=name)
    in_sum = parts.get(".in_sum")
    return Entry(in_sum2.reshape(n_mat, -1), counts, None if in_sum is None else in_sum.reshape(n_mat, -1))


def _string_array(kv: KV | None, key: str, path: Path) -> list[str]:
    if kv is None:
        return []
    if kv.type != ArrayOf(GGUFValueType.STRING):
        raise FormatError(f"must be ARRAY[STRING], found {type_name(kv.type)}", path=path, field=key)
    return list(kv.value)


def _integer(kv: KV | None, key: str, path: Path) -> int:
    if kv is None:
        return 0
    if kv.type not in _INTEGER_TYPES:
        raise FormatError(f"must be an integer, found {type_name(kv.type)}", path=path, field=key)
    return int(kv.value)


class _Reader:
    """Bounds-checked reads of a legacy file; each read names what it reads."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.path, self.pos = data, path, 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise TruncatedFileError(f"EOF reading {what}: expected {n} bytes, got {self.remaining}",
                                     path=self.path, offset=self.pos)
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def i32(self, what: str) -> int:
        return _I32.unpack(self.take(4, what))[0]

    def error(self, message: str) -> FormatError:
        return FormatError(message, path=self.path, offset=self.pos)


def read_legacy_imatrix(path: str | os.PathLike) -> Imatrix:
    path = Path(path)
    r = _Reader(path.read_bytes(), path)
    n_entries = r.i32("entry count")
    min_entry_bytes = 4 + 1 + 4 + 4 + 4
    if n_entries < 1:
        raise r.error(f"entry count is {n_entries}, expected at least 1 (not a legacy imatrix?)")
    if n_entries * min_entry_bytes > r.remaining:
        raise TruncatedFileError(f"EOF reading {n_entries} entries: expected at least {n_entries * min_entry_bytes}"
                                 f" bytes, got {r.remaining} (not a legacy imatrix?)", path=path, offset=r.pos)
    entries: dict[str, Entry] = {}
    for i in range(n_entries):
        length = r.i32(f"entry {i} name length")
        if not 1 <= length <= MAX_LEGACY_NAME_BYTES:
            raise r.error(f"entry {i} name length is {length}, expected 1..{MAX_LEGACY_NAME_BYTES}")
        raw = r.take(length, f"entry {i} name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise r.error(f"entry {i} name {raw[:40]!r} is not UTF-8 (not a legacy imatrix?)") from None
        if name in entries:
            raise r.error(f"duplicate entry name {name!r}")
        ncall = r.i32(f"entry {name!r} ncall")
        nval = r.i32(f"entry {name!r} value count")
        if nval < 1:
            raise r.error(f"entry {name!r} has {nval} values, expected at least 1")
        values = np.frombuffer(r.take(4 * nval, f"entry {name!r} values"), "<f4").astype(np.float32)
        if ncall < 0:
            raise r.error(f"entry {name!r} has ncall {ncall}, expected >= 0")
        entries[name] = Entry(values.reshape(1, nval), np.array([ncall], np.float32))
    chunk_count, datasets = 0, []
    if r.remaining:
        chunk_count = r.i32("chunk count")
        length = r.i32("dataset name length")
        if not 0 <= length <= MAX_LEGACY_DATASET_BYTES:
            raise r.error(f"dataset name length is {length}, expected 0..{MAX_LEGACY_DATASET_BYTES}")
        text = r.take(length, "dataset name").decode("utf-8", "surrogateescape")
        datasets = text.split("\n") if text else []
        if r.remaining:
            raise r.error(f"{r.remaining} unexpected bytes after the dataset name")
    if chunk_count < 0:
        raise FormatError(f"chunk count is {chunk_count}, expected >= 0", path=path)
    return make_imatrix(entries, datasets=datasets, chunk_count=chunk_count, chunk_size=0,
                        synthetic=datasets_are_synthetic(datasets), counts_unit="chunks", path=path)


# -- saving -----------------------------------------------------------------------------------------------------

def output_format(path: str | os.PathLike, fmt: str | None = None) -> str:
    """``fmt`` if given, else ``dat`` for a ``.dat`` file name and ``gguf`` otherwise."""
    if fmt is None:
        return "dat" if Path(path).suffix.lower() == ".dat" else "gguf"
    if fmt not in FORMATS:
        raise FormatError(f"unknown imatrix format {fmt!r}; choose one of {FORMATS}")
    return fmt


@contextlib.contextmanager
def imatrix_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
                   also: Iterable[Path] = ()) -> Iterator[Path]:
    """Claim ``path`` for an imatrix, before any work: refuse it (and its partial, its lock and the ``also``
    paths the caller writes beside it) when it is one of ``inputs`` (even with ``overwrite``), and an existing
    output or a leftover partial unless ``overwrite``; then hold the output's lock
    (:func:`~quantkit.io.atomic.output_lock`) while the caller works and saves, so a second writer of the same
    output is refused instead of replacing this one's partial."""
    out = Path(path)
    inputs = list(inputs)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    check_output(out, inputs=inputs, overwrite=overwrite)
    for extra in (partial, out.with_name(out.name + LOCK_SUFFIX), *also):
        check_output(extra, inputs=inputs, overwrite=True)
    with output_lock(out):
        if partial.exists() and not overwrite:   # an interrupted run's, or a writer that takes no lock
            raise OutputExistsError("an unfinished write of this output exists (a partial output left by an "
                                    "interrupted run, or another program still writing it); refusing to replace "
                                    "it", path=partial)
        yield out


def save_imatrix(imatrix: Imatrix, path: str | os.PathLike, *, fmt: str | None = None,
                 overwrite: bool = False) -> None:
    """Write ``imatrix`` as a GGUF imatrix or legacy ``.dat`` (``fmt``, or by file name, see :func:`output_format`)."""
    if output_format(path, fmt) == "dat":
        write_legacy_imatrix(imatrix, path, overwrite=overwrite)
    else:
        write_gguf_imatrix(imatrix, path, overwrite=overwrite)


def gguf_metadata(imatrix: Imatrix) -> list[tuple[str, KV]]:
    meta = [
        ("general.type", KV(GENERAL_TYPE, GGUFValueType.STRING)),
        (DATASETS_KEY, KV(list(imatrix.datasets), ArrayOf(GGUFValueType.STRING))),
        (CHUNK_COUNT_KEY, KV(imatrix.chunk_count, GGUFValueType.UINT32)),
        (CHUNK_SIZE_KEY, KV(imatrix.chunk_size, GGUFValueType.UINT32)),
        (SYNTHETIC_KEY, KV(bool(imatrix.synthetic), GGUFValueType.BOOL)),
    ]
    if imatrix.counts_unit != "tokens":
        meta.append((COUNTS_UNIT_KEY, KV(imatrix.counts_unit, GGUFValueType.STRING)))
    provenance = {"quantkit_version": __version__, **imatrix.provenance}
    meta += [(KEY_PREFIX + k, KV(str(v), GGUFValueType.STRING)) for k, v in sorted(provenance.items())]
    return meta


def write_gguf_imatrix(imatrix: Imatrix, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    payloads: dict[str, np.ndarray] = {}
    for name in sorted(imatrix.entries):
        e = imatrix.entries[name]
        payloads[name + ".in_sum2"] = e.in_sum2
        payloads[name + ".counts"] = e.counts.reshape(e.n_mat, 1)
        if e.in_sum is not None:
            payloads[name + ".in_sum"] = e.in_sum
    layout = plan_layout(gguf_metadata(imatrix),
                         [TensorSpec(n, a.shape, GGMLType.F32) for n, a in payloads.items()])
    writer = GGUFWriter(path, layout, overwrite=overwrite)
    try:
        writer.write_header()
        for name, array in payloads.items():
            writer.write_tensor(name, np.ascontiguousarray(array, dtype="<f4"))
        writer.finish()
    except BaseException:
        writer.abort()
        raise


def _legacy_values(e: Entry, ncall: int, counts_unit: str) -> np.ndarray:
    """float32 values of one entry as llama-imatrix writes them: ``(Σx² / count) * ncall``, 1 for count 0."""
    out = np.empty_like(e.in_sum2)
    for m in range(e.n_mat):
        count = e.counts[m]
        if count == 0:
            out[m] = np.float32(ncall)
        elif counts_unit == "chunks" and count == ncall:
            out[m] = e.in_sum2[m]  # already Σx²/count·ncall: keep the bits
        else:
            out[m] = (e.in_sum2[m] / count) * np.float32(ncall)
    return out.reshape(-1)


def write_legacy_imatrix(imatrix: Imatrix, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    stored = {n: e for n, e in sorted(imatrix.entries.items()) if e.observed.any()}
    if imatrix.counts_unit == "tokens" and imatrix.chunk_size <= 0:
        raise FormatError("a legacy .dat stores counts in chunks, and this imatrix has no chunk size "
                          "(imatrix.chunk_size is 0)", path=imatrix.path, field=CHUNK_SIZE_KEY)
    parts = [_I32.pack(len(stored))]
    for name, e in stored.items():
        max_count = int(e.counts.max())
        ncall = max_count if imatrix.counts_unit == "chunks" else -(-max_count // imatrix.chunk_size)
        if ncall >= 2**31:
            raise FormatError(f"{ncall} chunk calls do not fit the .dat format's int32", tensor=name)
        raw = name.encode("utf-8")
        values = _legacy_values(e, ncall, imatrix.counts_unit)
        parts += [_I32.pack(len(raw)), raw, _I32.pack(ncall), _I32.pack(values.size), values.astype("<f4").tobytes()]
    datasets = list(imatrix.datasets)
    if imatrix.synthetic and not datasets_are_synthetic(datasets):
        datasets = [SYNTHETIC_PREFIX + (datasets[0] if datasets else "")] + datasets[1:]
    text = "\n".join(datasets).encode("utf-8", "surrogateescape")
    parts += [_I32.pack(imatrix.chunk_count), _I32.pack(len(text)), text]
    with atomic_output(path, overwrite=overwrite) as tmp:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
