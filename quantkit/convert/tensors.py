"""One planned GGUF tensor's bytes, produced from the source in bounded memory: the unit of conversion work.

A :class:`TensorJob` is the small, picklable description a worker receives (by name, through the executor);
:func:`pieces` splits it into :class:`Piece` units in file order, each produced on demand (all rows or some), and
:func:`tensor_bytes` is the concatenation of every piece: exactly the tensor's planned bytes.  ``convert`` writes
``tensor_bytes``; payload validation produces the pieces it samples (some experts, some rows) and compares them.

Memory: at most one *unit* (piece) is held as float32 at a time, plus its encoded bytes:

- stacked experts (one source tensor per expert) and fused 3-D expert tensors (``[E, rows, n]``, sliced with
  ``tensor_f32(name, expert=e)``; only row-slicing transforms such as ``gate_half`` are applied per slice): one
  expert per unit, encoded with that expert's importance;
- tensors whose sources are stored F32/F16/BF16 and need no transform (embedding and n-gram tables, shards of
  one table): row chunks of at most :data:`ROW_CHUNK_BYTES` of float32, source by source;
- anything else (a transform, an FP8 source, bootstrap importance over the whole tensor): the whole tensor.

Every block type encodes rows independently (ggml's ``quantize_chunk``), so splitting by rows or experts gives
the same bytes as one call on the whole tensor.

Kinds (``TensorJob.kind``):

- ``encode``: float32 units through :func:`quantkit.formats.api.encode` with the unit's importance.  ``copy``
  (keep a F32/F16/BF16 source as the same type) takes this path too: decoding widens exactly and re-encoding to
  the source type gives back the stored bits, so the copy is byte-exact by construction.
- ``mxfp4-repack`` / ``nvfp4-repack``: the stored FP4 bytes and scale bytes permuted into GGUF blocks
  (:mod:`quantkit.convert.repack`), expert by expert; no float values are computed.
- ``nvfp4-scale``: the F32 ``<weight>.scale`` tensor: one multiplier per expert (or one for a plain weight).
- ``engram-rows``: an FP8 table with E8M0 scales per 32 values of a row (V4.1 Engram) as its native row store
  (:mod:`quantkit.engram.rows`): each row's code bytes then its scale bytes, read with ``pread`` in row chunks of
  :data:`quantkit.engram.CHUNK_BYTES` (sampled rows read alone); a row holding an E4M3 NaN code or a 0xFF scale
  is refused, naming it.  The same tables re-encoded to a block type (``encode``) are decoded chunk by chunk.
- integer outputs (``hash_routing`` tables) are written as I32, range-checked by the ``to_int32`` transform.

Importance (``TensorJob.importance``): ``none``; ``imatrix`` -- the imatrix entry of the tensor (per expert
slice for experts), except the experts listed in ``TensorJob.bootstrap`` (``None`` in it: the whole tensor),
which the imatrix never observed; ``bootstrap`` -- weight energy (Σ w² per input column) for every unit.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from ..arch import CLASS_GROUPS, OutputTensor, get_arch
from ..arch import transforms
from ..errors import SourceError, UnsupportedError, ValidationError
from ..formats.api import encode
from ..formats.registry import GGMLType
from ..io.checkpoint import open_checkpoint
from ..imatrix import bootstrap_importance, load_imatrix, require_release_imatrix
from ..imatrix.names import is_gguf_name, to_gguf_names
from ..engram import rows as engram_rows
from ..engram.rows import RowSource
from .plan import row_scaled_fp8
from .repack import mxfp4_from_fp4_e8m0, nvfp4_from_modelopt_layout, nvfp4_tensor_scale

#: Largest float32 chunk of a row-chunked table (a 95 GiB BF16 n-gram table streams in pieces of this size).
ROW_CHUNK_BYTES = 256 << 20
#: Transform steps that only select rows of each expert, so they can be applied to one expert slice at a time.
EXPERT_LOCAL_STEPS = frozenset({"gate_half", "up_half"})
KINDS = ("encode", "copy", "mxfp4-repack", "nvfp4-repack", "nvfp4-scale", "engram-rows")
_PLAIN_DTYPES = ("F32", "F16", "BF16")
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
_PACKED_FP4_DTYPES = ("I8", "U8", "F4")
#: Stored global-scale companion role -> NVFP4 convention (ModelOpt multiplies, compressed-tensors divides).
_NVFP4_GLOBAL_ROLES = {"weight_scale_2": "modelopt", "weight_global_scale": "compressed-tensors"}


@dataclass(frozen=True)
class TensorJob:
    """What a worker needs to produce one GGUF tensor (small and picklable: names and shapes, no arrays)."""

    name: str
    qtype: GGMLType
    output: OutputTensor
    """The GGUF tensor and its sources (for ``nvfp4-scale``: the weight whose global scales it holds)."""
    nbytes: int
    kind: str = "encode"
    importance: str = "none"
    bootstrap: frozenset = field(default_factory=frozenset)
    """Matrices (experts; ``None``: a whole 2-D tensor) that take bootstrap importance under ``imatrix``."""
    imatrix_name: str | None = None
    """The name of the tensor's imatrix entry, when not ``name`` (llama.cpp's name of a tensor in the ds4 dialect)."""


def imatrix_shapes(outputs: Iterable[OutputTensor]) -> dict[str, tuple[int, int]]:
    """(row length, matrices) of every GGUF tensor an imatrix may describe: 2-D weights hold one matrix, 3-D
    tensors (stacked experts, MLA's per-head ``attn_k_b``) one per leading index."""
    return {o.gguf_name: (int(o.shape[-1]), int(o.shape[0]) if len(o.shape) == 3 else 1)
            for o in outputs if len(o.shape) in (2, 3) and o.dtype == "float32"}


def load_model_imatrix(path: str | os.PathLike, amap, shapes: Mapping[str, tuple[int, int]], *,
                       allow_synthetic: bool = False):
    """Read an imatrix for this model: refused when synthetic (unless allowed), Hugging Face entry names mapped to
    GGUF names, every entry checked against ``shapes`` (:func:`imatrix_shapes`), split into one matrix per
    expert, and llama-imatrix's per-group entries of grouped weights folded (``Imatrix.conform``).  The caller and
    every worker read it the same way."""
    imatrix = load_imatrix(path)
    require_release_imatrix(imatrix, allow_synthetic=allow_synthetic)
    if not all(is_gguf_name(name) for name in imatrix.entries):
        imatrix = to_gguf_names(imatrix, amap)
    # which tensors need an entry is the plan's decision (bootstrap or an error there); here: does it fit
    return imatrix.conform(shapes, required=(), groups=amap.input_group_counts(shapes))


class SourceContext:
    """A worker's view of the source, opened lazily once per process: checkpoint, architecture map, imatrix."""

    def __init__(self, source_path: str, model_type: str, imatrix_path: str | None = None,
                 imatrix_shapes: Mapping[str, tuple[int, int]] | None = None, allow_synthetic_imatrix: bool = False,
                 device: str = "cpu"):
        self.source_path = source_path
        self.device = device
        """Where ``encode`` units run: "cpu" (numba), or a torch device ("cuda") for the types with a GPU
        encoder (:mod:`quantkit.kernels.gpu_encode`, same bytes); the others stay on the CPU."""
        self.model_type = model_type
        self.imatrix_path = imatrix_path
        self.imatrix_shapes = dict(imatrix_shapes or {})
        self.allow_synthetic_imatrix = allow_synthetic_imatrix

    @cached_property
    def checkpoint(self):
        return open_checkpoint(self.source_path)

    @cached_property
    def amap(self):
        return get_arch(self.model_type).bind(self.checkpoint.config)

    @cached_property
    def imatrix(self):
        if self.imatrix_path is None:
            raise ValidationError("the plan asks for imatrix importance but no imatrix was given")
        return load_model_imatrix(self.imatrix_path, self.amap, self.imatrix_shapes,
                                  allow_synthetic=self.allow_synthetic_imatrix)

    def array(self, hf_name: str) -> np.ndarray:
        """A source tensor as the arch map's transforms take it: integer tables as stored, anything else float32
        (packed FP4 is stored as U8/I8 too, but has scale companions)."""
        ckpt = self.checkpoint
        if ckpt.tensor_info(hf_name).dtype in _INT_DTYPES and not ckpt.companions(hf_name):
            return np.asarray(self.checkpoint.raw(hf_name))
        return self.checkpoint.tensor_f32(hf_name)

    def release(self) -> None:
        """Unmap the source shards (their headers stay parsed; the next read maps again).  Pages read through a
        map count towards the process's resident memory until it is unmapped, so workers release after each
        tensor: otherwise a worker that has read a whole shard holds all of it."""
        if "checkpoint" in self.__dict__:
            self.checkpoint.close()


# -- pieces -----------------------------------------------------------------------------------------------------

Produce = Callable[[np.ndarray | None], tuple[np.ndarray | None, np.ndarray]]


@dataclass(frozen=True)
class Piece:
    """One unit of a tensor's payload, produced on demand (nothing is read from the source before ``produce``).

    A piece covers ``rows`` consecutive rows of the tensor's ``[rows, n]`` view (every leading axis flattened; an
    expert of a 3-D ``[E, R, n]`` tensor is rows ``e*R .. e*R+R``).  ``produce(rows)`` takes None for every row,
    or sorted indices relative to the piece's first row, and returns the source values that were encoded (float32
    ``[k, n]``; None for integer tables and lossless repacks) and the bytes ``uint8[k, row_bytes]``.  A subset of
    rows is read alone where the source allows it (a plain 2-D F32/F16/BF16 chunk whose importance is not
    computed from its own values); otherwise the whole piece is loaded and the rows selected after importance
    (bootstrap importance sums over every row), so the bytes are the same.
    """

    matrix: int | None
    """The expert (matrix of a 3-D tensor) this piece belongs to; None for 2-D and 1-D tensors."""
    row: int | None
    """First row in the tensor's ``[rows, n]`` view; None when only known after loading (a transformed shard)."""
    rows: int | None
    produce: Produce
    stored: Callable[[], tuple[str, np.ndarray]] | None = None
    """Where the piece is encoded from its source rows as they are: (stored dtype F32/F16/BF16, the memory-mapped
    ``[rows, n]`` view), so that a GPU can widen them itself (:mod:`quantkit.convert.gpu_stream`); None where
    values need host work first (a transform, a decode, importance computed from them, an integer table)."""


def tensor_rows(shape: tuple[int, ...]) -> int:
    """Rows of the ``[rows, n]`` view of a tensor of numpy ``shape``."""
    return math.prod(shape[:-1])


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(1, -1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def _select(data: np.ndarray, selected: np.ndarray | None) -> np.ndarray:
    return data if selected is None else data[selected]


def _expert_slices(out: OutputTensor) -> bool:
    """A single fused ``[E, rows, n]`` source that can be read one expert at a time."""
    return (out.assembly == "single" and len(out.shape) == 3 and out.tensor_class in CLASS_GROUPS["routed_experts"]
            and set(out.sources[0].transform) <= EXPERT_LOCAL_STEPS)


def _self_importance(job: TensorJob, matrix: int | None) -> bool:
    """Whether a unit's importance is computed from its own values (so it needs all of them)."""
    return job.importance == "bootstrap" or matrix in job.bootstrap or None in job.bootstrap


def _importance(ctx: SourceContext, job: TensorJob, matrix: int | None, x: np.ndarray) -> np.ndarray | None:
    if job.importance == "none":
        return None
    if _self_importance(job, matrix):
        return bootstrap_importance(x)
    found = ctx.imatrix.importance(job.imatrix_name or job.name, expert=matrix)
    if found is None:
        where = "" if matrix is None else f" for matrix {matrix}"
        raise ValidationError(f"the imatrix has no entry{where}, yet the plan did not mark it for bootstrap "
                              f"importance", tensor=job.name)
    return found


def _unit_name(job: TensorJob, matrix: int | None) -> str:
    return job.name if matrix is None else f"{job.name}[{matrix}]"


def _encode(ctx: SourceContext, x: np.ndarray, qtype, importance: np.ndarray | None, name: str) -> np.ndarray:
    if ctx.device != "cpu":
        from ..kernels import gpu_encode

        if gpu_encode.supports(qtype):
            return gpu_encode.encode(x, qtype, importance, device=ctx.device, name=name)
    return encode(x, qtype, importance, name=name)


def _encoder(ctx: SourceContext, job: TensorJob, matrix: int | None, load: Callable[[], np.ndarray],
             load_rows: Callable[[np.ndarray], np.ndarray] | None = None) -> Produce:
    """``produce`` of an ``encode``/``copy`` unit: ``load()`` gives all of it, ``load_rows(rows)`` some rows."""
    def produce(selected: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
        direct = selected is not None and load_rows is not None and not _self_importance(job, matrix)
        x = load_rows(selected) if direct else load()
        after = None if direct else selected
        if job.output.dtype == "int32":
            return None, _select(np.ascontiguousarray(_rows(x), dtype="<i4"), after).view(np.uint8)
        if matrix is None and x.ndim == 3:   # a 3-D shard read whole: ggml takes importance per matrix
            data = np.concatenate([_encode(ctx, _rows(w), job.qtype, _importance(ctx, job, m, _rows(w)),
                                           _unit_name(job, m)) for m, w in enumerate(x)])
            return _select(_rows(x), after), _select(data, after)
        x = _rows(x)
        importance = _importance(ctx, job, matrix, x)
        x = _select(x, after)
        return x, _encode(ctx, x, job.qtype, importance, _unit_name(job, matrix))
    return produce


def _encode_pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
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

    def plain(m, e: int | None) -> bool:
        """Whether source ``m`` (expert ``e`` of a fused tensor) is a float matrix used as stored (no transform)."""
        info = ctx.checkpoint.tensor_info(m.hf_name)
        return not m.transform and info.dtype in _PLAIN_DTYPES and len(info.shape) == (2 if e is None else 3)

    def stored(m, matrix: int | None, e: int | None = None, r0: int = 0, count: int | None = None):
        """``Piece.stored`` of matrix ``matrix`` read from source ``m`` (expert ``e`` of a fused tensor, rows
        ``r0 .. r0 + count``)."""
        if not plain(m, e) or out.dtype == "int32" or _self_importance(job, matrix):
            return None

        def rows() -> tuple[str, np.ndarray]:
            raw = ctx.checkpoint.raw(m.hf_name)
            raw = raw if e is None else raw[e]
            return ctx.checkpoint.tensor_info(m.hf_name).dtype, raw[r0:None if count is None else r0 + count]
        return rows

    def expert_rows(m, e: int | None) -> Callable[[np.ndarray], np.ndarray] | None:
        """Reads some rows of one expert alone where its source is a plain float matrix (an audit's edge rows)."""
        if not plain(m, e):
            return None
        if e is None:
            return functools.partial(chunk_rows, m.hf_name, 0)
        return lambda selected: np.asarray(ctx.checkpoint.raw(m.hf_name)[e][selected], dtype=np.float32)

    def whole() -> Iterator[Piece]:
        load = functools.lru_cache(maxsize=1)(lambda: ctx.amap.assemble(out, ctx.array))   # shared by matrices
        if len(out.shape) == 3:
            for e in range(out.shape[0]):
                yield Piece(e, e * per_matrix, per_matrix, _encoder(ctx, job, e, lambda e=e: load()[e]))
        else:
            yield Piece(None, 0, tensor_rows(out.shape), _encoder(ctx, job, None, load))

    if out.assembly == "stack_experts":
        for e, m in enumerate(out.sources):
            yield Piece(e, e * per_matrix, per_matrix,
                        _encoder(ctx, job, e, functools.partial(source, m), expert_rows(m, None)), stored(m, e))
        return
    if out.assembly == "concat_columns":   # every row needs every part
        yield from whole()
        return
    if _expert_slices(out):
        for e in range(out.shape[0]):
            load = functools.partial(expert_slice, out.sources[0], e)
            yield Piece(e, e * per_matrix, per_matrix, _encoder(ctx, job, e, load, expert_rows(out.sources[0], e)),
                        stored(out.sources[0], e, e))
        return
    if len(out.sources) == 1 and not out.sources[0].transform and row_scaled_fp8(ctx.checkpoint,
                                                                                   out.sources[0].hf_name):
        yield from _row_scaled_pieces(ctx, job)
        return
    if len(out.sources) == 1 and (job.importance == "bootstrap" or None in job.bootstrap):
        yield from whole()   # Σw² needs the whole tensor at once
        return
    row = 0
    for m in out.sources:   # one source, or one per shard (concatenated along rows)
        info = ctx.checkpoint.tensor_info(m.hf_name)
        if m.transform or info.dtype not in _PLAIN_DTYPES or len(info.shape) != 2 or len(out.shape) != 2:
            if len(out.sources) == 1:
                yield from whole()
                return
            rows = None if m.transform else tensor_rows(tuple(info.shape))
            yield Piece(None, row, rows, _encoder(ctx, job, None, functools.partial(source, m)))
            row = None if rows is None or row is None else row + rows
            continue
        rows, n = (int(d) for d in info.shape)
        step = max(1, ROW_CHUNK_BYTES // max(1, 4 * n))
        for r0 in range(0, rows, step):
            count = min(step, rows - r0)
            yield Piece(None, None if row is None else row + r0, count,
                        _encoder(ctx, job, None, functools.partial(chunk, m.hf_name, r0, count),
                                 functools.partial(chunk_rows, m.hf_name, r0)), stored(m, None, r0=r0, count=count))
        row = None if row is None else row + rows


def _row_source(ctx: SourceContext, job: TensorJob) -> RowSource:
    name = job.output.sources[0].hf_name
    scale = row_scaled_fp8(ctx.checkpoint, name)
    if scale is None:
        raise SourceError(f"{job.kind} needs an FP8 table with E8M0 scales per 32 values of a row", tensor=name)
    return RowSource(ctx.checkpoint, name, scale)


def _row_scaled_pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """Row chunks of a row-scaled FP8 table: its native rows (``engram-rows``) or their decoded values encoded
    to the planned block type; refuses rows holding E4M3 NaN codes or 0xFF scales."""
    table = _row_source(ctx, job)
    if job.importance != "none":   # rows are read by chunk or alone: no whole-table statistics
        raise UnsupportedError(f"re-encoding a row table with {job.importance} importance is not supported; give it "
                               f"a type that ignores importance (Q8_0, MXFP4) or keep its native rows "
                               f"(type = \"source\")", tensor=job.name)
    step = max(1, engram_rows.CHUNK_BYTES // table.row_bytes)

    def produce(r0: int, count: int, selected: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
        rows = np.arange(r0, r0 + count) if selected is None else r0 + np.asarray(selected, dtype=np.int64)
        with table:
            if selected is None:
                packed, invalid = table.packed(r0, count)
            else:
                packed = table.rows_at(rows)
                invalid = 0 if any(a.size for a in engram_rows.invalid_rows(packed, table.head_dim)) else -1
        problem = None if invalid < 0 else engram_rows.describe_invalid(packed, table.head_dim, rows)
        if problem is not None:
            raise SourceError(f"invalid source {problem}", tensor=table.name)
        if job.kind == "engram-rows":
            return None, packed
        x = engram_rows.decode_rows(packed, table.head_dim)
        return x, encode(x, job.qtype, _importance(ctx, job, None, x), name=job.name)

    for r0 in range(0, table.rows, step):
        count = min(step, table.rows - r0)
        yield Piece(None, r0, count, functools.partial(produce, r0, count))


# -- lossless repacks -------------------------------------------------------------------------------------------

def _stored_sources(job: TensorJob) -> Iterator[tuple[int | None, str, int | None]]:
    """(expert, stored source name, index into its leading axis or None) in file order."""
    out = job.output
    if any(m.transform for m in out.sources):
        raise UnsupportedError(f"a lossless repack cannot apply the transform {out.sources[0].transform}",
                               tensor=job.name)
    if out.assembly == "stack_experts":
        for e, m in enumerate(out.sources):
            yield e, m.hf_name, None
    elif len(out.shape) == 3 and out.tensor_class in CLASS_GROUPS["routed_experts"]:
        for e in range(out.shape[0]):
            yield e, out.sources[0].hf_name, e
    elif out.assembly == "single":
        yield None, out.sources[0].hf_name, None
    else:
        raise UnsupportedError(f"no lossless repack for a {out.assembly} tensor", tensor=job.name)


def _companion(ctx: SourceContext, job: TensorJob, hf_name: str, roles: tuple[str, ...]) -> tuple[str, str]:
    comps = ctx.checkpoint.companions(hf_name)
    for role in roles:
        if role in comps:
            return role, comps[role]
    raise SourceError(f"{job.kind} needs a companion {' or '.join(roles)} of {hf_name!r}; found {sorted(comps)}",
                      tensor=job.name)


def _slice(a: np.ndarray, index: int | None) -> np.ndarray:
    return a if index is None else a[index]


def _repacked(ctx: SourceContext, job: TensorJob, expert: int | None, hf_name: str, index: int | None
              ) -> np.ndarray:
    """One stored source's (expert's) GGUF blocks, as ``uint8[rows, row_bytes]``."""
    ckpt = ctx.checkpoint
    info = ckpt.tensor_info(hf_name)
    if info.dtype not in _PACKED_FP4_DTYPES:
        raise SourceError(f"{job.kind} needs packed FP4 weights, {hf_name!r} is {info.dtype}", tensor=job.name)
    packed = _slice(ckpt.raw(hf_name), index)
    unit = _unit_name(job, expert)
    if job.kind == "mxfp4-repack":
        _, scale_name = _companion(ctx, job, hf_name, ("scale", "scale_inv"))
        data = mxfp4_from_fp4_e8m0(packed, _slice(ckpt.raw(scale_name), index), tensor=unit)
    else:
        _, scale_name = _companion(ctx, job, hf_name, ("weight_scale",))
        data = nvfp4_from_modelopt_layout(packed, _slice(ckpt.raw(scale_name), index), tensor=unit)
    return data.reshape(-1, data.shape[-1])


def _repack_pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """One piece per stored source (expert)."""
    out = job.output
    per_matrix = tensor_rows(out.shape[1:]) if len(out.shape) == 3 else tensor_rows(out.shape)
    for expert, hf_name, index in _stored_sources(job):
        def produce(selected: np.ndarray | None, expert=expert, hf_name=hf_name, index=index
                    ) -> tuple[None, np.ndarray]:
            return None, _select(_repacked(ctx, job, expert, hf_name, index), selected)
        yield Piece(expert, 0 if expert is None else expert * per_matrix, per_matrix, produce)


def _nvfp4_scales(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """One piece: one F32 multiplier per expert (tiny, produced whole)."""
    rows = tensor_rows(job.output.shape)

    def produce(selected: np.ndarray | None) -> tuple[None, np.ndarray]:
        values = []
        for expert, hf_name, index in _stored_sources(job):
            role, name = _companion(ctx, job, hf_name, tuple(_NVFP4_GLOBAL_ROLES))
            stored = np.asarray(ctx.checkpoint.raw(name))
            if index is not None and stored.size != 1:
                stored = stored[index]
            values.append(nvfp4_tensor_scale(stored, _NVFP4_GLOBAL_ROLES[role], tensor=_unit_name(job, expert)))
        return None, _select(np.asarray(values, dtype="<f4").view(np.uint8).reshape(rows, -1), selected)
    yield Piece(None, 0, rows, produce)


def pieces(ctx: SourceContext, job: TensorJob) -> Iterator[Piece]:
    """The job's pieces in file order (:class:`Piece`); an unknown kind is refused at once."""
    if job.kind in ("encode", "copy"):
        return _encode_pieces(ctx, job)
    if job.kind in ("mxfp4-repack", "nvfp4-repack"):
        return _repack_pieces(ctx, job)
    if job.kind == "nvfp4-scale":
        return _nvfp4_scales(ctx, job)
    if job.kind == "engram-rows":
        return _row_scaled_pieces(ctx, job)
    raise UnsupportedError(f"unknown tensor job kind {job.kind!r}; known: {KINDS}", tensor=job.name)


def tensor_bytes(ctx: SourceContext, job: TensorJob) -> Iterator[np.ndarray]:
    """The job's payload as ``uint8`` pieces in file order (their concatenation is the whole payload); on a GPU,
    the types it encodes stream through :func:`quantkit.convert.gpu_stream.encode_stream`."""
    units = pieces(ctx, job)
    if ctx.device != "cpu" and job.kind in ("encode", "copy"):
        from ..kernels import gpu_encode

        if gpu_encode.supports(job.qtype):
            from .gpu_stream import encode_stream

            return encode_stream(ctx, job, units, ctx.device)
    return (piece.produce(None)[1].reshape(-1) for piece in units)
