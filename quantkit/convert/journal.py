"""The conversion journal: which tensors of a partial output are written, with the SHA-256 of their bytes, and the
SHA-256 of every source file they were made from.

``<out>.journal`` sits next to ``<out>.partial``; JSON lines, appended one at a time and fsynced at once, except
tensor lines: those at most every :data:`TENSOR_SYNC_SECONDS` (a GPU writes hundreds of tensors a second, and an
fsync takes milliseconds; a tensor line lost with the machine only means that tensor is encoded again, and a
resume checks every payload the journal lists anyway)::

    {"journal": 3, "layout_sha256": "<hex>", "sources": [["<file>", size, mtime_ns], ...]}   first line
    {"source_sha256": {"<file>": "<hex>", ...}}  every source file's SHA-256, once all are known
    {"tensor": "<gguf name>", "sha256": "<hex>"}  a payload written completely
    {"renaming": "<hex>"}                       the verified partial is being renamed to the output

``layout_sha256`` is the SHA-256 of the planned header bytes with the source hashes still pending (metadata,
tensor names, shapes, types, offsets), and ``sources`` the size and mtime of every source file when the partial
was started: a journal is only ever applied to the partial of the same plan made from the same files.
``source_sha256`` holds the whole-file hashes the conversion computes anyway for the header
(:class:`quantkit.convert.source.Hashing`); it is written as soon as they are all known, before the next tensor
line, and in any case before ``renaming``.  Tensor lines may come before it (written while the source was still
being hashed, by the same run: see below).  A resumed run hashes the source again and keeps the journal's tensors
only if every file's hash equals the journal's, so a source edited in place with its size and mtime kept is
caught, naming the file.  A journal without ``source_sha256`` keeps nothing (:func:`read_journal`): the run that
wrote it died before the source was known, and a resume starts over with a fresh journal, so the tensor lines of
a journal that has the line were all made by runs that read the files it names.  ``renaming`` carries the SHA-256
of the final header: a run killed between the rename and the journal's removal left a finished output, which a
resume recognizes by that header.  A crash can cut the last line short: a final line that does not parse is
ignored (its tensor is simply encoded again); a bad line anywhere else is an error.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..errors import FormatError, ValidationError
from .source import FileHash
from ..io import jsontext

JOURNAL_SUFFIX = ".journal"
JOURNAL_VERSION = 3
#: Longest time a tensor line waits for its fsync (every other line is fsynced before its call returns).
TENSOR_SYNC_SECONDS = 0.5


def journal_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + JOURNAL_SUFFIX)


def _parse(path: Path) -> list[dict]:
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = jsontext.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            if number == len(lines):   # cut short by a crash while appending
                break
            raise FormatError(f"line {number} is not a JSON object ({exc})", path=path) from None
        records.append(record)
    return records


def _stat(h: FileHash) -> list:
    return [h.name, h.size, h.mtime_ns]


@dataclass
class JournalState:
    """What a journal says about its partial output."""

    done: dict[str, str] = field(default_factory=dict)
    """Tensor name → SHA-256 of its payload, for every payload written completely (none without
    ``source_sha256``: nothing says what they were made from)."""
    source_sha256: dict[str, str] | None = None
    """Source file name → SHA-256 of the whole file, as the run that started the partial found it."""
    renaming: str | None = None
    """SHA-256 of the final header, once the verified partial was being renamed to the output."""


def read_journal(path: Path, layout_sha256: str, sources: Iterable[FileHash]) -> JournalState:
    """The journal's record, after checking that it belongs to this layout and that no source file's size or
    mtime changed since the partial was started; the caller compares ``source_sha256`` with the source's hashes
    before it keeps ``done``."""
    records = _parse(path)
    if not records or records[0].get("journal") != JOURNAL_VERSION:
        raise FormatError(f"not a version-{JOURNAL_VERSION} conversion journal; start over with --force", path=path)
    head = records[0]
    if head.get("layout_sha256") != layout_sha256:
        raise ValidationError("the journal was written for another plan (recipe, source, imatrix or options "
                              "changed; the file records the imatrix path as given, so spell it as the first run "
                              "did); start over with --force", path=path)
    then = {entry[0]: entry for entry in head.get("sources", [])}
    for h in sources:
        if then.get(h.name) != _stat(h):
            raise ValidationError(f"source file {h.name!r} changed since the partial output was started (size or "
                                  f"modification time); start over with --force", path=path)
    state = JournalState()
    for record in records[1:]:
        if "tensor" in record:
            state.done[str(record["tensor"])] = str(record["sha256"])
        elif "source_sha256" in record:
            state.source_sha256 = {str(f): str(h) for f, h in dict(record["source_sha256"]).items()}
        elif "renaming" in record:
            state.renaming = str(record["renaming"])
    if state.source_sha256 is None:
        state.done.clear()
    return state


class Journal:
    """An open journal, appended to as tensors complete."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd
        self._synced = time.monotonic()
        self._unsynced = False

    @classmethod
    def create(cls, path: Path, layout_sha256: str, sources: Iterable[FileHash]) -> "Journal":
        """Start a fresh journal (replacing an old one): the layout and the size and mtime of each source file."""
        path.unlink(missing_ok=True)   # a new file, never a truncated one (see GGUFWriter.write_header)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        journal = cls(path, fd)
        journal._append({"journal": JOURNAL_VERSION, "layout_sha256": layout_sha256,
                         "sources": [_stat(h) for h in sources]})
        return journal

    @classmethod
    def reopen(cls, path: Path) -> "Journal":
        """Append to an existing journal (after :func:`read_journal` accepted it); a cut-short last line is dropped."""
        data = path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]
        fd = os.open(path, os.O_WRONLY)
        if len(keep) != len(data):
            os.ftruncate(fd, len(keep))
        os.lseek(fd, 0, os.SEEK_END)
        return cls(path, fd)

    def _append(self, record: dict, *, sync: bool = True) -> None:
        line = memoryview((json.dumps(record, separators=(",", ":")) + "\n").encode())
        try:
            while line:   # a short write (a disk filling up) goes on until the rest fits or the error comes
                line = line[os.write(self._fd, line):]
            self._unsynced = True
            if sync or time.monotonic() - self._synced >= TENSOR_SYNC_SECONDS:
                self._sync()
        except OSError as exc:   # name the journal (a full disk is reported with its path)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def _sync(self) -> None:
        os.fsync(self._fd)
        self._synced, self._unsynced = time.monotonic(), False

    def record(self, tensor: str, sha256: str) -> None:
        self._append({"tensor": tensor, "sha256": sha256}, sync=False)

    def record_sources(self, hashes: Iterable[FileHash]) -> None:
        """Every source file's SHA-256 (once, when all are known)."""
        self._append({"source_sha256": {h.name: h.sha256 for h in hashes}})

    def record_renaming(self, header_sha256: str) -> None:
        self._append({"renaming": header_sha256})

    def close(self) -> None:
        """fsync the tensor lines not yet synced (best effort: they only save work), and close."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if self._unsynced:
                self._sync()
        fd, self._fd = self._fd, None
        os.close(fd)
