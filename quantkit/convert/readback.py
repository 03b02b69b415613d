"""The partial output read back while the tensors are still being produced (step 8 of :mod:`.execute`, moved
forward): every payload's SHA-256 checked against the journal's, and the whole file's SHA-256 (the one the
release manifest records).

Both used to be passes after the last tensor: one over the payloads, then, after the rename, one over the whole
file (sequential: SHA-256 cannot be split), plus an fsync of the whole output.  On a GPU, where a tensor takes
milliseconds, those passes cost more than half the encoding time again.  Here:

* each payload is re-read and hashed as soon as it is reported written, in ``threads`` threads (any order);
* one thread reads the file in order behind the tensors: the final header (once the source hashes are known:
  ``final_header()`` blocks until they are), then every byte up to the end of the last tensor done in file
  order, asking another thread to flush what it has read to the disk every :data:`SYNC_BYTES` (one flush at a
  time; the hash never waits for the disk) so that the final fsync finds little left.  Tensors produced in file
  order keep it right behind them; produced largest first, most of it waits for the end, as the separate pass
  did.

What is read is what the file holds (``pread`` of the partial), never the bytes in memory that were written.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping

from ..errors import ValidationError
from ..io.atomic import HASH_CHUNK_BYTES
from ..io.gguf_writer import Layout
from .pool import partial_gone

#: Bytes read behind the tensors between two ``fdatasync`` calls of the whole-file thread.
SYNC_BYTES = 256 << 20
_datasync = getattr(os, "fdatasync", os.fsync)   # macOS has no fdatasync


class ReadBack:
    """Reads the partial behind the tensors (module docstring).  :meth:`written` for each payload as it is
    reported, then :meth:`result`; :meth:`cancel` on failure."""

    def __init__(self, partial: Path, identity: tuple[int, int] | None, layout: Layout,
                 journaled: Mapping[str, str], final_header: Callable[[], bytes], *, threads: int = 1):
        self._partial = partial
        self._layout = layout
        self._order = sorted(layout.tensors.values(), key=lambda t: t.offset)
        self._done: dict[str, str] = {}
        self._checks: list[Future] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._sha256: str | None = None
        try:   # the very file the caller created (``identity``: device and inode), as the workers check
            self._fd = os.open(partial, os.O_RDONLY)
        except FileNotFoundError:
            raise partial_gone(partial) from None
        st = os.fstat(self._fd)
        if identity is not None and (st.st_dev, st.st_ino) != identity:
            os.close(self._fd)
            raise partial_gone(partial)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="quantkit-verify")
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-sync")
        self._thread = threading.Thread(target=self._run, args=(final_header,), daemon=True,
                                        name="quantkit-file-hash")
        self._thread.start()
        for name, sha256 in journaled.items():
            self.written(name, sha256)

    def written(self, name: str, sha256: str) -> None:
        """Payload ``name`` is in the partial and its journal hash is ``sha256``."""
        self._checks.append(self._pool.submit(self._check, name, sha256))
        with self._cond:
            self._done[name] = sha256
            self._cond.notify()

    def _check(self, name: str, expected: str) -> None:
        t = self._layout.tensor(name)
        digest = hashlib.sha256()
        start = self._layout.data_offset + t.offset
        for at in range(start, start + t.nbytes, HASH_CHUNK_BYTES):
            digest.update(os.pread(self._fd, min(HASH_CHUNK_BYTES, start + t.nbytes - at), at))
        if digest.hexdigest() != expected:
            raise ValidationError(f"payload does not match its journal hash {expected}", path=self._partial,
                                  tensor=name)

    def _run(self, final_header: Callable[[], bytes]) -> None:
        try:
            header = final_header()
            digest = hashlib.sha256(header)
            at = synced = len(header)
            flushing = None
            for t in self._order:
                with self._cond:
                    while t.name not in self._done and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                at = self._hash(digest, at, self._layout.data_offset + t.offset + t.nbytes)
                if at - synced >= SYNC_BYTES and (flushing is None or flushing.done()):
                    if flushing is not None:
                        flushing.result()
                    flushing = self._syncer.submit(_datasync, self._fd)
                    synced = at
            self._hash(digest, at, self._layout.file_size)
            if flushing is not None:
                flushing.result()
            self._sha256 = digest.hexdigest()
        except BaseException as exc:  # noqa: BLE001 - raised by result(), in the converting thread
            self._error = exc

    def _hash(self, digest, start: int, end: int) -> int:
        for at in range(start, end, HASH_CHUNK_BYTES):
            digest.update(os.pread(self._fd, min(HASH_CHUNK_BYTES, end - at), at))
        return max(start, end)

    def result(self) -> str:
        """Wait for every check and the whole file's SHA-256 (with the final header); raise the first failure."""
        try:
            for check in self._checks:
                check.result()
            self._thread.join()
            if self._error is not None:
                raise self._error
            return self._sha256
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop reading (the whole-file thread at its next tensor; checks not started are dropped)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._thread.join()
        self._syncer.shutdown(wait=True)   # a flush under way still uses the descriptor
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
