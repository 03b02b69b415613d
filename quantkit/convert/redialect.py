"""``quantkit redialect``: the same GGUF under the other dialect's names, keys and order, payloads unchanged.

Every payload is copied byte for byte and its SHA-256 compared with the input's after writing; the one payload
ds4 stores differently (GLM's A_log, :data:`quantkit.arch.dialects.LAYOUT_A_LOG`) is mapped and proven to map back
to the same bytes.  That is not always the checkpoint's A_log: several float32 values below 1 in magnitude share one
``-exp(A_log)``, and the log picks one of them; ``convert --dialect ds4`` writes the checkpoint's own.  Convert's
provenance keys stay out of the translation and follow it, where convert writes them, so the header is the one
``convert --dialect`` writes.  A tensor or key the tables cannot map is refused by name before anything is written.
The output is written to ``<out>.partial`` and renamed when complete.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..arch.dialects import LAYOUT_A_LOG, convert_payload, dialect_of, translate
from ..errors import ValidationError
from ..io.atomic import check_output, input_files
from ..io.gguf import KV
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import GGUFWriter, plan_layout
from .provenance import is_provenance_key, merged_metadata


@dataclass(frozen=True)
class RedialectResult:
    path: Path
    source_dialect: str
    dialect: str
    tensors: int
    copied: int
    """Payloads copied unchanged (hash-verified)."""
    mapped: list[str]
    """Payloads the dialects store differently (A_log), mapped and verified to map back."""
    file_size: int


def redialect(src: str | os.PathLike, out: str | os.PathLike, *, to: str, force: bool = False) -> RedialectResult:
    """Write ``src`` in dialect ``to`` as ``out``."""
    # never the input itself (also through a link), never an existing file without --force
    out = check_output(out, inputs=input_files([src]), overwrite=force)
    with GGUFFile(src) as gguf:
        frm = dialect_of(gguf.metadata)
        model_metadata, provenance = split_provenance(gguf.metadata)
        translation = translate(model_metadata, [(t.name, t.shape, t.type) for t in gguf.tensors.values()], to=to)
        # convert translates the plan's metadata, then appends its provenance: the same here, so the provenance
        # keys stay out of the stash and follow it, as in the file convert writes in dialect `to`
        metadata = merged_metadata(translation.metadata, provenance)
        layout = plan_layout(metadata, [(m.name, m.shape, m.type) for m in translation.moves])
        writer = GGUFWriter(out, layout, overwrite=force)
        writer.write_header()
        mapped = []
        try:
            for move in translation.moves:
                raw = gguf.data(move.source)
                payload = convert_payload(move, raw, to)
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


def split_provenance(metadata: Mapping[str, KV]) -> tuple[dict[str, KV], list[tuple[str, KV]]]:
    """``metadata`` without convert's provenance keys, and those keys: the trailing run of keys
    :func:`~quantkit.convert.provenance.is_provenance_key` recognizes, where convert appends them (a provenance-like
    key elsewhere, such as llama.cpp's own ``general.file_type``, is the model's metadata and is translated)."""
    items = list(metadata.items())
    start = len(items)
    while start and is_provenance_key(items[start - 1][0]):
        start -= 1
    return dict(items[:start]), items[start:]


__all__ = ["RedialectResult", "redialect", "split_provenance"]
