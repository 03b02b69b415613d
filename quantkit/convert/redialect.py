"""``quantkit redialect``: the same GGUF under the other dialect's names, keys and order, payloads unchanged.

Every payload is copied byte for byte and its SHA-256 compared with the input's after writing, except the one
ds4 stores differently (GLM's A_log, :data:`quantkit.arch.dialects.LAYOUT_A_LOG`: llama.cpp's ``ssm_a`` holds
``-exp(A_log)`` in float32, ds4's ``kda_a_log`` ``A_log``).  ds4 -> llama.cpp computes ``-exp(A_log)`` as
``convert`` does.  llama.cpp -> ds4 cannot invert it: below 1 in magnitude several float32 ``A_log`` share one
``-exp(A_log)``.  So it takes ``source``, the checkpoint the file was made from: the checkpoint's ``A_log`` is
built as ``convert --dialect ds4`` builds it, must give the input's ``ssm_a`` bytes under llama.cpp's mapping, and
is written (:func:`source_payloads`); without a source, or with another checkpoint, such a file is refused.
Convert's provenance keys stay out of the translation and follow it, where convert writes them, so the output is
the file ``convert --dialect`` writes.  A tensor or key the tables cannot map is refused by name before anything
is written.  The output is written to ``<out>.partial`` and renamed when complete.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..arch import ARCHITECTURES
from ..arch.dialects import DS4, LAYOUT_A_LOG, LLAMA_CPP, TensorMove, convert_payload, dialect_of, translate
from ..errors import SourceError, ValidationError
from ..formats.api import tensor_nbytes
from ..formats.registry import GGMLType
from ..io.atomic import check_output, input_files
from ..io.checkpoint import open_checkpoint
from ..io.gguf import KV
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import GGUFWriter, plan_layout
from .plan import dialect_output, source_outputs
from .provenance import is_provenance_key, merged_metadata
from .source import resolve_source
from .tensors import SourceContext, TensorJob, tensor_bytes


@dataclass(frozen=True)
class RedialectResult:
    path: Path
    source_dialect: str
    dialect: str
    tensors: int
    copied: int
    """Payloads copied unchanged (hash-verified)."""
    mapped: list[str]
    """Payloads the dialects store differently (A_log): to llama.cpp ``-exp(A_log)``, to ds4 the source's
    ``A_log`` (:func:`source_payloads`)."""
    file_size: int


def redialect(src: str | os.PathLike, out: str | os.PathLike, *, to: str, force: bool = False,
              source: str | os.PathLike | None = None) -> RedialectResult:
    """Write ``src`` in dialect ``to`` as ``out``; ``source``: the checkpoint ``src`` was converted from, read only
    where the input cannot give a payload exactly (:func:`source_payloads`)."""
    # never an input (also through a link), never an existing file without --force
    out = check_output(out, inputs=input_files([src, source]), overwrite=force)
    with GGUFFile(src) as gguf:
        frm = dialect_of(gguf.metadata)
        model_metadata, provenance = split_provenance(gguf.metadata)
        translation = translate(model_metadata, [(t.name, t.shape, t.type) for t in gguf.tensors.values()], to=to)
        # convert translates the plan's metadata, then appends its provenance: the same here, so the provenance
        # keys stay out of the stash and follow it, as in the file convert writes in dialect `to`
        metadata = merged_metadata(translation.metadata, provenance)
        layout = plan_layout(metadata, [(m.name, m.shape, m.type) for m in translation.moves])
        from_source = source_payloads(gguf, translation.moves, to, source)   # refused before anything is written
        writer = GGUFWriter(out, layout, overwrite=force)
        writer.write_header()
        mapped = []
        try:
            for move in translation.moves:
                raw = gguf.data(move.source)
                payload = from_source[move.name] if move.name in from_source else convert_payload(move, raw, to)
                digest = writer.write_tensor(move.name, payload)
                if move.layout == LAYOUT_A_LOG:
                    mapped.append(move.name)
                elif digest != hashlib.sha256(raw).hexdigest():
                    raise ValidationError("payload changed while copying", tensor=move.source, path=out)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
    return RedialectResult(out, frm, to, len(translation.moves), len(translation.moves) - len(mapped), mapped,
                           layout.file_size)


def source_payloads(gguf: GGUFFile, moves: Sequence[TensorMove], to: str, source: str | os.PathLike | None
                    ) -> dict[str, bytes]:
    """The payloads of ``moves`` the input cannot give exactly, by output name: ds4's ``A_log`` from llama.cpp's
    ``-exp(A_log)`` (several float32 ``A_log`` below 1 in magnitude share one).  Each is built from ``source`` (a
    checkpoint directory or Hugging Face repo id, read only) through the steps ``convert --dialect ds4`` uses, and
    must map to the input's stored bytes as ``convert`` maps ``A_log`` for llama.cpp (:func:`convert_payload`).
    Refused (exit 2) without a source, or when it is not the checkpoint the file was made from."""
    needed = [m for m in moves if m.layout == LAYOUT_A_LOG] if to == DS4 else []
    if not needed:
        return {}
    if source is None:
        raise SourceError(f"llama.cpp's ssm_a holds -exp(A_log) and several float32 A_log values map to each stored "
                          f"value, so ds4's A_log cannot be recovered from the file: pass --source CKPT, the "
                          f"checkpoint the file was made from, or convert with --dialect ds4",
                          path=gguf.path, tensor=needed[0].source)
    resolved = resolve_source(source)
    arch = gguf.metadata["general.architecture"].value
    with open_checkpoint(resolved.path) as ckpt:
        model_type = ckpt.config.get("model_type")
    if model_type not in ARCHITECTURES or ARCHITECTURES[model_type].gguf_arch != arch:
        raise ValidationError(f"the source is a {model_type!r} checkpoint, the file a {arch!r} model: not the "
                              f"checkpoint the file was made from", path=resolved.path, field="model_type")
    ctx = SourceContext(str(resolved.path), model_type)
    try:
        outputs = {o.gguf_name: o for o in source_outputs(ctx.checkpoint, ctx.amap)}
        payloads = {}
        for move in needed:
            mismatch = ValidationError(f"-exp of the A_log in {resolved.given} is not this tensor's stored value: not "
                                       f"the checkpoint the file was made from", path=gguf.path, tensor=move.source)
            output = outputs.get(move.source)
            if output is None or tuple(output.shape) != tuple(gguf.tensors[move.source].shape):
                raise mismatch
            job = TensorJob(move.name, GGMLType.F32, dialect_output(output, move),
                            tensor_nbytes(GGMLType.F32, move.shape))
            payload = b"".join(piece.tobytes() for piece in tensor_bytes(ctx, job))
            if convert_payload(move, payload, LLAMA_CPP) != bytes(gguf.data(move.source)):
                raise mismatch
            payloads[move.name] = payload
    finally:
        ctx.release()
    return payloads


def split_provenance(metadata: Mapping[str, KV]) -> tuple[dict[str, KV], list[tuple[str, KV]]]:
    """``metadata`` without convert's provenance keys, and those keys: the trailing run of keys
    :func:`~quantkit.convert.provenance.is_provenance_key` recognizes, where convert appends them (a provenance-like
    key elsewhere, such as llama.cpp's own ``general.file_type``, is the model's metadata and is translated)."""
    items = list(metadata.items())
    start = len(items)
    while start and is_provenance_key(items[start - 1][0]):
        start -= 1
    return dict(items[:start]), items[start:]


__all__ = ["RedialectResult", "redialect", "source_payloads", "split_provenance"]
