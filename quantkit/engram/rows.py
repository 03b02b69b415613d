"""Engram rows as stored in GGUF: one row store per table, rows kept in their native encoding.

Layout (GGUF type I8, GGUF shape ``[head_dim + head_dim / 32, rows]``, numpy ``[rows, row_bytes]``): row ``r`` is
the table's ``head_dim`` FP8 E4M3 codes of row ``r`` followed by its ``head_dim / 32`` E8M0 scales (one per 32
codes, in order): 256 + 8 = 264 bytes for V4.1.  The bytes are the source's, never decoded or re-rounded.

A row is invalid when a code is an E4M3 NaN (``0x7F``/``0xFF``: E4M3fn has no infinities) or a scale is the
E8M0 NaN (``0xFF``).  Packing refuses such a source row; validation reports such an artifact row.

Packing reads the source in row chunks of at most :data:`CHUNK_BYTES` (``pread`` into one reused buffer per
tensor, no memory map), so its scratch is bounded whatever the table's size.
"""
from __future__ import annotations

import os

import numba
import numpy as np

from ..formats.minifloat import E4M3_VALUES, e8m0_decode
from ..errors import SourceError
from .spec import SCALE_BLOCK

#: Largest chunk of packed rows produced at once (output bytes; the source bytes read are the same amount).  The
#: scratch of a table is about twice this (read buffers and the chunk), whatever the table's size.
CHUNK_BYTES = 16 << 20
E4M3_NAN_MASK = 0x7F
E8M0_NAN = 0xFF


def row_bytes(head_dim: int) -> int:
    return head_dim + head_dim // SCALE_BLOCK


