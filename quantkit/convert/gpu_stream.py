"""A tensor's pieces encoded on a GPU with the source reads overlapped (``convert --device cuda``).

The CPU path produces a piece at a time: read, widen to float32 on the host, encode.  On a GPU the encode is so
fast that the host work around it bounds the conversion, so here the host never waits for the GPU:

* a reader thread copies the stored bits of the next pieces (F32/F16/BF16 rows straight from the memory-mapped
  source, no widening) into pinned staging buffers, :data:`STAGING_BUFFERS` batches ahead of the encoder, each
  batch in slices by :data:`FILL_THREADS` threads (one thread copies a mapped file at ~5 GB/s on an H200 host,
  slower than the encoders take Q2_K/Q4_K/Q8_0; numpy's copy releases the GIL);
* the calling thread queues, per batch (consecutive pieces, at most :data:`BATCH_BYTES` of source and the
  encoder's pass size): its upload on a copy stream, then on the compute stream its widening (exact: F16 and BF16
  are subsets of float32), a finiteness flag per row (non-finite rows are zeroed, their bytes never used), one
  encode pass (rows encode independently; pieces with importance each give their rows theirs: a row of
  importance per row, the tensor's importance uploaded once) and the download of its bytes and flags;
* it yields a :class:`PendingBytes` per batch at once: the thread that writes the bytes waits for them and
  raises the error of a non-finite or aborting row there, in its place.  So the next batch, and the next
  tensor, are read and queued while the GPU still encodes this one (pool.IN_FLIGHT_BYTES bounds how far
  ahead).

Pieces whose values need host work first (a transform, an FP8 source, importance computed from the values)
have no ``stored`` rows and go through :meth:`Piece.produce` as on the CPU path, in their place in the file order.
The bytes and errors are those of :func:`quantkit.kernels.gpu_encode.encode` on each piece (the rows numbered
within the piece), so those of the CPU encoders.

Memory: host, :data:`STAGING_BUFFERS` pinned buffers of :data:`BATCH_BYTES` (kept for the next tensor) and the
pinned downloads not yet written; device, the bits as stored of the batches queued (these and the downloads: at most
``pool.IN_FLIGHT_BYTES``) and, reused batch after batch in the compute stream's order, one batch as float32 and
the encoder's scratch (bytes per weight in :mod:`quantkit.kernels.gpu_encode`).
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

#: Source bytes uploaded at once (one staging buffer).
BATCH_BYTES = 64 << 20
#: Batches read ahead of the encoder (pinned host buffers of BATCH_BYTES each).
STAGING_BUFFERS = 4
#: Threads copying one batch into its staging buffer (measured on the H200 host: 5.4 GB/s with one, 19.8 with 4).
FILL_THREADS = 4
#: Bytes one fill thread copies at a time.
FILL_SLICE_BYTES = 8 << 20
_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

#: Seconds this process's streams spent per step, summed over threads (``convert --report``'s ``stream_seconds``
#: at ``-j 1``): where the converting thread works ("setup" a tensor, "queue" a batch) or waits ("wait_reader";
#: "wait_write_queue": the pieces not yet written hold ``pool.IN_FLIGHT_BYTES``), the reader fills ("fill"), the
#: write threads wait for the GPU ("wait_gpu"), write and hash.  The converting thread's work ("setup" + "queue")
#: near the tensors phase means the host is the bound.
#: Parts of "setup" (counted in it too): "setup_pieces" (the pieces and their stored views), "setup_imatrix"
#: (their importance, checked, and its upload), "setup_reader" (staging buffers, the reader's start, the copy
#: stream).  After a tensor (quantkit.convert.pool): "release" (its source maps) and "wait_tensor_writes" (the
#: converting thread waiting for an earlier tensor's last writes).
STEP_SECONDS: collections.Counter = collections.Counter()
#: Wall-clock seconds during which at least one thread was in each :func:`timed` step (``stream_wall_seconds``):
#: writes from several threads into one file take turns on its inode lock, so their summed seconds count
#: waiting; the wall time is what the step costs the run.
STEP_WALL_SECONDS: collections.Counter = collections.Counter()
_steps_lock = threading.Lock()
_inside: collections.Counter = collections.Counter()     # threads in each step now
_since: dict[str, float] = {}                            # when the first of them entered


def add_step(step: str, seconds: float) -> None:
    with _steps_lock:
        STEP_SECONDS[step] += seconds


def _lap(step: str, since: float) -> float:
    """Add the seconds since ``since`` to ``step``; now."""
    now = time.perf_counter()
    add_step(step, now - since)
    return now


@contextlib.contextmanager
def timed(step: str):
    start = time.perf_counter()
    with _steps_lock:
        if not _inside[step]:
            _since[step] = start
        _inside[step] += 1
    try:
        yield
    finally:
        end = time.perf_counter()
        with _steps_lock:
            STEP_SECONDS[step] += end - start
            _inside[step] -= 1
            if not _inside[step]:
                STEP_WALL_SECONDS[step] += end - _since.pop(step)


@dataclass(frozen=True)
class _Span:
    """Rows ``first_row ..`` of one piece, as stored (a memory-mapped view, read by the reader thread)."""

    index: int
    """The piece's position in the tensor."""
    rows: np.ndarray
    first_row: int


