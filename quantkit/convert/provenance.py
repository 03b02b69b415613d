"""Provenance metadata of a converted GGUF: what it was made from, how, and with which calibration.

Keys written (types in brackets):

=========================================  ==================================================================
``general.file_type`` [UINT32]             llama.cpp's ``LlamaFileType`` of the type holding the most weights
                                           among matrices (``MOSTLY_Q4_K_M`` for Q4_K, ``MOSTLY_MXFP4_MOE`` for
                                           MXFP4, ``ALL_F32`` for F32; :func:`file_type`)
``general.quantization_version`` [UINT32]  2 (ggml's ``GGML_QNT_VERSION``)
``quantize.imatrix.file`` [STRING]         the imatrix path as given (the keys llama-quantize writes, same
``quantize.imatrix.dataset`` [STRING]      types: its first dataset, only when it names one;
``quantize.imatrix.entries_count`` [U32]   its number of entries;
``quantize.imatrix.chunks_count`` [U32]    its chunk count, only when positive)
``quantkit.version`` [STRING]              the quantkit package version
``quantkit.recipe.name`` / ``.sha256`` /   the recipe's name, the SHA-256 of its file bytes, the file text itself
``.text`` / ``.tag`` [STRING]              and the file-name tag it implies
``quantkit.source.repo`` [STRING]          the Hugging Face repo id, when the source was given as one
``quantkit.source.revision`` [STRING]      the source's commit, when known (a Hugging Face snapshot)
``quantkit.source.config`` [STRING]        the source ``config.json`` text, verbatim (the runtime rebuilds the
                                           transformers model from it)
``quantkit.source.files`` /                parallel arrays: every file the conversion read (shards, config,
``quantkit.source.sha256`` [ARRAY[STRING]] tokenizer) and its SHA-256
``quantkit.imatrix.sha256`` [STRING]       with an imatrix: its SHA-256, its datasets, chunk count, whether
``quantkit.imatrix.datasets`` [ARRAY[STR]] it is marked synthetic, and its expert
``quantkit.imatrix.chunks`` [UINT32]       coverage line
``quantkit.imatrix.synthetic`` [BOOL]
``quantkit.imatrix.coverage`` [STRING]     (e.g. "observed 14,922 of 15,360 experts (97.15%)")
``quantkit.imatrix.calibration`` [STRING]  over the whole file: ``imatrix``, ``imatrix+bootstrap``,
                                           ``bootstrap`` or ``none`` (:mod:`quantkit.imatrix.bootstrap`'s key)
``quantkit.calibration.<class>`` [STRING]  per tensor class: ``imatrix``, ``bootstrap``, ``imatrix+bootstrap``
                                           (some experts or tensors fell back to bootstrap) or ``none``
``quantkit.imatrix.bootstrap``             tensors that got bootstrap (weight-energy) importance: ``<name>``
[ARRAY[STRING]]                            for a whole tensor, ``<name>:<experts>`` with expert ranges such as
                                           ``0-3,7`` for 3-D (expert) tensors; absent when none did
``quantkit.checkpoint_label`` [STRING]     the ``--label`` given (e.g. ``0731``)
``quantkit.support.kind`` [STRING]         a support (drafter) file only (``convert --support``): ``mtp``
``quantkit.support.checkpoint`` [STRING]   and the checkpoint identity of the target it must be paired with
                                           (:func:`checkpoint_identity`)
=========================================  ==================================================================

A target file records no identity key: its identity is computed from its ``quantkit.source.files`` /
``quantkit.source.sha256`` the same way (every conversion hashes every shard and the config of its checkpoint).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
from gguf.constants import GGUFValueType, LlamaFileType

from .. import __version__
from ..arch.dialects import STASH_PREFIX
from ..formats.registry import GGMLType
from ..imatrix.bootstrap import BOOTSTRAP_KEY, CALIBRATION_KEY, expert_ranges
from ..io.gguf import KV, ArrayOf
from .source import FileHash, ResolvedSource

if TYPE_CHECKING:   # the encoders (numba) are not needed to describe a file: the runtime reads this module
    from .tensors import TensorJob

QUANTIZATION_VERSION = 2
SOURCE_CONFIG_KEY = "quantkit.source.config"
#: K-quant types map to the "_M" mixes llama-quantize names after them; MXFP4 to its MoE mix.
_FILE_TYPE_ALIASES = {GGMLType.F32: LlamaFileType.ALL_F32, GGMLType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
                      GGMLType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M, GGMLType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
                      GGMLType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE}


def _str(value: str) -> KV:
    return KV(value, GGUFValueType.STRING)


def _u32(value: int) -> KV:
    return KV(int(value), GGUFValueType.UINT32)


def file_type(tensors: Iterable[tuple[GGMLType, tuple[int, ...]]]) -> LlamaFileType:
    """The ``LlamaFileType`` of the type holding the most weights among tensors of 2 or more dimensions."""
    weights: dict[GGMLType, int] = {}
    for qtype, shape in tensors:
        if len(shape) >= 2:
            weights[qtype] = weights.get(qtype, 0) + int(np.prod(shape, dtype=np.int64))
    if not weights:
        return LlamaFileType.ALL_F32
    main = max(weights, key=lambda t: (weights[t], -int(t)))
    if main in _FILE_TYPE_ALIASES:
        return _FILE_TYPE_ALIASES[main]
    return LlamaFileType.__members__.get(f"MOSTLY_{main.name}", LlamaFileType.GUESSED)


def _matrices(job: TensorJob) -> int | None:
    """How many matrices (experts) a job's 3-D tensor holds (None: a 2-D tensor)."""
    return int(job.output.shape[0]) if len(job.output.shape) == 3 else None


