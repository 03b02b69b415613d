"""Atomic file output and streaming file hashes.

:func:`atomic_output` is how every quantkit writer creates a file: the caller writes ``<path>.partial``; on
success the partial is fsynced and renamed over ``path`` (a rename within one directory is atomic on POSIX), and
the directory is fsynced so the rename itself survives a crash.  On any exception the partial is removed and the
final path is never touched, so a reader never sees a half-written artifact under its final name.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import OutputExistsError

#: Read size for :func:`sha256_file`: large enough to amortize syscalls, small enough to bound memory.
HASH_CHUNK_BYTES = 8 << 20


def fsync_path(path: Path, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, overwrite: bool = False, suffix: str = ".partial") -> Iterator[Path]:
    """Yield the temporary path ``<path><suffix>`` for the caller to create and write.

    On normal exit the temporary file is fsynced and renamed to ``path``.  On an exception it is deleted and the
    exception propagates.  Raises :class:`OutputExistsError` up front (and again at the rename, if the file
    appeared meanwhile) when ``path`` exists and ``overwrite`` is false.  A stale partial from an earlier crashed
    run is replaced.
    """
    final = Path(path)
    if final.exists() and not overwrite:
        raise OutputExistsError("output exists; refusing to replace it", path=final)
    partial = final.with_name(final.name + suffix)
    partial.unlink(missing_ok=True)
    try:
        yield partial
        fsync_path(partial)
        if final.exists() and not overwrite:
            raise OutputExistsError("output appeared while writing; refusing to replace it", path=final)
        os.replace(partial, final)
        fsync_path(final.parent, directory=True)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def sha256_file(path: str | os.PathLike, chunk: int = HASH_CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces (memory bounded by ``chunk``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
