"""A planned tensor as *pieces* that can be produced one at a time, so an audit can re-encode only some experts or
rows and still get exactly the bytes ``convert`` wrote.

:func:`quantkit.convert.tensors.tensor_bytes` yields a tensor's payload unit by unit but says neither which rows
each unit covers nor the source values it encoded; the audit needs both (to read the matching artifact bytes, to
skip units it does not sample, and to measure the dequantized error).  :func:`pieces` splits a job the same way,
from the same parts of :mod:`quantkit.convert.tensors` (source access, transforms, importance, the repack and
encode functions), and a test proves that the concatenation of every piece equals ``tensor_bytes`` for every
tensor of every tiny architecture.  (The natural home of this function is ``tensors.py`` itself, with
``tensor_bytes`` as the concatenation of all pieces.)

A piece covers ``rows`` consecutive rows of the tensor's ``[rows, n]`` view (every leading axis flattened; an
expert of a 3-D ``[E, R, n]`` tensor is rows ``e*R .. e*R+R``) and is produced by ``produce(rows)``: ``rows`` None
for every row, or sorted indices relative to the piece's first row.  It returns the source values that were encoded
(float32 ``[k, n]``; None for integer tables and lossless repacks) and the encoded bytes ``uint8[k, row_bytes]``.
Nothing is read from the source until ``produce`` is called.

Producing a subset of rows reads only those rows where the source allows it (a plain 2-D F32/F16/BF16 source
without transform, imatrix or no importance); otherwise the whole piece is loaded and the rows selected after
importance is computed from all of it (bootstrap importance is a sum over every row), so the bytes are the same.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..arch import transforms
from ..convert import tensors as convert_tensors
from ..convert.repack import mxfp4_from_fp4_e8m0, nvfp4_from_modelopt_layout
from ..convert.tensors import SourceContext, TensorJob, tensor_bytes
from ..errors import SourceError, UnsupportedError
from ..formats.api import encode
from ..formats.registry import GGMLType

Produce = Callable[[np.ndarray | None], tuple[np.ndarray | None, np.ndarray]]


@dataclass(frozen=True)
class Piece:
    matrix: int | None
    """The expert (matrix of a 3-D tensor) this piece belongs to; None for 2-D and 1-D tensors."""
    row: int | None
    """First row in the tensor's ``[rows, n]`` view; None when only known after loading (a transformed shard)."""
    rows: int | None
    produce: Produce


def tensor_rows(shape: tuple[int, ...]) -> int:
    """Rows of the ``[rows, n]`` view of a tensor of numpy ``shape``."""
    return math.prod(shape[:-1])


def pieces(ctx: SourceContext, job: TensorJob) -> list[Piece]:
    """The job's pieces in file order (see the module docstring)."""
    if job.kind in ("encode", "copy"):
        return list(_encode_pieces(ctx, job))
    if job.kind in ("mxfp4-repack", "nvfp4-repack"):
        return list(_repack_pieces(ctx, job))
    # nvfp4-scale: one value per expert, read from the stored global scales; tiny, produced whole
    rows = tensor_rows(job.output.shape)

    def produce(selected: np.ndarray | None) -> tuple[None, np.ndarray]:
        data = np.concatenate(list(tensor_bytes(ctx, job))).reshape(rows, -1)
        return None, data if selected is None else data[selected]
    return [Piece(None, 0, rows, produce)]


def _bootstrap(job: TensorJob, matrix: int | None) -> bool:
    """Whether a unit's importance is computed from its own values (so it needs all of them)."""
    return job.importance == "bootstrap" or matrix in job.bootstrap or None in job.bootstrap


