"""A tensor's pieces encoded on a GPU with the source reads overlapped (``convert --device cuda``).

The CPU path produces a piece at a time: read, widen to float32 on the host, encode.  On a GPU the encode is so
fast that the host work around it bounds the conversion, so here:

* a reader thread copies the stored bits of the next pieces (F32/F16/BF16 rows straight from the memory-mapped
  source, no widening) into pinned staging buffers, :data:`STAGING_BUFFERS` batches ahead of the encoder (numpy's
  copy releases the GIL);
* the calling thread uploads a batch (consecutive pieces, at most :data:`BATCH_BYTES` of source and the
  encoder's pass size), widens it on the device (exact: F16 and BF16 are subsets of float32), checks it is finite
  (one host sync per batch), encodes the batch in one pass (rows encode independently; pieces with importance
  each give their rows theirs: a row of importance per row) and downloads the bytes.

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
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

#: Source bytes uploaded at once (one staging buffer).
BATCH_BYTES = 64 << 20
#: Batches read ahead of the encoder (pinned host buffers of BATCH_BYTES each).
STAGING_BUFFERS = 3
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


def _fill(dst: np.ndarray, spans: list[_Span]) -> None:
    """Copy the spans' stored bytes one after the other into ``dst`` (the page faults of the mapped source and the
    copy both happen here, without the GIL)."""
    at = 0
    for span in spans:
        flat = span.rows.reshape(-1).view(np.uint8)
        np.copyto(dst[at:at + flat.size], flat)
        at += flat.size


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

    def __iter__(self):
        while (item := self.ready.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item

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

    try:
        for item in reader:
            if not isinstance(item, tuple):
                yield item.produce(None)[1].reshape(-1)
                continue
            batch, host = item
            bits = host[:batch.nbytes].to(dev, non_blocking=True, copy=True)   # the buffer is refilled below
            x = bits.view(getattr(torch, _TORCH_DTYPES[batch.dtype])).to(torch.float32).reshape(-1, batch.n)
            finite = torch.isfinite(x).all(dim=1)
            bad = None if bool(finite.all()) else int((~finite).nonzero()[0, 0])   # a sync: the upload is done
            reader.free.put(host)
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
            if cuda:
                host_out = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
                host_out.copy_(out, non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()
                out = host_out
            yield out.numpy().reshape(-1)
    finally:
        reader.close()
