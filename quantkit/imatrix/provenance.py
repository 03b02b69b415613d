"""Provenance of an importance matrix: where it came from, and the guard against shipping synthetic statistics.

Every imatrix quantkit writes carries ``quantkit.imatrix.*`` GGUF keys (all strings, listed in
:data:`PROVENANCE_KEYS`) besides llama.cpp's own ``imatrix.datasets`` / ``imatrix.chunk_count`` /
``imatrix.chunk_size``, and a BOOL ``quantkit.imatrix.synthetic``.

An imatrix is **synthetic** (made from fixture or synthetic data, fine for tests, wrong for a release) when

* its GGUF says so (``quantkit.imatrix.synthetic = true``): quantkit writes that for statistics collected with
  ``--synthetic``, for collections from quantkit's own test/example models (a checkpoint directory holding
  ``quantkit_example.json``), and for anything merged or converted from a synthetic input; or
* a dataset name says so: it starts with :data:`SYNTHETIC_PREFIX` (how quantkit marks a legacy ``.dat``, which has
  no room for keys) or contains the word "synthetic" or "fixture"/"fixtures" as a path or name component.

Files written by llama.cpp's ``llama-imatrix`` are therefore not synthetic unless their dataset names say so.
:func:`require_release_imatrix` is the guard conversions call: it refuses a synthetic imatrix unless explicitly
allowed (``--allow-synthetic-imatrix``).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

from ..errors import ValidationError
from .model import Imatrix

if TYPE_CHECKING:
    from ..convert.source import FileHash

KEY_PREFIX = "quantkit.imatrix."
SYNTHETIC_KEY = KEY_PREFIX + "synthetic"
COUNTS_UNIT_KEY = KEY_PREFIX + "counts_unit"
#: String provenance keys (without the prefix) and what they hold.
PROVENANCE_KEYS = {
    "quantkit_version": "quantkit version that wrote the file",
    "source": "the model the statistics were collected on (path or name)",
    "source_model_type": "its config's model_type",
    "source_digest": "its identity: quantkit.scoring.source.source_digest of its *.safetensors files, the digest "
                     "release manifests and score records carry",
    "source_files": "'<file name>:<SHA-256>' of every file of it that was read (shards, config, tokenizer), "
                    "comma separated",
    "source_sha256": "(older files, read only) SHA-256 of its config.json: not the weights' identity",
    "text_sha256": "SHA-256 of the calibration text file",
    "ctx": "tokens per chunk",
    "all_experts": "'true' when every token was routed to every expert for the statistics",
    "process_output": "'true' when the output head was collected too",
    "dtype": "dtype the model ran in",
    "chunks_done": "(resume states only) chunks accumulated so far",
    "merged_from": "SHA-256s of the files merged into this one",
    "converted_from": "SHA-256 of the file this one was converted from",
}
#: The keys that say which model the statistics come from: a merge keeps those its inputs agree on.
SOURCE_KEYS = ("source", "source_model_type", "source_digest", "source_files", "source_sha256")
SYNTHETIC_PREFIX = "synthetic:"
_SYNTHETIC_WORDS = re.compile(r"(?i)(^|[^a-z])(synthetic|fixtures?)([^a-z]|$)")
#: File that marks quantkit's bundled example / test checkpoints (random, untrained weights).
EXAMPLE_MARKER = "quantkit_example.json"


def source_provenance(hashes: Iterable["FileHash"]) -> dict[str, str]:
    """``source_digest`` and ``source_files`` of a checkpoint from its files' hashes (as convert computes them)."""
    from ..scoring.source import source_digest

    pairs = sorted((h.name, h.sha256) for h in hashes)
    return {"source_digest": source_digest(pairs) or "", "source_files": ",".join(f"{n}:{sha}" for n, sha in pairs)}


def dataset_is_synthetic(name: str) -> bool:
    return name.startswith(SYNTHETIC_PREFIX) or _SYNTHETIC_WORDS.search(name) is not None


def datasets_are_synthetic(datasets: Iterable[str]) -> bool:
    return any(dataset_is_synthetic(d) for d in datasets)


def require_release_imatrix(imatrix: Imatrix, *, allow_synthetic: bool = False) -> None:
    """Refuse an imatrix made from fixture or synthetic data unless ``allow_synthetic``."""
    if imatrix.synthetic and not allow_synthetic:
        shown = ", ".join(repr(d) for d in imatrix.datasets[:3]) or "none recorded"
        raise ValidationError(f"the imatrix was made from synthetic or fixture data (datasets: {shown}); a release "
                              f"needs statistics from real calibration text (pass --allow-synthetic-imatrix to "
                              f"use it anyway)", path=imatrix.path)