@dataclass
class _Batch:
    """Consecutive spans of the same stored dtype and row length, uploaded at once."""

    spans: list[_Span]
    dtype: str
    n: int

    @property
    def rows(self) -> int:
        return sum(len(s.rows) for s in self.spans)

    @property
    def nbytes(self) -> int:
        return sum(s.rows.nbytes for s in self.spans)


def _batches(units, weights_per_batch: int, batch_bytes: int) -> Iterator[object]:
    """``units`` (piece, (dtype, stored rows) or None) in order as batches of at most ``weights_per_batch``
    weights and ``batch_bytes`` bytes (a larger piece split by rows), and each piece without stored rows alone."""
    batch = None
    for index, (piece, stored) in enumerate(units):
        if stored is None:
            if batch is not None:
                yield batch
                batch = None
            yield piece
            continue
        dtype, rows = stored
        n = rows.shape[1]
        limit = max(1, min(weights_per_batch // n, batch_bytes // (rows.itemsize * n)))
        for r0 in range(0, rows.shape[0], limit):
            span = _Span(index, rows[r0:r0 + limit], r0)
            if batch is not None and (batch.dtype != dtype or batch.n != n or batch.rows + len(span.rows) > limit):
                yield batch
                batch = None
            if batch is None:
                batch = _Batch([], dtype, n)
            batch.spans.append(span)
    if batch is not None:
        yield batch


_fill_pool: ThreadPoolExecutor | None = None
_fill_pool_lock = threading.Lock()


class _DeviceStaging:
    """A device's copy stream and sets of :data:`STAGING_BUFFERS` pinned buffers, kept for the process's life and
    lent to one tensor's stream at a time.  Made per tensor they cost the converting thread ~1 ms a tensor, 0.5 s
    of a 26.9 GB conversion (pinned blocks that the caching allocator cannot reuse while the GPU lags behind the
    host; bench/results/convert-gpu-2026-12-05.md)."""

    _lock = threading.Lock()
    _copy_streams: dict = {}
    _idle: dict = {}        # (device, buffer size) -> sets of (buffer, event of its last upload or None)

    @classmethod
    def copy_stream(cls, torch, dev):
        with cls._lock:
            if dev not in cls._copy_streams:
                cls._copy_streams[dev] = torch.cuda.Stream(dev)
            return cls._copy_streams[dev]

    @classmethod
    def lend(cls, torch, dev, size: int) -> list:
        with cls._lock:
            sets = cls._idle.get((dev, size))
            if sets:
                return sets.pop()
        return [(torch.empty(size, dtype=torch.uint8, pin_memory=True), None) for _ in range(STAGING_BUFFERS)]

    @classmethod
    def give_back(cls, dev, size: int, buffers: list) -> None:
        if len(buffers) == STAGING_BUFFERS:    # else the stream failed holding one: let them all go
            with cls._lock:
                cls._idle.setdefault((dev, size), []).append(buffers)


def _fill(dst: np.ndarray, spans: list[_Span]) -> None:
    """Copy the spans' stored bytes one after the other into ``dst``, in slices over :data:`FILL_THREADS` threads
    (the page faults of the mapped source and the copy both happen there, without the GIL)."""
    global _fill_pool
    slices, at = [], 0
    for span in spans:
        flat = span.rows.reshape(-1).view(np.uint8)
        for s0 in range(0, flat.size, FILL_SLICE_BYTES):
            part = flat[s0:s0 + FILL_SLICE_BYTES]
            slices.append((dst[at + s0:at + s0 + part.size], part))
        at += flat.size
    if len(slices) <= 1:
        for to, part in slices:
            np.copyto(to, part)
        return
    with _fill_pool_lock:
        if _fill_pool is None:
            _fill_pool = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="quantkit-gpu-fill")
    for done in [_fill_pool.submit(np.copyto, to, part) for to, part in slices]:
        done.result()


class _Reader:
    """The reader thread: fills free staging buffers with the next batches' stored bytes, in order."""

    _END = object()

    def __init__(self, items: Iterable[object], buffers: list):
        """``buffers``: (pinned buffer, the event of its last upload or None) pairs."""
        self.free: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue()
        for pair in buffers:
            self.free.put(pair)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(items),), daemon=True,
                                        name="quantkit-gpu-reader")
        self._thread.start()

    def _run(self, items) -> None:
        try:
            for item in items:
                if isinstance(item, _Batch):
                    buf, uploaded = self.free.get()
                    if self._stop.is_set():
                        return
                    if uploaded is not None:   # the buffer's last upload must be done before it is refilled
                        uploaded.synchronize()
                    with timed("fill"):
                        _fill(buf.numpy(), item.spans)
                    item = (item, buf)
                self.ready.put(item)
                if self._stop.is_set():
                    return
            self.ready.put(self._END)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the encoding thread, in its place
            self.ready.put(exc)

    def get(self):
        """The next item as the reader left it: a piece, a (batch, filled buffer) pair, an exception to raise in
        its place, or :attr:`_END`."""
        return self.ready.get()

    def close(self) -> list:
        """Stop the thread; the buffers it holds no more, as (buffer, event of its last upload or None) pairs."""
        self._stop.set()
        self.free.put((None, None))    # wakes a reader waiting for a buffer
        self._thread.join()
        idle = []
        while not self.free.empty():
            buf, uploaded = self.free.get_nowait()
            if buf is not None:
                idle.append((buf, uploaded))
        while not self.ready.empty():   # filled, never uploaded (the stream ended early)
            item = self.ready.get_nowait()
            if isinstance(item, tuple):
                idle.append((item[1], None))
        return idle


