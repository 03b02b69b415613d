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
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import FormatError
from .model import Entry, Imatrix, make_imatrix


def merge_imatrices(inputs: Sequence[Imatrix], *, chunk_size: int | None = None) -> Imatrix:
    if not inputs:
        raise FormatError("nothing to merge: no input imatrix")
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
        provenance={"merged_from": ",".join(m.sha256 or str(m.path) for m in inputs)})


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
