"""Merging importance matrices, weighted by their counts, as ``llama-imatrix --in-file A --in-file B`` does.

For every tensor the raw sums add and the counts add, so the merged importance is the count-weighted mean of the
inputs' importances.  A tensor present in only some inputs keeps their statistics.  One count against several
(an old file's single count for a stacked tensor) is broadcast to every matrix, as llama.cpp does; any other
difference in matrix count or row length is an error naming the tensor.

Legacy ``.dat`` inputs count chunks, not tokens; like llama.cpp, their values and counts are scaled by a chunk
size (``chunk_size``, or the chunk size of the GGUF inputs, which must then agree) before adding.  Merging only
legacy inputs keeps chunk units.

The result's datasets are the inputs' in order, its chunk count their sum, and it is synthetic when any input is.
``Σx`` (``in_sum``) is kept only when every input holding the tensor has it.

Inputs that record different source models (``source_model_type``, or ``source_digest``: the checkpoint's
identity) are refused, since their sums would mix statistics of different weights; the result keeps the source
provenance the inputs that record one agree on (:func:`common_source`).  Files without provenance (legacy
``.dat``, llama-imatrix's) cannot be checked and are merged as given.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import FormatError, ValidationError
from .model import Entry, Imatrix, make_imatrix
from .provenance import KEY_PREFIX, SOURCE_KEYS

#: Provenance keys whose differing values mean different models, and how a message shows the value.
_MODEL_IDENTITY = {"source_model_type": str, "source_digest": lambda digest: f"source digest {digest[:16]}…"}


def merge_imatrices(inputs: Sequence[Imatrix], *, chunk_size: int | None = None) -> Imatrix:
    if not inputs:
        raise FormatError("nothing to merge: no input imatrix")
    source = common_source(inputs)
    units = {m.counts_unit for m in inputs}
    scale_chunks = len(units) > 1
    if scale_chunks:
        chunk_size = _common_chunk_size(inputs, chunk_size)
    sums: dict[str, Entry] = {}
    has_in_sum: dict[str, bool] = {}
    for imx in inputs:
        factor = np.float32(chunk_size) if scale_chunks and imx.counts_unit == "chunks" else np.float32(1)
        for name, e in imx.entries.items():
            e = Entry(e.in_sum2 * factor, e.counts * factor, None if e.in_sum is None else e.in_sum * factor)
            if name not in sums:
                sums[name], has_in_sum[name] = e, e.in_sum is not None
                continue
            sums[name] = _add(name, sums[name], e, imx)
            has_in_sum[name] = has_in_sum[name] and e.in_sum is not None
    entries = {n: (e if has_in_sum[n] else Entry(e.in_sum2, e.counts, None)) for n, e in sums.items()}
    sizes = {m.chunk_size for m in inputs if m.counts_unit == "tokens"}
    return make_imatrix(
        entries, datasets=[d for m in inputs for d in m.datasets],
        chunk_count=sum(m.chunk_count for m in inputs),
        chunk_size=chunk_size if scale_chunks else (sizes.pop() if len(sizes) == 1 else 0),
        synthetic=any(m.synthetic for m in inputs),
        counts_unit="tokens" if "tokens" in units else "chunks",
        provenance={**source, "merged_from": ",".join(m.sha256 or str(m.path) for m in inputs)})


def common_source(inputs: Sequence[Imatrix]) -> dict[str, str]:
    """The source provenance (:data:`SOURCE_KEYS`) of the inputs that record one, refusing inputs of different
    models; a key they do not all record with one value (a checkpoint's path on two machines, a digest an older
    file lacks) is left out."""
    for key, shown in _MODEL_IDENTITY.items():
        recorded = [(i, m.provenance[key]) for i, m in enumerate(inputs) if m.provenance.get(key)]
        for i, value in recorded[1:]:
            first, first_value = recorded[0]
            if value != first_value:
                raise ValidationError(f"imatrices of different models: {_name(inputs, first)} comes from "
                                      f"{shown(first_value)}, {_name(inputs, i)} from {shown(value)}; merge "
                                      f"imatrices collected on one model", field=KEY_PREFIX + key)
    recording = [m.provenance for m in inputs if any(m.provenance.get(key) for key in SOURCE_KEYS)]
    common = {}
    for key in SOURCE_KEYS:   # kept only when every input that records a source says the same
        values = {p.get(key) for p in recording}
        if len(values) == 1 and None not in values:
            common[key] = values.pop()
    return common


def unchecked_inputs(inputs: Sequence[Imatrix]) -> list[str]:
    """Notes naming the inputs :func:`common_source` could not check: no source model recorded (a legacy
    ``.dat``, another tool's file), or no checkpoint digest while another input has one (an older quantkit's)."""
    notes = []
    bare = [_name(inputs, i) for i, m in enumerate(inputs) if not m.provenance.get("source_model_type")]
    if bare:
        notes.append(f"{', '.join(bare)}: no source model recorded (a legacy .dat or another tool's imatrix): not "
                     f"checked against the other inputs' model")
    if any(m.provenance.get("source_digest") for m in inputs):
        older = [_name(inputs, i) for i, m in enumerate(inputs)
                 if m.provenance.get("source_model_type") and not m.provenance.get("source_digest")]
        if older:
            notes.append(f"{', '.join(older)}: no source digest recorded (an older quantkit's imatrix): only its "
                         f"model type was checked against the other inputs'")
    return notes


def _name(inputs: Sequence[Imatrix], i: int) -> str:
    return str(inputs[i].path) if inputs[i].path is not None else f"input {i + 1}"


def _common_chunk_size(inputs: Sequence[Imatrix], chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size <= 0:
            raise FormatError(f"chunk size must be positive, got {chunk_size}")
        return chunk_size
    sizes = {m.chunk_size for m in inputs if m.counts_unit == "tokens"}
    if len(sizes) != 1 or 0 in sizes:
        raise FormatError(f"merging legacy .dat files (counts in chunks) with GGUF imatrices needs one chunk size; "
                          f"the GGUF inputs declare {sorted(sizes)}: pass the chunk size the .dat was made with")
    return sizes.pop()


def _add(name: str, a: Entry, b: Entry, imx: Imatrix) -> Entry:
    if a.in_sum2.size != b.in_sum2.size:
        raise FormatError(f"{b.n_mat} x {b.n_per_row} sums do not match the earlier inputs' {a.n_mat} x "
                          f"{a.n_per_row}", path=imx.path, tensor=name)
    n_mats = max(a.counts.size, b.counts.size)
    if min(a.counts.size, b.counts.size) not in (1, n_mats):
        raise FormatError(f"{b.counts.size} counts do not match the earlier inputs' {a.counts.size} (mismatched "
                          f"expert counts)", path=imx.path, tensor=name)
    a, b = a.split(n_mats), b.split(n_mats)
    in_sum = a.in_sum + b.in_sum if a.in_sum is not None and b.in_sum is not None else None
    return Entry(a.in_sum2 + b.in_sum2, a.counts + b.counts, in_sum)
