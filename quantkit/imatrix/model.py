"""The importance matrix in memory: per-tensor sums of squared inputs and observation counts, as llama.cpp keeps them.

An :class:`Imatrix` maps GGUF weight names (``blk.3.ffn_gate_exps.weight``) to :class:`Entry` values:

``in_sum2``  float32 ``[n_mat, n]``: Σ x² over every input vector ``x`` (length ``n``, the weight's row length)
             that matrix ``m`` of the tensor was multiplied with.  ``n_mat`` is the number of routed experts for a
             stacked expert tensor, else 1.
``counts``   float32 ``[n_mat]``: how many input vectors each matrix saw (tokens, or chunks for legacy files,
             see :attr:`Imatrix.counts_unit`).  A count of 0 means the matrix was never observed.
``in_sum``   optional float32 ``[n_mat, n]``: Σ x (written by some llama.cpp versions; kept, never needed).

The importance of matrix ``m`` is ``in_sum2[m] / counts[m]`` in float32, as llama-quantize computes it; an
unobserved matrix has no importance (:meth:`Imatrix.importance` returns None and the caller falls back to the
weight-energy bootstrap, :mod:`quantkit.imatrix.bootstrap`).

Stored layouts that are not ``[n_mat, n]`` yet: llama-imatrix writes one count for a dense 3-D weight (MLA's
``attn_k_b`` has one matrix per head) and legacy ``.dat`` files keep one count per entry, so a file's entry may be
``[1, n_mat * n]``.  :meth:`Imatrix.conform` reshapes every entry to the layout a model expects after
:meth:`Imatrix.check_against` has checked it.

Grouped weights: llama.cpp multiplies DeepSeek V4's ``attn_output_a`` (one 2-D GGUF matrix) as ``groups`` matrices,
each with its own slice of the input (:class:`quantkit.arch.base.InputGroups`).  Its importance is one vector of the
row length with every group's statistics pooled (quantkit's collector sums them; llama-quantize checks that length);
``llama-imatrix`` stores the groups side by side, ``[1, groups * n]`` with one count of tokens.  ``conform`` with
``groups`` folds that form exactly: ``in_sum2`` summed over the groups (float64, rounded once to float32), counts
multiplied by ``groups`` (added, for a count per group), so ``in_sum2 / count`` is the mean over groups and tokens,
as collected.

Rule for names (``check_against``): ``expected`` lists every tensor of the model that an imatrix may describe
with its ``(n_per_row, n_mats)``; ``required`` (default: all of ``expected``) the tensors that need importance
because they will be encoded with a type that uses it.  A required tensor missing from the imatrix is an error;
a tensor that is not required may be missing; an entry that names no tensor of ``expected`` is an error (the
imatrix belongs to another model); an entry whose length or matrix count differs from the tensor's is an error
whether or not the tensor is required.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..errors import FormatError, ValidationError

#: GGUF names of stacked routed-expert weights: coverage counts their matrices as experts of the block.
EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_[a-z_]*_exps\.weight$")
BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.")
#: Units of ``counts``: input vectors (GGUF files) or chunk calls (legacy ``.dat`` files).
COUNTS_UNITS = ("tokens", "chunks")


@dataclass(frozen=True)
class Entry:
    """Statistics of one weight tensor (see the module docstring)."""

    in_sum2: np.ndarray
    counts: np.ndarray
    in_sum: np.ndarray | None = None

    @property
    def n_mat(self) -> int:
        return int(self.in_sum2.shape[0])

    @property
    def n_per_row(self) -> int:
        return int(self.in_sum2.shape[1])

    @property
    def observed(self) -> np.ndarray:
        """bool ``[n_mat]``: which matrices saw at least one input."""
        return self.counts > 0

    def split(self, n_mats: int) -> "Entry":
        """The same statistics as ``n_mats`` matrices: a single count is shared by every matrix."""
        if n_mats == self.n_mat:
            return self
        total = self.in_sum2.size
        counts = self.counts if self.counts.size == n_mats else np.full(n_mats, self.counts[0], np.float32)
        in_sum = None if self.in_sum is None else self.in_sum.reshape(n_mats, total // n_mats)
        return Entry(self.in_sum2.reshape(n_mats, total // n_mats), counts, in_sum)

    def fold(self, groups: int) -> "Entry":
        """The statistics of ``groups`` input slices of one matrix pooled into one (see the module docstring):
        ``in_sum2`` ``[1, groups * n]`` or ``[groups, n]`` summed over the groups, the counts added (a single count
        is every group's)."""
        n = self.in_sum2.size // groups

        def pooled(a: np.ndarray) -> np.ndarray:
            return a.reshape(groups, n).sum(axis=0, dtype=np.float64).astype(np.float32).reshape(1, n)

        counts = self.counts.astype(np.float64)
        total = counts.sum() * (groups if counts.size == 1 else 1)
        return Entry(pooled(self.in_sum2), np.array([total], np.float32),
                     None if self.in_sum is None else pooled(self.in_sum))


def check_entry(name: str, entry: Entry, **where) -> Entry:
    """Validate one entry's shapes and values; return it with float32 C-contiguous arrays."""
    where = {"tensor": name, **where}
    in_sum2 = np.ascontiguousarray(entry.in_sum2, dtype=np.float32)
    counts = np.ascontiguousarray(entry.counts, dtype=np.float32).reshape(-1)
    if in_sum2.ndim != 2 or in_sum2.shape[0] < 1 or in_sum2.shape[1] < 1:
        raise FormatError(f"in_sum2 must be a non-empty [n_mat, n] array, found shape {in_sum2.shape}", **where)
    if counts.size != in_sum2.shape[0]:
        raise FormatError(f"{counts.size} counts for {in_sum2.shape[0]} matrices of in_sum2 (mismatched expert "
                          f"counts)", **where)
    _check_values(in_sum2, "in_sum2", where, non_negative=True)
    _check_values(counts, "counts", where, non_negative=True)
    unobserved_with_data = (counts == 0) & (in_sum2 != 0).any(axis=1)
    if unobserved_with_data.any():
        m = int(np.argmax(unobserved_with_data))
        raise FormatError(f"matrix {m} has count 0 but non-zero sums", **where)
    in_sum = entry.in_sum
    if in_sum is not None:
        in_sum = np.ascontiguousarray(in_sum, dtype=np.float32).reshape(in_sum2.shape) \
            if np.size(in_sum) == in_sum2.size else None
        if in_sum is None:
            raise FormatError(f"in_sum has {np.size(entry.in_sum)} values, in_sum2 {in_sum2.size}", **where)
        _check_values(in_sum, "in_sum", where, non_negative=False)
    return Entry(in_sum2, counts, in_sum)


def _check_values(a: np.ndarray, what: str, where: dict, non_negative: bool) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        at = np.unravel_index(int(np.argmax(bad)), a.shape)
        raise FormatError(f"{what} holds a non-finite value {a[at]} at {tuple(int(i) for i in at)}", **where)
    if non_negative and (a < 0).any():
        at = np.unravel_index(int(np.argmax(a < 0)), a.shape)
        raise FormatError(f"{what} holds a negative value {a[at]} at {tuple(int(i) for i in at)}", **where)


@dataclass(frozen=True)
class TensorCoverage:
    name: str
    layer: int | None
    observed: int
    total: int
    expert: bool
    """A stacked routed-expert tensor (its matrices are experts)."""


@dataclass(frozen=True)
class Coverage:
    """Which matrices were observed: per tensor, routed experts per layer, and in total."""

    tensors: tuple[TensorCoverage, ...]
    layers: Mapping[int, tuple[int, int]]
    """Block index -> (experts observed, experts) over the block's routed-expert tensors."""
    observed: int
    total: int
    """Routed experts observed / present, summed over blocks."""

    @property
    def unobserved_tensors(self) -> list[str]:
        """Tensors with no observed matrix at all."""
        return [t.name for t in self.tensors if t.observed == 0]

    @property
    def fraction(self) -> float:
        return self.observed / self.total if self.total else 1.0

    def __str__(self) -> str:
        if self.total:
            return f"observed {self.observed:,} of {self.total:,} experts ({100.0 * self.fraction:.2f}%)"
        seen = sum(1 for t in self.tensors if t.observed)
        return f"no routed experts; observed {seen:,} of {len(self.tensors):,} tensors"


@dataclass
class Imatrix:
    """An importance matrix (see the module docstring).  Build it with :func:`make_imatrix` (checks values) or
    read it with :func:`quantkit.imatrix.load_imatrix`."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    synthetic: bool = False
    """Made from fixture or synthetic data: not for releases (see :mod:`quantkit.imatrix.provenance`)."""
    counts_unit: str = "tokens"
    path: Path | None = None
    sha256: str | None = None
    """SHA-256 of the file it was read from."""
    provenance: dict[str, str] = field(default_factory=dict)
    """quantkit's own provenance keys (``quantkit.imatrix.*`` without the prefix), as strings."""

    # -- lookups -------------------------------------------------------------------------------------------------

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise ValidationError(f"no imatrix entry for this tensor ({len(self.entries)} entries)",
                                  path=self.path, tensor=name) from None

    def importance(self, name: str, expert: int | None = None) -> np.ndarray | None:
        """float32 ``in_sum2/count`` of one matrix (``expert`` for a stacked tensor), or None when the tensor has no
        entry or that matrix was never observed."""
        e = self.entries.get(name)
        if e is None:
            return None
        m = 0 if expert is None else int(expert)
        if expert is None and e.n_mat != 1:
            raise ValidationError(f"entry has {e.n_mat} matrices; pass expert=", path=self.path, tensor=name)
        if not 0 <= m < e.n_mat:
            raise ValidationError(f"expert {m} is outside the entry's {e.n_mat} matrices", path=self.path,
                                  tensor=name)
        count = e.counts[m]
        if count <= 0:
            return None
        return e.in_sum2[m] / count

    # -- coverage ------------------------------------------------------------------------------------------------

    def coverage(self) -> Coverage:
        tensors = []
        per_layer_experts: dict[int, np.ndarray] = {}
        for name in sorted(self.entries):
            e = self.entries[name]
            block = BLOCK_TENSOR.match(name)
            expert = EXPERT_TENSOR.match(name) is not None and e.n_mat > 1
            layer = int(block["layer"]) if block else None
            tensors.append(TensorCoverage(name, layer, int(e.observed.sum()), e.n_mat, expert))
            if expert:
                seen = per_layer_experts.get(layer)
                # an expert counts as observed when every expert tensor of its block saw it
                per_layer_experts[layer] = e.observed if seen is None or seen.size != e.n_mat else seen & e.observed
        layers = {layer: (int(seen.sum()), int(seen.size)) for layer, seen in sorted(per_layer_experts.items())}
        return Coverage(tuple(tensors), layers, sum(o for o, _ in layers.values()),
                        sum(t for _, t in layers.values()))

    # -- checks against a model -----------------------------------------------------------------------------------

    def check_against(self, expected: Mapping[str, tuple[int, int]], *, required: Iterable[str] | None = None,
                      groups: Mapping[str, int] | None = None) -> None:
        """Raise :class:`ValidationError` naming the first mismatch with a model (rules in the module docstring).

        ``expected``: GGUF name -> ``(n_per_row, n_mats)`` for every tensor an imatrix may describe; ``groups``:
        GGUF name -> input groups of a grouped weight, whose entry may also be stored per group.
        """
        groups = groups or {}
        required = set(expected) if required is None else set(required)
        for name in sorted(required - set(expected)):
            raise ValidationError("listed as required but not among the expected tensors", tensor=name)
        for name in sorted(self.entries):
            if name not in expected:
                raise ValidationError(f"imatrix entry names no tensor of the model ({len(expected)} tensors "
                                      f"expected): an imatrix of another model?", path=self.path, tensor=name)
            self._check_shape(name, *expected[name], groups.get(name, 1))
        for name in sorted(required):
            if name not in self.entries:
                raise ValidationError("tensor needs importance but the imatrix has no entry for it",
                                      path=self.path, tensor=name)

    def _check_shape(self, name: str, n_per_row: int, n_mats: int, groups: int = 1) -> None:
        e = self.entries[name]
        if groups > 1 and _stored_per_group(e, n_per_row, n_mats, groups):
            return
        if e.in_sum2.size != n_per_row * n_mats:
            per_group = (f", or {groups} x {n_per_row} with its {groups} input groups side by side as llama-imatrix "
                         f"writes it" if groups > 1 else "")
            raise ValidationError(f"imatrix entry has {e.n_mat} x {e.n_per_row} values, the model's tensor needs "
                                  f"{n_mats} x {n_per_row} (matrices x row length{per_group}): an imatrix of "
                                  f"another model?", path=self.path, tensor=name)
        if e.counts.size not in (1, n_mats):
            raise ValidationError(f"imatrix entry has {e.counts.size} counts, the model's tensor has {n_mats} "
                                  f"matrices (mismatched expert counts)", path=self.path, tensor=name)

    def conform(self, expected: Mapping[str, tuple[int, int]], *, required: Iterable[str] | None = None,
                groups: Mapping[str, int] | None = None) -> "Imatrix":
        """:meth:`check_against`, then a copy whose entries are ``[n_mats, n_per_row]`` with one count per matrix;
        an entry of a grouped weight (``groups``) stored per group is folded (see the module docstring).

        Legacy files store an unobserved expert as importance 1.0 exactly (llama-imatrix writes ``1 * ncall``);
        after splitting, such matrices get count 0 again so they are reported and bootstrapped.
        """
        groups = groups or {}
        self.check_against(expected, required=required, groups=groups)
        entries = {}
        for name, e in self.entries.items():
            n_per_row, n_mats = expected[name]
            n_groups = groups.get(name, 1)
            if n_groups > 1 and _stored_per_group(e, n_per_row, n_mats, n_groups):
                e = e.fold(n_groups)
            split = e.split(n_mats)
            if self.counts_unit == "chunks" and n_mats > 1:
                split = _legacy_unobserved(split)
            entries[name] = split
        return replace(self, entries=entries)


def _stored_per_group(e: Entry, n_per_row: int, n_mats: int, groups: int) -> bool:
    """The entry of a grouped 2-D weight holds each input group's sums (one count, or one per group)."""
    return n_mats == 1 and e.in_sum2.size == groups * n_per_row and e.counts.size in (1, groups)


def _legacy_unobserved(e: Entry) -> Entry:
    placeholder = (e.in_sum2 == e.counts[:, None]).all(axis=1) & (e.counts > 0)
    if not placeholder.any():
        return e
    in_sum2, counts = e.in_sum2.copy(), e.counts.copy()
    in_sum2[placeholder] = 0
    counts[placeholder] = 0
    return Entry(in_sum2, counts, None)


def make_imatrix(entries: Mapping[str, Entry], *, datasets: Iterable[str] = (), chunk_count: int = 0,
                 chunk_size: int = 0, synthetic: bool = False, counts_unit: str = "tokens",
                 provenance: Mapping[str, str] | None = None, path: Path | None = None,
                 sha256: str | None = None) -> Imatrix:
    """An :class:`Imatrix` from entries, every value checked (see :func:`check_entry`)."""
    if counts_unit not in COUNTS_UNITS:
        raise FormatError(f"counts unit {counts_unit!r} is not one of {COUNTS_UNITS}", path=path)
    if not entries:
        raise FormatError("an imatrix needs at least one entry", path=path)
    checked = {name: check_entry(name, e, path=path) for name, e in entries.items()}
    if not any(e.observed.any() for e in checked.values()):
        raise FormatError(f"every count of all {len(checked)} entries is zero: the imatrix observed nothing",
                          path=path)
    for what, value in (("chunk_count", chunk_count), ("chunk_size", chunk_size)):
        if not 0 <= int(value) < 2**32:
            raise FormatError(f"{what} {value} is outside 0..2^32-1", path=path, field=what)
    return Imatrix(checked, list(datasets), int(chunk_count), int(chunk_size), bool(synthetic), counts_unit,
                   path, sha256, dict(provenance or {}))
