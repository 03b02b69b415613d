"""Copy a byte range between files in bounded chunks while SHA-256 digests of it are updated.

The source is memory-mapped a chunk at a time: the digests read the mapped pages and ``pwrite`` copies them to the
destination, one copy of every byte (a read into a buffer first would be a second).  Each digest is updated in its
own worker thread (``hashlib`` releases the GIL on large buffers), so hashing overlaps the writing instead of adding
to it.  At most ``RING_DEPTH`` chunks are mapped at once: a chunk is unmapped only after every digest consumed it.

The source's size is checked before anything is mapped (a short source is a :class:`TruncatedFileError` naming it);
like every memory map, a file truncated by another process while it is being copied ends the process (SIGBUS), which
leaves the partial output and its journal for the resume.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import TruncatedFileError
from ..io.gguf_writer import pwrite_all

#: Bytes per mapped chunk: large enough to amortize system calls, small enough to keep several in flight.
CHUNK_BYTES = 8 << 20
#: Chunks in flight between the writer and the hashing threads.
RING_DEPTH = 4


def copy_range(src_fd: int, src_offset: int, length: int, dst_fd: int | None, dst_offset: int,
               digests: Sequence, *, src_path: Path | None = None, advance: Callable[[int], None] | None = None,
               chunk: int | None = None) -> None:
    """Copy ``length`` bytes from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset`` (no destination:
    only hash), updating every digest in ``digests`` with them in order.  ``advance(n)`` is called per chunk."""
    if length <= 0:
        return
    size = os.fstat(src_fd).st_size
    if src_offset + length > size:
        raise TruncatedFileError(f"EOF reading bytes {src_offset}..{src_offset + length}: the file has {size}",
                                 path=src_path, offset=size)
    chunk = chunk or CHUNK_BYTES
    in_flight: list[tuple[mmap.mmap, memoryview, list[Future]]] = []
    workers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-sha256") for _ in digests]
    try:
        done = 0
        while done < length:
            if len(in_flight) == RING_DEPTH:
                _release(*in_flight.pop(0))
            n = min(chunk, length - done)
            start = src_offset + done
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(src_fd, n + start - aligned, offset=aligned, access=mmap.ACCESS_READ)
            with memoryview(mapped) as whole:
                view = whole[start - aligned:]
            futures = [worker.submit(digest.update, view) for worker, digest in zip(workers, digests)]
            in_flight.append((mapped, view, futures))
            if dst_fd is not None:
                pwrite_all(dst_fd, view, dst_offset + done)
            done += n
            if advance is not None:
                advance(n)
        while in_flight:
            _release(*in_flight.pop(0))
    finally:
        for worker in workers:
            worker.shutdown(wait=True)
        for mapped, view, _ in in_flight:   # after an error: the workers are done with them now
            _unmap(mapped, view)


def progress_bar(total: int, enabled: bool, name: str):
    """A tqdm bar of bytes on stderr (``disable`` when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=not enabled,
                dynamic_ncols=True, smoothing=0.05)


def _release(mapped: mmap.mmap, view: memoryview, futures: list[Future]) -> None:
    for future in futures:
        future.result()
    _unmap(mapped, view)


def _unmap(mapped: mmap.mmap, view: memoryview) -> None:
    view.release()
    try:
        mapped.close()
    except BufferError:
        pass   # a view lives on in an exception's traceback: the mapping goes with the last of them