def bootstrap_entries(jobs: Iterable[TensorJob]) -> list[str]:
    """The ``quantkit.imatrix.bootstrap`` strings: which experts of which tensors got bootstrap importance."""
    entries = []
    for job in jobs:
        count = _matrices(job)
        whole = job.importance == "bootstrap" or None in job.bootstrap
        if job.importance == "none" or not (whole or job.bootstrap):
            continue
        if count is None:
            entries.append(job.name)
        else:
            experts = range(count) if whole else sorted(e for e in job.bootstrap if e is not None)
            entries.append(f"{job.name}:{expert_ranges(list(experts))}")
    return entries


def overall_calibration(jobs: Sequence[TensorJob], with_imatrix: bool) -> str:
    """``imatrix`` (every matrix that takes importance observed), ``imatrix+bootstrap``, ``bootstrap`` or
    ``none`` (no tensor takes importance)."""
    kinds = set(calibration_by_class(jobs).values()) - {"none"}
    if not kinds:
        return "none"
    if not with_imatrix:
        return "bootstrap"
    return "imatrix+bootstrap" if kinds & {"bootstrap", "imatrix+bootstrap"} else "imatrix"


def calibration_by_class(jobs: Iterable[TensorJob]) -> dict[str, str]:
    """Tensor class -> ``imatrix``, ``bootstrap``, ``imatrix+bootstrap`` or ``none``."""
    kinds: dict[str, set[str]] = {}
    for job in jobs:
        seen = kinds.setdefault(job.output.tensor_class, set())
        if job.importance == "bootstrap" or None in job.bootstrap:
            seen.add("bootstrap")
        elif job.importance == "imatrix":
            seen.add("imatrix")
            count = _matrices(job)
            if job.bootstrap:
                seen.add("bootstrap")
                if count is not None and len(job.bootstrap) == count:
                    seen.discard("imatrix")
    out = {}
    for cls, seen in sorted(kinds.items()):
        out[cls] = "+".join(k for k in ("imatrix", "bootstrap") if k in seen) or "none"
    return out