class PendingBytes:
    """A batch's encoded bytes on their way to the host.  :meth:`result` waits for them and raises the error of
    the batch's first failing row in its place: a non-finite weight, or a row ggml aborts on."""

    def __init__(self, out, flags, done, spans: list[tuple[str, int, int]], qtype, source_nbytes: int):
        self.nbytes = out.numel()
        self.held_bytes = source_nbytes + self.nbytes   # its stored bits on the device, its pinned download
        self._out, self._flags, self._done, self._spans, self._qtype = out, flags, done, spans, qtype

    def result(self) -> np.ndarray:
        if self._done is not None:
            with timed("wait_gpu"):
                self._done.synchronize()
        flags = self._flags.numpy()
        if flags.any():
            raise self._error(flags)
        return self._out.numpy().reshape(-1)

    def _error(self, flags: np.ndarray) -> Exception:
        """The error the CPU path raises first: that of the first piece with a failing row (flags: -1 non-finite,
        > 0 ggml's abort reason), its non-finite rows before its aborting ones."""
        from ..errors import EncodeError
        from ..kernels.gpu_encode import abort_error

        r0 = 0
        for name, first_row, count in self._spans:
            mine = flags[r0:r0 + count]
            r0 += count
            if not mine.any():
                continue
            bad = np.flatnonzero(mine < 0)
            if bad.size:
                return EncodeError(f"non-finite weight (NaN or Inf) in row {first_row + int(bad[0])}", tensor=name)
            row = int(np.flatnonzero(mine)[0])
            return abort_error(self._qtype, first_row + row, int(mine[row]), name)
        raise AssertionError("flags set outside the batch's spans")


def _rows_importance(torch, im_table, table_rows: list[int], spans: list[_Span]):
    """The importance of each row of a batch (``table_rows``: each span's row of ``im_table``): one row for every
    row where the batch has one span; where its spans are consecutive rows of the table of one length each (whole
    experts, the usual batch), one copy of those rows, each repeated; else a row per span, joined."""
    if len(spans) == 1:
        return im_table[table_rows[0]]
    first, count, length = table_rows[0], len(spans), len(spans[0].rows)
    if table_rows == list(range(first, first + count)) and all(len(s.rows) == length for s in spans):
        n = im_table.shape[1]
        return im_table[first:first + count, None, :].expand(count, length, n).reshape(count * length, n)
    return torch.cat([im_table[k].expand(len(s.rows), -1) for k, s in zip(table_rows, spans)])


def held_bytes(piece) -> int:
    """The memory a piece of :func:`encode_stream` holds until it is written."""
    return piece.held_bytes if isinstance(piece, PendingBytes) else piece.nbytes


def payload(piece) -> np.ndarray:
    """A piece of :func:`encode_stream` as bytes (waiting for a batch still on the GPU)."""
    return piece.result() if isinstance(piece, PendingBytes) else piece


