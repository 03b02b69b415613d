"""Carrying input statistics from Hugging Face tensors to GGUF tensors through the architecture maps.

Importance belongs to a weight's *input columns*.  A transform step of :mod:`quantkit.arch.transforms` either keeps
the columns (a slice or permutation of rows: the statistics pass unchanged), permutes them (the statistics are
permuted the same way), or changes what a column is (MLA's ``kv_b`` split: the GGUF tensors multiply other
vectors than the source did, so their statistics must be collected on those vectors, see
:mod:`quantkit.imatrix.collect`).  :func:`column_map` tells which, per mapping.

:func:`to_gguf_names` renames an imatrix keyed by Hugging Face names (per-expert names are gathered into stacked
entries, experts absent from it count as unobserved).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..arch import ARCHITECTURES, ArchMap, TensorMapping
from ..arch import transforms
from ..errors import FormatError, ValidationError
from .model import Entry, Imatrix, make_imatrix

#: Steps that only select or reorder rows: a weight's columns, and so its statistics, are unchanged.
ROW_STEPS = frozenset({"gate_half", "up_half", "gdn_qkv_v_order", "gdn_rows_v_order", "gdn_heads_order", "indexer_q",
                       "indexer_k"})
#: Steps that reorder columns: the statistics are reordered by the same step.
COLUMN_STEPS = frozenset({"gdn_cols_v_order"})
#: GGUF names outside blocks that still take importance.
OUTPUT_HEAD = "output.weight"


def column_map(mapping: TensorMapping, n: int, hp) -> np.ndarray | None:
    """Source column of each GGUF column for ``mapping`` (length ``n``), or None when the transform changes what a
    column is (the statistics cannot be carried over)."""
    order = np.arange(n)
    for step in mapping.transform:
        if step in COLUMN_STEPS:
            order = transforms.apply((step,), order[None, :].astype(np.float32), hp)[0].astype(np.int64)
        elif step not in ROW_STEPS:
            return None
    return order


def is_gguf_name(name: str) -> bool:
    return name.startswith("blk.") or name == OUTPUT_HEAD


def to_gguf_names(imatrix: Imatrix, amap: ArchMap) -> Imatrix:
    """A copy of ``imatrix`` with Hugging Face entry names resolved to GGUF names (GGUF names are kept)."""
    out: dict[str, Entry] = {}
    stacked: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, e in imatrix.entries.items():
        if is_gguf_name(name):
            _put(out, name, e, imatrix)
            continue
        for m in amap.resolve(name):
            if m.gguf_name is None or m.role != "weight":
                raise ValidationError(f"resolves to no GGUF weight ({m.dropped or m.role})", path=imatrix.path,
                                      tensor=name)
            order = column_map(m, e.n_per_row, amap.hp)
            if order is None:
                raise ValidationError(f"its transform {m.transform} changes the columns of {m.gguf_name!r}: the "
                                      f"statistics must be collected on the GGUF tensor's own inputs",
                                      path=imatrix.path, tensor=name)
            moved = Entry(e.in_sum2[:, order], e.counts, None if e.in_sum is None else e.in_sum[:, order])
            if m.expert is None:
                _put(out, m.gguf_name, moved, imatrix)
                continue
            if moved.n_mat != 1:
                raise ValidationError(f"a per-expert tensor's entry must hold one matrix, found {moved.n_mat}",
                                      path=imatrix.path, tensor=name)
            sums, counts = stacked.setdefault(
                m.gguf_name, (np.zeros((amap.expert_count, moved.n_per_row), np.float32),
                              np.zeros(amap.expert_count, np.float32)))
            if sums.shape[1] != moved.n_per_row or counts[m.expert]:
                raise ValidationError(f"expert {m.expert} of {m.gguf_name!r} given twice or with another row length",
                                      path=imatrix.path, tensor=name)
            sums[m.expert], counts[m.expert] = moved.in_sum2[0], moved.counts[0]
    for gguf_name, (sums, counts) in stacked.items():
        _put(out, gguf_name, Entry(sums, counts), imatrix)
    return make_imatrix(out, datasets=imatrix.datasets, chunk_count=imatrix.chunk_count,
                        chunk_size=imatrix.chunk_size, synthetic=imatrix.synthetic, counts_unit=imatrix.counts_unit,
                        provenance=imatrix.provenance, path=imatrix.path, sha256=imatrix.sha256)


def _put(out: dict[str, Entry], name: str, e: Entry, imatrix: Imatrix) -> None:
    if name in out:
        raise ValidationError("two imatrix entries map to this GGUF tensor", path=imatrix.path, tensor=name)
    out[name] = e


def expected_entries(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """``(n_per_row, n_mats)`` of every tensor an imatrix may describe, from GGUF tensor shapes (numpy order):
    weights of two or more dimensions in blocks, and the output head.  A 3-D ``[n_mats, rows, n]`` tensor holds
    ``n_mats`` matrices (routed experts, or MLA's per-head ``attn_k_b``/``attn_v_b``)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) >= 2 and is_gguf_name(name):
            out[name] = (int(shape[-1]), int(np.prod(shape[:-2], dtype=np.int64)))
    return out


def gguf_input_groups(metadata: Mapping, names: Iterable[str], path: Path | None = None) -> dict[str, int]:
    """Input groups of a GGUF model's grouped weights (:class:`quantkit.arch.base.InputGroups`) from its metadata,
    for :meth:`Imatrix.conform`; none for an architecture quantkit does not map."""
    arch_kv = metadata.get("general.architecture")
    arch = next((a for a in ARCHITECTURES.values() if arch_kv is not None and a.gguf_arch == arch_kv.value), None)
    if arch is None:
        return {}

    def count(declared) -> int:
        key = declared.gguf_key.format(arch=arch.gguf_arch)
        kv = metadata.get(key)
        value = None if kv is None else kv.value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FormatError(f"must be a positive integer (input groups of {declared.gguf}), found {value!r}",
                              path=path, field=key)
        return value

    return arch.group_counts(list(names), count)
