"""A tensor's pieces encoded on a GPU with the source reads overlapped (``convert --device cuda``).

The CPU path produces a piece at a time: read, widen to float32 on the host, encode.  On a GPU the encode is so
fast that the host work around it bounds the conversion, so here:

* a reader thread copies the stored bits of the next pieces (F32/F16/BF16 rows straight from the memory-mapped
  source, no widening) into pinned staging buffers, :data:`STAGING_BUFFERS` batches ahead of the encoder, each
  batch in slices by :data:`FILL_THREADS` threads (one thread copies a mapped file at ~5 GB/s on an H200 host,
  slower than the encoders take Q2_K/Q4_K/Q8_0; numpy's copy releases the GIL);
* the calling thread uploads a batch (consecutive pieces, at most :data:`BATCH_BYTES` of source and the
  encoder's pass size) on a copy stream while the previous batch encodes, widens it on the device (exact: F16
  and BF16 are subsets of float32), checks it is finite (one host sync per batch, which also finds the previous
  batch's bytes downloaded), encodes the batch in one pass (rows encode independently; pieces with importance
  each give their rows theirs: a row of importance per row) and queues the download of its bytes.

Pieces whose values need host work first (a transform, an FP8 source, importance computed from the values)
have no ``stored`` rows and go through :meth:`Piece.produce` as on the CPU path, in their place in the file order.
The bytes are those of :func:`quantkit.kernels.gpu_encode.encode` on each piece (same checks, same errors, the
rows numbered within the piece), so those of the CPU encoders.

Memory: host, :data:`STAGING_BUFFERS` pinned buffers of :data:`BATCH_BYTES`; device, one batch as stored, as
float32 and the encoder's scratch (bytes per weight in :mod:`quantkit.kernels.gpu_encode`).
"""
from __future__ import annotations

import contextlib
import queue
import threading
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


@dataclass
class _Upload:
    """A batch on its way to the device: its staging buffer (refilled once the copy is done) and its bytes."""

    batch: _Batch
    host: object
    bits: object
    ready: object = None


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
        self.free: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue()
        for buf in buffers:
            self.free.put(buf)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(items),), daemon=True,
                                        name="quantkit-gpu-reader")
        self._thread.start()

    def _run(self, items) -> None:
        try:
            for item in items:
                if isinstance(item, _Batch):
                    buf = self.free.get()
                    if self._stop.is_set():
                        return
                    _fill(buf.numpy(), item.spans)
                    item = (item, buf)
                self.ready.put(item)
                if self._stop.is_set():
                    return
            self.ready.put(self._END)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the encoding thread, in its place
            self.ready.put(exc)

    def get(self, block: bool = True):
        """The next item as the reader left it: a piece, a (batch, filled buffer) pair, an exception to raise in
        its place, :attr:`_END`; or None when ``block`` is False and it is not ready yet."""
        try:
            return self.ready.get(block)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._stop.set()
        self.free.put(None)            # wakes a reader waiting for a buffer
        self._thread.join()