def checkpoint_identity(files: Iterable[tuple[str, str]]) -> str:
    """SHA-256 over the (name, SHA-256) of a checkpoint's weight shards and ``config.json``, sorted by name: the
    same for every conversion of one checkpoint, whatever it writes, and different for another checkpoint."""
    lines = sorted(f"{name}\t{sha}" for name, sha in files if name.endswith(".safetensors") or name == "config.json")
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def provenance_metadata(*, jobs: Sequence[TensorJob], recipe, recipe_tag: str, source: ResolvedSource,
                        file_hashes: Sequence[FileHash], imatrix=None, imatrix_given: str | None = None,
                        label: str | None = None, support: str | None = None) -> list[tuple[str, KV]]:
    """The provenance entries, in the order of the module table."""
    entries: list[tuple[str, KV]] = [
        ("general.file_type", _u32(file_type((j.qtype, j.output.shape) for j in jobs))),
        ("general.quantization_version", _u32(QUANTIZATION_VERSION)),
    ]
    if imatrix is not None:
        entries.append(("quantize.imatrix.file", _str(imatrix_given or "")))
        if imatrix.datasets:
            entries.append(("quantize.imatrix.dataset", _str(imatrix.datasets[0])))
        entries.append(("quantize.imatrix.entries_count", _u32(len(imatrix.entries))))
        if imatrix.chunk_count > 0:
            entries.append(("quantize.imatrix.chunks_count", _u32(imatrix.chunk_count)))
    entries += [
        ("quantkit.version", _str(__version__)),
        ("quantkit.recipe.name", _str(recipe.name)),
        ("quantkit.recipe.sha256", _str(recipe.sha256)),
        ("quantkit.recipe.text", _str(recipe.text)),
        ("quantkit.recipe.tag", _str(recipe_tag)),
    ]
    if source.repo_id is not None:
        entries.append(("quantkit.source.repo", _str(source.repo_id)))
    if source.revision is not None:
        entries.append(("quantkit.source.revision", _str(source.revision)))
    config = source.path / "config.json"
    if config.is_file():
        entries.append((SOURCE_CONFIG_KEY, _str(config.read_text(encoding="utf-8"))))
    if file_hashes:
        entries += [("quantkit.source.files", KV([h.name for h in file_hashes], ArrayOf(GGUFValueType.STRING))),
                    ("quantkit.source.sha256", KV([h.sha256 for h in file_hashes], ArrayOf(GGUFValueType.STRING)))]
    if imatrix is not None:
        entries += [("quantkit.imatrix.sha256", _str(imatrix.sha256)),
                    ("quantkit.imatrix.chunks", _u32(imatrix.chunk_count)),
                    ("quantkit.imatrix.synthetic", KV(bool(imatrix.synthetic), GGUFValueType.BOOL))]
        if imatrix.datasets:
            entries.append(("quantkit.imatrix.datasets", KV(list(imatrix.datasets), ArrayOf(GGUFValueType.STRING))))
        entries.append(("quantkit.imatrix.coverage", _str(str(imatrix.coverage()))))
    entries.append((CALIBRATION_KEY, _str(overall_calibration(jobs, imatrix is not None))))
    for cls, kind in calibration_by_class(jobs).items():
        entries.append((f"quantkit.calibration.{cls}", _str(kind)))
    if boot := bootstrap_entries(jobs):
        entries.append((BOOTSTRAP_KEY, KV(boot, ArrayOf(GGUFValueType.STRING))))
    if label is not None:
        entries.append(("quantkit.checkpoint_label", _str(label)))
    if support is not None:
        entries += [("quantkit.support.kind", _str(support)),
                    ("quantkit.support.checkpoint",
                     _str(checkpoint_identity((h.name, h.sha256) for h in file_hashes)))]
    return entries


def is_provenance_key(key: str) -> bool:
    """Whether ``key`` is one :func:`provenance_metadata` writes (``quantkit.dialect.*`` is a dialect's stash,
    written by the translation, not provenance)."""
    if key.startswith(STASH_PREFIX):
        return False
    return key in ("general.file_type", "general.quantization_version") or key.startswith(("quantize.", "quantkit."))


def merged_metadata(base: Iterable[tuple[str, KV]], extra: Iterable[tuple[str, KV]]) -> list[tuple[str, KV]]:
    """``base`` then ``extra``; a key in both keeps its first position and takes ``extra``'s value."""
    merged: dict[str, KV] = dict(base)
    for key, kv in extra:
        merged[key] = kv
    return list(merged.items())


__all__ = ["QUANTIZATION_VERSION", "bootstrap_entries", "calibration_by_class", "checkpoint_identity", "file_type",
           "is_provenance_key", "merged_metadata", "overall_calibration", "provenance_metadata"]
