"""One planned GGUF tensor's bytes, produced from the source in bounded memory: the unit of conversion work.

A :class:`TensorJob` is the small, picklable description a worker receives (by name, through the executor);
:func:`tensor_bytes` yields the payload in file order as ``uint8`` pieces whose concatenation is exactly the
tensor's planned bytes.  The same function serves ``convert`` and payload validation (re-encode and compare).

Memory: at most one *unit* is held as float32 at a time, plus its encoded bytes:

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
- integer outputs (``hash_routing`` tables) are written as I32, range-checked by the ``to_int32`` transform.

Importance (``TensorJob.importance``): ``none``; ``imatrix`` -- the imatrix entry of the tensor (per expert
slice for experts), except the experts listed in ``TensorJob.bootstrap`` (``None`` in it: the whole tensor),
which the imatrix never observed; ``bootstrap`` -- weight energy (Σ w² per input column) for every unit.
"""
from __future__ import annotations

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
from .repack import mxfp4_from_fp4_e8m0, nvfp4_from_modelopt_layout, nvfp4_tensor_scale

#: Largest float32 chunk of a row-chunked table (a 95 GiB BF16 n-gram table streams in pieces of this size).
ROW_CHUNK_BYTES = 256 << 20
#: Transform steps that only select rows of each expert, so they can be applied to one expert slice at a time.
EXPERT_LOCAL_STEPS = frozenset({"gate_half", "up_half"})
KINDS = ("encode", "copy", "mxfp4-repack", "nvfp4-repack", "nvfp4-scale")
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


def imatrix_shapes(outputs: Iterable[OutputTensor]) -> dict[str, tuple[int, int]]:
    """(row length, matrices) of every GGUF tensor an imatrix may describe: 2-D weights hold one matrix, 3-D
    tensors (stacked experts, MLA's per-head ``attn_k_b``) one per leading index."""
    return {o.gguf_name: (int(o.shape[-1]), int(o.shape[0]) if len(o.shape) == 3 else 1)
            for o in outputs if len(o.shape) in (2, 3) and o.dtype == "float32"}


def load_model_imatrix(path: str | os.PathLike, amap, shapes: Mapping[str, tuple[int, int]], *,
                       allow_synthetic: bool = False):
    """Read an imatrix for this model: refused when synthetic (unless allowed), Hugging Face entry names mapped to
    GGUF names, every entry checked against ``shapes`` (:func:`imatrix_shapes`) and split into one matrix per
    expert.  The caller and every worker read it the same way."""
    imatrix = load_imatrix(path)
    require_release_imatrix(imatrix, allow_synthetic=allow_synthetic)
    if not all(is_gguf_name(name) for name in imatrix.entries):
        imatrix = to_gguf_names(imatrix, amap)
    # which tensors need an entry is the plan's decision (bootstrap or an error there); here: does it fit
    return imatrix.conform(shapes, required=())


class SourceContext:
    """A worker's view of the source, opened lazily once per process: checkpoint, architecture map, imatrix."""

    def __init__(self, source_path: str, model_type: str, imatrix_path: str | None = None,
                 imatrix_shapes: Mapping[str, tuple[int, int]] | None = None, allow_synthetic_imatrix: bool = False):
        self.source_path = source_path
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


# -- units ------------------------------------------------------------------------------------------------------

