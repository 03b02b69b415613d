"""Copy a byte range between files in bounded chunks while SHA-256 digests of it are updated, and make what was
written durable while the copy goes on.

Reading: ``preadv`` into a ring of :data:`RING_DEPTH` reused buffers of :data:`CHUNK_BYTES`.  (A memory map per
chunk, the earlier design, faulted every page in anew: the copy alone took 2.5x ``cp``'s time; and a source truncated
under a map ends the process with SIGBUS, where a short read is an error naming the file.)  Each digest is updated in
its own worker thread (``hashlib`` releases the GIL on large buffers) while this thread writes the same buffer, so
hashing overlaps the writing; a buffer is refilled only after every digest consumed it.

Durability: :class:`Syncer`.  Linux starts writing dirty pages back only past ``vm.dirty_background_ratio`` of memory
(gigabytes), so a copy that fsyncs at the end writes the disk only after it has finished with the CPU: ``cp`` then
``sync``'s timeline, with the hashing added in front.  The syncer's thread calls ``fdatasync`` on the output every
:data:`WRITEBACK_BYTES` written, so the disk works while the digests do, and runs the steps that must follow a
complete sync (a part's fsync and rename; a journal entry) in order, behind the copy of the next part.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import TruncatedFileError
from ..io.gguf_writer import pwrite_all

#: Bytes per chunk: large enough to amortize system calls and thread hand-offs, small enough that a buffer stays in
#: the CPU's caches from the read that fills it to the digests and the write that consume it (8 MiB chunks cost the
#: copy 3x the kernel time of 1 MiB ones on the 2-core bench machine: bench/results/transport-2026-12-02b.md).
CHUNK_BYTES = 1 << 20
#: Chunks in flight between the writer and the hashing threads.
RING_DEPTH = 8
#: Bytes written to an output between two background ``fdatasync`` calls on it (early writeback).
WRITEBACK_BYTES = 64 << 20


def sync_data(fd: int) -> None:
    """``fdatasync``: the one call the syncer makes to reach the disk (tests replace it to inject a failure)."""
    os.fdatasync(fd)


class Syncer:
    """One background thread that makes written bytes durable while the next ones are copied.

    :meth:`wrote` (called by :func:`copy_range`) queues an early ``fdatasync`` of an output every
    :data:`WRITEBACK_BYTES`; :meth:`then` queues a step that runs after every sync and step queued before it; steps
    call :meth:`sync` to make an output durable.  An early sync's failure is kept and raised by the next :meth:`sync`
    of that output: Linux reports a writeback error to one ``fsync`` only, so a later call could succeed over lost
    bytes.  After a step fails the later steps are skipped (a journal must not list a part behind one whose sync
    failed); :meth:`check` raises that failure (call it between parts, to stop early), :meth:`drain` waits for every
    step, then does the same.  Leaving the ``with`` block waits for the thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-sync")
        self._written: dict[int, int] = {}
        self._failed: dict[int, OSError] = {}
        self._early: Future | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def wrote(self, fd: int, n: int) -> None:
        written = self._written.get(fd, 0) + n
        if written >= WRITEBACK_BYTES and (self._early is None or self._early.done()):
            self._early = self._pool.submit(self._sync_early, fd)
            written = 0
        self._written[fd] = written

    def _sync_early(self, fd: int) -> None:
        if fd not in self._failed:
            try:
                sync_data(fd)
            except OSError as exc:
                self._failed[fd] = exc

    def sync(self, fd: int) -> None:
        """Make ``fd``'s data durable (from a step, in the syncer's thread), raising a kept early failure."""
        failed = self._failed.pop(fd, None)
        if failed is not None:
            raise failed
        sync_data(fd)

    def forget(self, fd: int) -> None:
        """``fd`` gets no more writes (a step may close it and its number be reused)."""
        self._written.pop(fd, None)

    def then(self, step: Callable, *args) -> None:
        self._pool.submit(self._run, step, args)

    def _run(self, step: Callable, args: tuple) -> None:
        if self._error is None:
            try:
                step(*args)
            except BaseException as exc:
                self._error = exc

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        self._pool.submit(lambda: None).result()
        self.check()


def copy_range(src_fd: int, src_offset: int, length: int, dst_fd: int | None, dst_offset: int,
               digests: Sequence, *, src_path=None, advance: Callable[[int], None] | None = None,
               chunk: int | None = None, syncer: Syncer | None = None) -> None:
    """Copy ``length`` bytes from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset`` (no destination:
    only hash), updating every digest in ``digests`` with them in order.  ``advance(n)`` is called per chunk;
    ``syncer`` is told of every write (early writeback)."""
    if length <= 0:
        return
    size = os.fstat(src_fd).st_size
    if src_offset + length > size:
        raise TruncatedFileError(f"EOF reading bytes {src_offset}..{src_offset + length}: the file has {size}",
                                 path=src_path, offset=size)
    chunk = min(chunk or CHUNK_BYTES, length)
    os.posix_fadvise(src_fd, src_offset, length, os.POSIX_FADV_SEQUENTIAL)   # a larger readahead window, when cold
    ring = [memoryview(bytearray(chunk)) for _ in range(min(RING_DEPTH, -(-length // chunk)))]
    pending: list[list[Future]] = [[] for _ in ring]
    workers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-sha256") for _ in digests]
    try:
        done = 0
        for turn in range(-(-length // chunk)):
            slot = turn % len(ring)
            for future in pending[slot]:
                future.result()
            n = min(chunk, length - done)
            view = ring[slot][:n]
            got = os.preadv(src_fd, [view], src_offset + done)
            if got != n:
                raise TruncatedFileError(f"EOF reading bytes {src_offset + done}..{src_offset + done + n}: the file "
                                         f"shrank to {os.fstat(src_fd).st_size} while it was read", path=src_path,
                                         offset=src_offset + done + got)
            pending[slot] = [worker.submit(digest.update, view) for worker, digest in zip(workers, digests)]
            if dst_fd is not None:
                pwrite_all(dst_fd, view, dst_offset + done)
                if syncer is not None:
                    syncer.wrote(dst_fd, n)
            done += n
            if advance is not None:
                advance(n)
        for futures in pending:
            for future in futures:
                future.result()
    finally:
        for worker in workers:   # after an error: wait for the digests to let go of the buffers
            worker.shutdown(wait=True)


def progress_bar(total: int, enabled: bool, name: str):
    """A tqdm bar of bytes on stderr (``disable`` when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=not enabled,
                dynamic_ncols=True, smoothing=0.05)
