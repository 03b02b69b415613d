"""Copy a byte range between files in bounded chunks while SHA-256 digests of it are updated.

Reading and writing happen in the calling thread; each digest is updated in its own worker thread (``hashlib``
releases the GIL on large buffers), so hashing overlaps the I/O instead of adding to it.  Memory is bounded by
``RING_DEPTH × CHUNK_BYTES``: a buffer is refilled only after every digest has consumed it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import TruncatedFileError
from ..io.gguf_writer import pwrite_all

#: Bytes per read/write: large enough to amortize system calls, small enough to keep several in flight.
CHUNK_BYTES = 8 << 20
#: Buffers in flight between the reader and the hashing threads.
RING_DEPTH = 4


def copy_range(src_fd: int, src_offset: int, length: int, dst_fd: int | None, dst_offset: int,
               digests: Sequence, *, src_path: Path | None = None, advance: Callable[[int], None] | None = None,
               chunk: int | None = None) -> None:
    """Copy ``length`` bytes from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset`` (no destination:
    only hash), updating every digest in ``digests`` with them in order.  ``advance(n)`` is called per chunk.
    A source shorter than asked is a :class:`TruncatedFileError` naming ``src_path``."""
    if length <= 0:
        return
    chunk = chunk or CHUNK_BYTES
    ring = [bytearray(min(chunk, length)) for _ in range(min(RING_DEPTH, -(-length // chunk)))]
    pending: list[list[Future]] = [[] for _ in ring]
    workers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-sha256") for _ in digests]
    try:
        done = 0
        slot = 0
        while done < length:
            for future in pending[slot]:
                future.result()
            buf = memoryview(ring[slot])[:min(chunk, length - done)]
            _read_exactly(src_fd, buf, src_offset + done, src_path, src_offset + length)
            if dst_fd is not None:
                pwrite_all(dst_fd, buf, dst_offset + done)
            pending[slot] = [worker.submit(digest.update, buf) for worker, digest in zip(workers, digests)]
            done += len(buf)
            if advance is not None:
                advance(len(buf))
            slot = (slot + 1) % len(ring)
        for futures in pending:
            for future in futures:
                future.result()
    finally:
        for worker in workers:
            worker.shutdown(wait=True)


def _read_exactly(fd: int, buf: memoryview, offset: int, path: Path | None, end: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise TruncatedFileError(f"EOF reading bytes {offset + got}..{end}: the file ended at {offset + got}",
                                     path=path, offset=offset + got)
        got += n