def _encoder(ctx: SourceContext, job: TensorJob, matrix: int | None, load: Callable[[], np.ndarray],
             load_rows: Callable[[np.ndarray], np.ndarray] | None = None) -> Produce:
    integer = job.output.dtype == "int32"

    def produce(selected: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
        direct = selected is not None and load_rows is not None and not _bootstrap(job, matrix)
        x = convert_tensors._rows(load_rows(selected) if direct else load())
        if integer:
            data = np.ascontiguousarray(x, dtype="<i4")
            data = data if selected is None or direct else data[selected]
            return None, data.view(np.uint8)
        importance = convert_tensors._importance(ctx, job, matrix, x)
        if selected is not None and not direct:
            x = x[selected]
        name = convert_tensors._unit_name(job, matrix)
        return x, encode(x, job.qtype, importance, name=name)
    return produce


def _encode_pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """Mirrors ``tensors._units`` + ``tensors._encoded``: the same units, split by matrix and row range."""
    out, hp = job.output, ctx.amap.hp
    if (out.dtype == "int32") != (job.qtype == GGMLType.I32):
        raise UnsupportedError(f"an {out.dtype} tensor cannot be written as {job.qtype.name}", tensor=job.name)
    per_matrix = tensor_rows(out.shape[1:]) if len(out.shape) == 3 else None

    def source(m) -> np.ndarray:
        return transforms.apply(m.transform, ctx.array(m.hf_name), hp)

    def expert_slice(m, e: int) -> np.ndarray:
        return transforms.apply(m.transform, ctx.checkpoint.tensor_f32(m.hf_name, expert=e)[None], hp)[0]

    def chunk(name: str, r0: int, count: int) -> np.ndarray:
        return np.asarray(ctx.checkpoint.raw(name)[r0:r0 + count], dtype=np.float32)

    def chunk_rows(name: str, r0: int, selected: np.ndarray) -> np.ndarray:
        return np.asarray(ctx.checkpoint.raw(name)[r0 + selected], dtype=np.float32)

    def whole() -> Iterator[Piece]:
        load = functools.lru_cache(maxsize=1)(lambda: ctx.amap.assemble(out, ctx.array))   # shared by matrices
        if len(out.shape) == 3:
            for e in range(out.shape[0]):
                yield Piece(e, e * per_matrix, per_matrix, _encoder(ctx, job, e, lambda e=e: load()[e]))
        else:
            yield Piece(None, 0, tensor_rows(out.shape), _encoder(ctx, job, None, load))

    if out.assembly == "stack_experts":
        for e, m in enumerate(out.sources):
            yield Piece(e, e * per_matrix, per_matrix, _encoder(ctx, job, e, functools.partial(source, m)))
        return
    if convert_tensors._expert_slices(out):
        for e in range(out.shape[0]):
            load = functools.partial(expert_slice, out.sources[0], e)
            yield Piece(e, e * per_matrix, per_matrix, _encoder(ctx, job, e, load))
        return
    if len(out.sources) == 1 and (job.importance == "bootstrap" or None in job.bootstrap):
        yield from whole()
        return
    row = 0
    for m in out.sources:   # one source, or one per shard (concatenated along rows)
        info = ctx.checkpoint.tensor_info(m.hf_name)
        if m.transform or info.dtype not in convert_tensors._PLAIN_DTYPES or len(info.shape) != 2 \
                or len(out.shape) != 2:
            if len(out.sources) == 1:
                yield from whole()
                return
            rows = None if m.transform else int(info.shape[0])
            yield Piece(None, row, rows, _encoder(ctx, job, None, functools.partial(source, m)))
            row = None if rows is None or row is None else row + rows
            continue
        rows, n = (int(d) for d in info.shape)
        step = max(1, convert_tensors.ROW_CHUNK_BYTES // max(1, 4 * n))
        for r0 in range(0, rows, step):
            count = min(step, rows - r0)
            yield Piece(None, None if row is None else row + r0, count,
                        _encoder(ctx, job, None, functools.partial(chunk, m.hf_name, r0, count),
                                 functools.partial(chunk_rows, m.hf_name, r0)))
        row = None if row is None else row + rows


def _repack_pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """Mirrors ``tensors._repacked``: one piece per stored source (expert)."""
    out = job.output
    per_matrix = tensor_rows(out.shape[1:]) if len(out.shape) == 3 else tensor_rows(out.shape)
    for expert, hf_name, index in convert_tensors._stored_sources(job):
        def produce(selected: np.ndarray | None, expert=expert, hf_name=hf_name, index=index
                    ) -> tuple[None, np.ndarray]:
            info = ctx.checkpoint.tensor_info(hf_name)
            if info.dtype not in convert_tensors._PACKED_FP4_DTYPES:
                raise SourceError(f"{job.kind} needs packed FP4 weights, {hf_name!r} is {info.dtype}",
                                  tensor=job.name)
            packed = convert_tensors._slice(ctx.checkpoint.raw(hf_name), index)
            unit = convert_tensors._unit_name(job, expert)
            if job.kind == "mxfp4-repack":
                _, scale = convert_tensors._companion(ctx, job, hf_name, ("scale", "scale_inv"))
                data = mxfp4_from_fp4_e8m0(packed, convert_tensors._slice(ctx.checkpoint.raw(scale), index),
                                           tensor=unit)
            else:
                _, scale = convert_tensors._companion(ctx, job, hf_name, ("weight_scale",))
                data = nvfp4_from_modelopt_layout(packed, convert_tensors._slice(ctx.checkpoint.raw(scale), index),
                                                  tensor=unit)
            data = data.reshape(-1, data.shape[-1])
            return None, data if selected is None else data[selected]
        first = 0 if expert is None else expert * per_matrix
        yield Piece(expert, first, per_matrix, produce)