def invalid_rows(packed: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows with an E4M3 NaN code, rows with a 0xFF scale) of ``uint8[k, row_bytes]``, as row indices."""
    codes, scales = packed[:, :head_dim], packed[:, head_dim:]
    bad_code = ((codes & E4M3_NAN_MASK) == E4M3_NAN_MASK).any(axis=1)
    bad_scale = (scales == E8M0_NAN).any(axis=1)
    return np.flatnonzero(bad_code), np.flatnonzero(bad_scale)


@numba.njit(cache=True, nogil=True)
def _interleave_checked(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> int:
    """``out[r] = codes[r] ++ scales[r]`` for every row, in one pass that also finds the first row holding an E4M3
    NaN code or a 0xFF scale (its index; -1: none)."""
    k = codes.shape[1]
    first = -1
    for r in range(out.shape[0]):
        bad = False
        for c in range(k):
            b = codes[r, c]
            out[r, c] = b
            if (b & 0x7F) == 0x7F:
                bad = True
        for c in range(scales.shape[1]):
            b = scales[r, c]
            out[r, k + c] = b
            if b == 0xFF:
                bad = True
        if bad and first < 0:
            first = r
    return first


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)


@numba.njit(cache=True, nogil=True)
def _interleave_checked_words(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> int:
    """:func:`_interleave_checked` on 8-byte words (rows whose code and scale bytes are multiples of 8): a byte
    ``b`` has ``b & 0x7F == 0x7F`` iff ``(b & 0x7F) + 1`` sets bit 7 (no carry leaves the byte); a scale byte is
    0xFF iff its complement is a zero byte (``(y - 0x01..) & ~y & 0x80..``)."""
    k, m = codes.shape[1], scales.shape[1]
    first = -1
    for r in range(out.shape[0]):
        nan_codes = np.uint64(0)
        for c in range(k):
            w = codes[r, c]
            out[r, c] = w
            nan_codes |= ((w & _LOW7) + _ONES) & _HIGH
        nan_scales = np.uint64(0)
        for c in range(m):
            w = scales[r, c]
            out[r, k + c] = w
            y = ~w
            nan_scales |= (y - _ONES) & ~y & _HIGH
        if (nan_codes | nan_scales) != 0 and first < 0:
            first = r
    return first


def describe_invalid(packed: np.ndarray, head_dim: int, row_ids: np.ndarray) -> str | None:
    """One line naming the first invalid row of ``packed`` (whose rows are table rows ``row_ids``), or None."""
    nan_codes, nan_scales = invalid_rows(packed, head_dim)
    found = []
    if nan_codes.size:
        r = int(nan_codes[0])
        col = int(np.flatnonzero((packed[r, :head_dim] & E4M3_NAN_MASK) == E4M3_NAN_MASK)[0])
        found.append((r, f"row {int(row_ids[r])}: E4M3 NaN code 0x{int(packed[r, col]):02X} at value {col}"))
    if nan_scales.size:
        r = int(nan_scales[0])
        col = int(np.flatnonzero(packed[r, head_dim:] == E8M0_NAN)[0])
        found.append((r, f"row {int(row_ids[r])}: E8M0 NaN scale 0xFF at scale {col}"))
    if not found:
        return None
    count = np.union1d(nan_codes, nan_scales).size
    return min(found)[1] + (f" ({count} invalid rows among the {len(packed)} read)" if count > 1 else "")


def decode_rows(packed: np.ndarray, head_dim: int) -> np.ndarray:
    """``float32[k, head_dim]`` values of packed rows (codes times their block's power-of-two scale)."""
    codes = E4M3_VALUES[packed[:, :head_dim]].reshape(len(packed), -1, SCALE_BLOCK)
    scales = e8m0_decode(packed[:, head_dim:])
    return (codes * scales[..., None]).reshape(len(packed), head_dim).astype(np.float32)


class RowSource:
    """The weight and scale tensors of one Engram table in a safetensors checkpoint, read by row ranges with
    ``pread`` (offsets from the parsed headers; the files' sizes were checked against the headers on open)."""

    def __init__(self, checkpoint, weight: str, scale: str):
        self.weight, self.scale = checkpoint.tensor_info(weight), checkpoint.tensor_info(scale)
        self.name = weight
        if self.weight.dtype != "F8_E4M3" or self.scale.dtype not in ("F8_E8M0", "U8"):
            raise SourceError(f"an Engram table is F8_E4M3 with F8_E8M0 scales, found {self.weight.dtype} with "
                              f"{self.scale.dtype}", tensor=weight)
        if len(self.weight.shape) != 2 or tuple(self.scale.shape) != (self.weight.shape[0],
                                                                      self.weight.shape[1] // SCALE_BLOCK) \
                or self.weight.shape[1] % SCALE_BLOCK:
            raise SourceError(f"an Engram table [rows, dim] has scales [rows, dim/{SCALE_BLOCK}]; found "
                              f"{list(self.weight.shape)} and {list(self.scale.shape)}", tensor=weight)
        self.rows, self.head_dim = (int(d) for d in self.weight.shape)
        self.scales_per_row = self.head_dim // SCALE_BLOCK
        self._begins = (checkpoint.data_offset(weight), checkpoint.data_offset(scale))
        self._paths = (self.weight.file, self.scale.file)
        self._fds: list[int] = []
        self._buffers: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def row_bytes(self) -> int:
        return self.head_dim + self.scales_per_row

    def __enter__(self) -> "RowSource":
        self._fds = [os.open(p, os.O_RDONLY) for p in self._paths]
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _pread(self, which: int, width: int, r0: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        offset = self._begins[which] + r0 * width
        done = 0
        while done < len(view):
            n = os.preadv(self._fds[which], [view[done:]], offset + done)
            if n <= 0:
                raise SourceError(f"EOF reading rows from offset {offset + done}", path=self._paths[which],
                                  tensor=self.name)
            done += n

    def read(self, r0: int, count: int, codes: np.ndarray, scales: np.ndarray) -> None:
        """Rows ``r0 .. r0+count`` into ``codes[:count]`` and ``scales[:count]`` (contiguous buffers)."""
        self._pread(0, self.head_dim, r0, codes[:count])
        self._pread(1, self.scales_per_row, r0, scales[:count])

    def packed(self, r0: int, count: int) -> tuple[np.ndarray, int]:
        """(``uint8[count, row_bytes]`` rows ``r0 .. r0+count``, index of the first invalid one or -1); the read
        buffers are kept between calls (no page faults on fresh memory per chunk), the result is new."""
        if self._buffers is None or self._buffers[0].shape[0] < count:
            self._buffers = (np.empty((count, self.head_dim), np.uint8),
                             np.empty((count, self.scales_per_row), np.uint8))
        codes, scales = (b[:count] for b in self._buffers)
        self.read(r0, count, codes, scales)
        out = np.empty((count, self.row_bytes), np.uint8)
        if self.head_dim % 8 == 0 and self.scales_per_row % 8 == 0:
            return out, int(_interleave_checked_words(codes.view(np.uint64), scales.view(np.uint64),
                                                      out.view(np.uint64)))
        return out, int(_interleave_checked(codes, scales, out))

    def rows_at(self, rows: np.ndarray) -> np.ndarray:
        """``uint8[len(rows), row_bytes]``: the given rows only (runs of consecutive rows read together)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((rows.size, self.row_bytes), np.uint8)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise SourceError(f"row {int(rows.max())} outside the table's {self.rows} rows", tensor=self.name)
        starts = np.flatnonzero(np.diff(rows, prepend=-2) != 1)
        ends = np.append(starts[1:], rows.size)
        for s, e in zip(starts, ends):
            codes = np.empty((e - s, self.head_dim), np.uint8)
            scales = np.empty((e - s, self.scales_per_row), np.uint8)
            self.read(int(rows[s]), int(e - s), codes, scales)
            out[s:e, :self.head_dim], out[s:e, self.head_dim:] = codes, scales
        return out