Unit = tuple[int | None, Callable[[], np.ndarray]]
"""(matrix index or None, loader of a float32 (or integer) array: 2-D rows, or a whole tensor of any rank)."""


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(1, -1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def _expert_slices(out: OutputTensor) -> bool:
    """A single fused ``[E, rows, n]`` source that can be read one expert at a time."""
    return (out.assembly == "single" and len(out.shape) == 3 and out.tensor_class in CLASS_GROUPS["routed_experts"]
            and set(out.sources[0].transform) <= EXPERT_LOCAL_STEPS)


def _units(ctx: SourceContext, job: TensorJob) -> Iterator[Unit]:
    out, hp = job.output, ctx.amap.hp
    if out.assembly == "stack_experts":
        for e, m in enumerate(out.sources):
            yield e, (lambda m=m: transforms.apply(m.transform, ctx.array(m.hf_name), hp))
        return
    if _expert_slices(out):
        m = out.sources[0]
        for e in range(out.shape[0]):
            yield e, (lambda e=e: transforms.apply(m.transform, ctx.checkpoint.tensor_f32(m.hf_name, expert=e)[None],
                                                   hp)[0])
        return
    if len(out.sources) == 1 and (job.importance == "bootstrap" or None in job.bootstrap):
        yield None, (lambda: ctx.amap.assemble(out, ctx.array))   # Σw² needs the whole tensor at once
        return
    for m in out.sources:   # one source, or one per shard (concatenated along rows)
        info = ctx.checkpoint.tensor_info(m.hf_name)
        if m.transform or info.dtype not in _PLAIN_DTYPES or len(info.shape) != 2 or len(out.shape) != 2:
            if len(out.sources) == 1:
                yield None, (lambda: ctx.amap.assemble(out, ctx.array))
            else:
                yield None, (lambda m=m: transforms.apply(m.transform, ctx.array(m.hf_name), hp))
            continue
        rows, n = info.shape
        step = max(1, ROW_CHUNK_BYTES // max(1, 4 * n))
        for r0 in range(0, rows, step):
            yield None, (lambda m=m, r0=r0: np.asarray(ctx.checkpoint.raw(m.hf_name)[r0:r0 + step],
                                                      dtype=np.float32))


def _importance(ctx: SourceContext, job: TensorJob, matrix: int | None, x: np.ndarray) -> np.ndarray | None:
    if job.importance == "none":
        return None
    if job.importance == "bootstrap" or matrix in job.bootstrap or None in job.bootstrap:
        return bootstrap_importance(x)
    found = ctx.imatrix.importance(job.name, expert=matrix)
    if found is None:
        where = "" if matrix is None else f" for matrix {matrix}"
        raise ValidationError(f"the imatrix has no entry{where}, yet the plan did not mark it for bootstrap "
                              f"importance", tensor=job.name)
    return found


def _unit_name(job: TensorJob, matrix: int | None) -> str:
    return job.name if matrix is None else f"{job.name}[{matrix}]"


def _encoded(ctx: SourceContext, job: TensorJob) -> Iterator[np.ndarray]:
    integer = job.output.dtype == "int32"
    if integer != (job.qtype == GGMLType.I32):
        raise UnsupportedError(f"an {job.output.dtype} tensor cannot be written as {job.qtype.name}", tensor=job.name)
    for index, load in _units(ctx, job):
        x = load()
        if integer:
            yield np.ascontiguousarray(x, dtype="<i4").view(np.uint8).reshape(-1)
            continue
        # a 3-D tensor read whole is encoded matrix by matrix: ggml takes importance per matrix (per expert)
        matrices = [(m, x[m]) for m in range(x.shape[0])] if index is None and x.ndim == 3 else [(index, x)]
        for matrix, w in matrices:
            w = _rows(w)
            yield encode(w, job.qtype, _importance(ctx, job, matrix, w), name=_unit_name(job, matrix)).reshape(-1)


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


def _repacked(ctx: SourceContext, job: TensorJob) -> Iterator[np.ndarray]:
    ckpt = ctx.checkpoint
    for expert, hf_name, index in _stored_sources(job):
        info = ckpt.tensor_info(hf_name)
        if info.dtype not in _PACKED_FP4_DTYPES:
            raise SourceError(f"{job.kind} needs packed FP4 weights, {hf_name!r} is {info.dtype}", tensor=job.name)
        packed = _slice(ckpt.raw(hf_name), index)
        unit = _unit_name(job, expert)
        if job.kind == "mxfp4-repack":
            _, scale_name = _companion(ctx, job, hf_name, ("scale", "scale_inv"))
            yield mxfp4_from_fp4_e8m0(packed, _slice(ckpt.raw(scale_name), index), tensor=unit).reshape(-1)
        else:
            _, scale_name = _companion(ctx, job, hf_name, ("weight_scale",))
            yield nvfp4_from_modelopt_layout(packed, _slice(ckpt.raw(scale_name), index), tensor=unit).reshape(-1)


def _nvfp4_scales(ctx: SourceContext, job: TensorJob) -> Iterator[np.ndarray]:
    values = []
    for expert, hf_name, index in _stored_sources(job):
        role, name = _companion(ctx, job, hf_name, tuple(_NVFP4_GLOBAL_ROLES))
        stored = np.asarray(ctx.checkpoint.raw(name))
        if index is not None and stored.size != 1:
            stored = stored[index]
        values.append(nvfp4_tensor_scale(stored, _NVFP4_GLOBAL_ROLES[role], tensor=_unit_name(job, expert)))
    yield np.asarray(values, dtype="<f4").view(np.uint8)


def tensor_bytes(ctx: SourceContext, job: TensorJob) -> Iterator[np.ndarray]:
    """The job's payload as ``uint8`` pieces in file order (their concatenation is the whole payload)."""
    if job.kind in ("encode", "copy"):
        return _encoded(ctx, job)
    if job.kind in ("mxfp4-repack", "nvfp4-repack"):
        return _repacked(ctx, job)
    if job.kind == "nvfp4-scale":
        return _nvfp4_scales(ctx, job)
    raise UnsupportedError(f"unknown tensor job kind {job.kind!r}; known: {KINDS}", tensor=job.name)