def encode_stream(ctx, job, pieces, device: str, *, batch_bytes: int = BATCH_BYTES) -> Iterator[object]:
    """``job``'s payload in file order: ``uint8`` arrays and :class:`PendingBytes` (:func:`payload` gives their
    bytes; their concatenation is the payload), encoded on ``device`` ("cuda", "cuda:N", or "cpu" with torch's
    CPU encoders, for tests).  Errors of the source, the imatrix or the encoders come in their place."""
    setup_start = time.perf_counter()
    import torch

    from ..formats.api import _check_imatrix
    from ..formats.registry import get_format
    from ..kernels import gpu_encode
    from .tensors import _importance, _unit_name

    fmt = get_format(job.qtype)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    lap = time.perf_counter()
    pieces = list(pieces)
    units = [(p, p.stored() if p.stored is not None else None) for p in pieces]
    units = [(p, s if s is None or s[1].shape[1] % fmt.block_size == 0 else None) for p, s in units]
    streamed = [i for i, (_, s) in enumerate(units) if s is not None]
    lap = _lap("setup_pieces", lap)
    # Every streamed piece has importance or none has (a piece whose importance comes from its values has no
    # stored rows): one upload for the tensor, a row per piece.
    ims = [_check_imatrix(_importance(ctx, job, pieces[i].matrix, None), units[i][1][1].shape[1], fmt,
                          _unit_name(job, pieces[i].matrix)) for i in streamed]
    im_row = {i: k for k, i in enumerate(streamed)}
    compute = torch.cuda.current_stream(dev) if cuda else None
    copier = _DeviceStaging.copy_stream(torch, dev) if cuda else None
    im_table = None
    if streamed and ims[0] is not None:
        im_table = torch.from_numpy(np.stack(ims))
        if cuda:   # pinned and on the compute stream, behind the encodes, this took ~1 s of a 26.9 GB conversion;
            # from pageable memory on the copy stream, which is not behind, a small copy returns at once
            with torch.cuda.stream(copier):
                im_table = im_table.to(dev, non_blocking=True)
                im_uploaded = torch.cuda.Event()
                im_uploaded.record(copier)
            compute.wait_event(im_uploaded)
            im_table.record_stream(compute)
    lap = _lap("setup_imatrix", lap)
    size = max([batch_bytes] + [s[1].itemsize * s[1].shape[1] for _, s in units if s is not None])   # >= a row
    buffers = (_DeviceStaging.lend(torch, dev, size) if cuda else
               [(torch.empty(size, dtype=torch.uint8), None) for _ in range(STAGING_BUFFERS)])
    reader = _Reader(_batches(units, gpu_encode.chunk_weights_for(fmt.qtype), size), buffers)
    _lap("setup_reader", lap)

    def upload(batch: _Batch, host):
        """The batch's stored bits on the device, copied on the copy stream (the compute stream waits for it)."""
        if not cuda:
            bits = host[:batch.nbytes].clone()
            reader.free.put((host, None))
            return bits
        with torch.cuda.stream(copier):   # memory of the copy stream's pool, used by the compute stream after
            bits = torch.empty(batch.nbytes, dtype=torch.uint8, device=dev)
            bits.copy_(host[:batch.nbytes], non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(copier)
        reader.free.put((host, uploaded))
        compute.wait_event(uploaded)
        bits.record_stream(compute)
        return bits

    def encode(batch: _Batch, bits) -> PendingBytes:
        """Queue the batch's widening, checks, encode and download; nothing here waits for the device."""
        x = bits.view(getattr(torch, _TORCH_DTYPES[batch.dtype])).to(torch.float32).reshape(-1, batch.n)
        finite = torch.isfinite(x).all(dim=1)
        x.masked_fill_(~finite[:, None], 0.0)      # a non-finite row fails the piece; zeroed, it cannot upset the rest
        rows_im = None if im_table is None else _rows_importance(torch, im_table, [im_row[s.index] for s in
                                                                                    batch.spans], batch.spans)
        out, reasons = gpu_encode.encode_rows(x, fmt.qtype, rows_im)
        flags = -(~finite).to(torch.int32)
        if reasons is not None:
            flags = torch.where(finite, reasons, flags)
        spans = [(_unit_name(job, pieces[s.index].matrix), s.first_row, len(s.rows)) for s in batch.spans]
        if not cuda:
            return PendingBytes(out, flags, None, spans, fmt.qtype, batch.nbytes)
        host_out = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
        host_flags = torch.empty(flags.shape, dtype=torch.int32, pin_memory=True)
        host_out.copy_(out, non_blocking=True)
        host_flags.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record(compute)
        return PendingBytes(host_out, host_flags, done, spans, fmt.qtype, batch.nbytes)

    add_step("setup", time.perf_counter() - setup_start)
    try:
        while True:
            with timed("wait_reader"):
                item = reader.get()
            if item is _Reader._END:
                break
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                batch, host = item
                with timed("queue"):
                    pending = encode(batch, upload(batch, host))
                yield pending
            else:                                   # a piece with host work first, in its place
                yield item.produce(None)[1].reshape(-1)
    finally:
        idle = reader.close()
        if cuda:
            _DeviceStaging.give_back(dev, size, idle)
