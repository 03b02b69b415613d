"""Atomic file output and streaming file hashes.

:func:`atomic_output` is how every quantkit writer creates a file: the caller writes ``<path>.partial``; on
success the partial is fsynced and renamed over ``path`` (a rename within one directory is atomic on POSIX), and
the directory is fsynced so the rename itself survives a crash.  On any exception the partial is removed and the
final path is never touched, so a reader never sees a half-written artifact under its final name.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import ConcurrentWriteError, OutputExistsError, OutputPathError

#: Read size for :func:`sha256_file`: large enough to amortize syscalls, small enough to bound memory.
HASH_CHUNK_BYTES = 8 << 20
LOCK_SUFFIX = ".lock"
#: errno values of a full filesystem: no space (ENOSPC), the user's quota exhausted (EDQUOT).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same path once links are resolved, or one inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:   # one of them does not exist (or cannot be reached): not the same existing file
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def input_files(paths: Iterable[str | os.PathLike | None]) -> list[Path]:
    """The files a command reads, for :func:`check_output`: each existing file, and every file inside each existing
    directory and its folders one level down (a checkpoint's shards, config and index; a fixture's manifest and
    its prompts/, continuations/ and responses/)."""
    found = []
    for given in paths:
        if given is None:
            continue
        path = Path(given)
        if path.is_dir():
            for p in path.iterdir():
                if p.is_dir():
                    found.extend(q for q in p.iterdir() if q.is_file())
                elif p.is_file():
                    found.append(p)
        elif path.exists():
            found.append(path)
    return found


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
                 what: str = "output") -> Path:
    """Refuse an output ``path`` that is (or links to) one of ``inputs``, is a directory, a device, pipe or socket,
    exists while ``overwrite`` is false, or lies in a directory where no file can be created; checked before the
    work starts, so a long run cannot fail at its last step.  Returns ``path``."""
    path = Path(path)
    for source in inputs:
        if same_file(path, source):
            raise OutputPathError(f"the {what} would overwrite an input of this command ({source}); inputs are "
                                  f"never written: choose another path", path=path)
    if path.is_dir():
        raise OutputPathError(f"the {what} is a directory; give a file path", path=path)
    if path.exists() and not path.is_file():    # replaced whole by a rename: --force -o /dev/null would delete it
        raise OutputPathError(f"the {what} is a device, pipe or socket, not a regular file: outputs are written "
                              f"whole and renamed into place; give a file path", path=path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{what} exists; refusing to replace it", path=path)
    directory = path.parent
    if not directory.is_dir():
        raise OutputPathError(f"the {what}'s directory {str(directory)!r} does not exist", path=path)
    try:   # the one reliable test (read-only filesystems, ACLs, root): create a file there, then remove it
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise OutputPathError(f"cannot create the {what} in {str(directory)!r}: {exc.strerror or exc}",
                              path=path) from None
    os.close(fd)
    os.unlink(probe)
    return path


def check_output_dir(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (),
                     overwrite: bool = False, what: str = "output directory") -> Path:
    """:func:`check_output` for a directory written whole and renamed into place (a fixture): refused when it is,
    or holds, one of ``inputs`` (files or directories: replacing it would delete them, also with ``overwrite``),
    when it is a file, and when it exists unless ``overwrite``.  Returns ``path``."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    for given in inputs:
        if given is None:
            continue
        source = Path(os.path.realpath(given))
        if target == source or target in source.parents:
            raise OutputPathError(f"the {what} would replace an input of this command ({given}); inputs are never "
                                  f"written: choose another path", path=path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"the {what} is a file; give a directory path", path=path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{what} exists; refusing to replace it", path=path)
    return path


def _holder(fd: int) -> str:
    text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    return text or "a process that is starting"


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on ``<path>.lock`` (``flock``, released by the kernel when the holder dies, so a
    killed run leaves no stale lock).  Raises :class:`ConcurrentWriteError` naming the holder when another process
    holds it.  The lock file is removed on exit, while still locked: a waiter that opened the old file notices
    that it is no longer the one at the path and opens again."""
    final = Path(path)
    lock = final.with_name(final.name + LOCK_SUFFIX)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConcurrentWriteError(f"another process ({holder}) is writing this output (it holds {lock}); "
                                       f"wait for it to finish or stop it", path=final) from None
        mine = os.fstat(fd)
        try:
            there = os.stat(lock)
        except FileNotFoundError:
            there = None
        if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)   # the previous holder removed this file between our open and our lock: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield lock
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


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
        commit_partial(partial, final, overwrite=overwrite)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def commit_partial(partial: Path, final: Path, *, overwrite: bool) -> None:
    """The end of :func:`atomic_output` once ``partial`` is fsynced: refuse a ``final`` that appeared meanwhile
    (unless ``overwrite``), rename, and fsync the directory so the rename survives a crash."""
    if final.exists() and not overwrite:
        raise OutputExistsError("output appeared while writing; refusing to replace it", path=final)
    os.replace(partial, final)
    fsync_path(final.parent, directory=True)


def sha256_file(path: str | os.PathLike, chunk: int = HASH_CHUNK_BYTES,
                progress: Callable[[int], None] | None = None) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces (memory bounded by ``chunk``); ``progress`` is called
    with each piece's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()
