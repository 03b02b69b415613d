"""The conversion journal: which tensors of a partial output are written, with the SHA-256 of their bytes.

``<out>.journal`` sits next to ``<out>.partial``; JSON lines, appended and fsynced one at a time::

    {"journal": 1, "layout_sha256": "<hex>", "sources": [["<file>", size, mtime_ns], ...]}   first line
    {"tensor": "<gguf name>", "sha256": "<hex>"}                   a payload written completely
    {"source": "<file>", "size": N, "mtime_ns": N, "sha256": "<hex>"}   a source file's hash, once known

``layout_sha256`` is the SHA-256 of the planned header bytes with the source hashes still pending (metadata,
tensor names, shapes, types, offsets), and ``sources`` the size and mtime of every source file when the partial
was started: a journal is only ever applied to the partial of the same plan made from the same files.  A crash
can cut the last line short: a final line that does not parse is ignored (its tensor is simply encoded again); a
bad line anywhere else is an error.  Source lines let a resumed run skip re-hashing unchanged files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from ..errors import FormatError, ValidationError
from .source import FileHash

JOURNAL_SUFFIX = ".journal"
JOURNAL_VERSION = 1


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
            record = json.loads(line)
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


def read_journal(path: Path, layout_sha256: str, sources: Iterable[FileHash]
                 ) -> tuple[dict[str, str], dict[str, FileHash]]:
    """(tensor name → SHA-256 of the payloads written, source file → its recorded hash), after checking that the
    journal belongs to this layout and that no source file changed since the partial was started."""
    records = _parse(path)
    if not records or records[0].get("journal") != JOURNAL_VERSION:
        raise FormatError(f"not a version-{JOURNAL_VERSION} conversion journal", path=path)
    head = records[0]
    if head.get("layout_sha256") != layout_sha256:
        raise ValidationError("the journal was written for another plan (recipe, source, imatrix or options "
                              "changed); start over with --force", path=path)
    then = {entry[0]: entry for entry in head.get("sources", [])}
    for h in sources:
        if then.get(h.name) != _stat(h):
            raise ValidationError(f"source file {h.name!r} changed since the partial output was started (size or "
                                  f"modification time); start over with --force", path=path)
    done: dict[str, str] = {}
    hashes: dict[str, FileHash] = {}
    for record in records[1:]:
        if "tensor" in record:
            done[str(record["tensor"])] = str(record["sha256"])
        elif "source" in record:
            hashes[record["source"]] = FileHash(record["source"], int(record["size"]), int(record["mtime_ns"]),
                                                str(record["sha256"]))
    return done, hashes


class Journal:
    """An open journal, appended to as tensors complete."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd

    @classmethod
    def create(cls, path: Path, layout_sha256: str, sources: Iterable[FileHash]) -> "Journal":
        """Start a fresh journal (replacing an old one): the layout and the size and mtime of each source file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        journal = cls(path, fd)
        journal._append({"journal": JOURNAL_VERSION, "layout_sha256": layout_sha256,
                         "sources": [_stat(h) for h in sources]})
        return journal

    @classmethod
    def reopen(cls, path: Path) -> "Journal":
        """Append to an existing journal (after :func:`read_done` accepted it); a cut-short last line is dropped."""
        data = path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]
        fd = os.open(path, os.O_WRONLY)
        if len(keep) != len(data):
            os.ftruncate(fd, len(keep))
        os.lseek(fd, 0, os.SEEK_END)
        return cls(path, fd)

    def _append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"short write to the journal {self.path} ({written} of {len(line)} bytes)")
        os.fsync(self._fd)

    def record(self, tensor: str, sha256: str) -> None:
        self._append({"tensor": tensor, "sha256": sha256})

    def record_source(self, h: FileHash) -> None:
        self._append({"source": h.name, "size": h.size, "mtime_ns": h.mtime_ns, "sha256": h.sha256})

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