def encode_stream(ctx, job, pieces, device: str, *, batch_bytes: int = BATCH_BYTES) -> Iterator[np.ndarray]:
    """``job``'s payload as ``uint8`` arrays in file order (their concatenation is the payload), encoded on
    ``device`` ("cuda", "cuda:N", or "cpu" with torch's CPU encoders, for tests)."""
    import torch

    from ..errors import EncodeError, QuantkitError
    from ..formats.api import _check_imatrix
    from ..formats.registry import get_format
    from ..kernels import gpu_encode
    from .tensors import _importance, _unit_name

    fmt = get_format(job.qtype)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    pieces = list(pieces)
    units = [(p, p.stored() if p.stored is not None else None) for p in pieces]
    units = [(p, s if s is None or s[1].shape[1] % fmt.block_size == 0 else None) for p, s in units]
    size = max([batch_bytes] + [s[1].itemsize * s[1].shape[1] for _, s in units if s is not None])   # >= a row
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(STAGING_BUFFERS)]
    reader = _Reader(_batches(units, gpu_encode.chunk_weights_for(fmt.qtype), size), buffers)
    importances: dict[int, object] = {}

    def importance(index: int):
        if index not in importances:
            piece = pieces[index]
            name = _unit_name(job, piece.matrix)
            im = _check_imatrix(_importance(ctx, job, piece.matrix, None), units[index][1][1].shape[1], fmt, name)
            importances[index] = None if im is None else torch.from_numpy(im).to(dev)
        return importances[index]

    compute = torch.cuda.current_stream(dev) if cuda else None
    copier = torch.cuda.Stream(dev) if cuda else None

    def upload(item) -> _Upload:
        """Start copying a filled batch to the device (on the copy stream, ``ready`` when done)."""
        batch, host = item
        if not cuda:
            return _Upload(batch, host, host[:batch.nbytes].clone())
        bits = torch.empty(batch.nbytes, dtype=torch.uint8, device=dev)   # memory of the compute stream...
        copier.wait_stream(compute)                                        # ...whose earlier users are done
        with torch.cuda.stream(copier):
            bits.copy_(host[:batch.nbytes], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copier)
        bits.record_stream(copier)
        return _Upload(batch, host, bits, ready)

    def take(item):
        """A reader item for the loop: a batch's upload started, an error raised in its place."""
        if isinstance(item, BaseException):
            raise item
        return upload(item) if isinstance(item, tuple) else item

    def encode(batch, x, bad):
        ims = None if bad is not None else [importance(span.index) for span in batch.spans]
        encoded = None
        if ims is not None and all(im is None for im in ims):   # rows encode alone: one pass for the batch
            encoded = [gpu_encode.encode_tensor(x, fmt.qtype, None, name=job.name)]
        elif ims is not None and all(im is not None for im in ims):   # a row of importance per row
            rows_im = ims[0] if len(ims) == 1 else torch.cat([im.expand(len(span.rows), -1)
                                                              for im, span in zip(ims, batch.spans)])
            with contextlib.suppress(QuantkitError):   # a row ggml aborts on: named below, piece by piece
                encoded = [gpu_encode.encode_tensor(x, fmt.qtype, rows_im, name=job.name)]
        if encoded is None:
            r0, encoded = 0, []
            for span in batch.spans:
                r1 = r0 + len(span.rows)
                name = _unit_name(job, pieces[span.index].matrix)
                if bad is not None and bad < r1:
                    raise EncodeError(f"non-finite weight (NaN or Inf) in row {span.first_row + bad - r0}",
                                      tensor=name)
                encoded.append(gpu_encode.encode_tensor(x[r0:r1], fmt.qtype, importance(span.index),
                                                        first_row=span.first_row, name=name))
                r0 = r1
        out = torch.cat(encoded)
        if cuda:   # downloaded behind the next batch's upload; the next host sync finds it done
            host_out = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
            host_out.copy_(out, non_blocking=True)
            out = host_out
        return out.numpy().reshape(-1)

    done = None        # the last batch's bytes (on CUDA: downloading until the next host sync)
    ahead = None       # the reader's next item, taken early so that its upload overlaps this batch's encode
    try:
        while True:
            raw = ahead if ahead is not None else reader.get()
            ahead = None
            if not isinstance(raw, (tuple, _Upload)) and done is not None:   # no next batch to sync behind
                if cuda:
                    compute.synchronize()
                yield done
                done = None
            item = take(raw)
            if item is _Reader._END:
                break
            if not isinstance(item, _Upload):            # a piece with host work first, in its place
                yield item.produce(None)[1].reshape(-1)
                continue
            if cuda:
                compute.wait_event(item.ready)
            x = item.bits.view(getattr(torch, _TORCH_DTYPES[item.batch.dtype])).to(torch.float32)
            x = x.reshape(-1, item.batch.n)
            finite = torch.isfinite(x).all(dim=1)
            bad = None if bool(finite.all()) else int((~finite).nonzero()[0, 0])   # a sync: uploaded, and the
            reader.free.put(item.host)                                               # last download is done
            if done is not None:
                yield done
                done = None
            nxt = reader.get(block=False)
            if nxt is not None:   # an error stays raw: raised when its turn comes
                ahead = nxt if isinstance(nxt, BaseException) else take(nxt)
            done = encode(item.batch, x, bad)
    finally:
        reader.close()
