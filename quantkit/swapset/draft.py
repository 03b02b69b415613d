"""Draft lm-head sidecars: the kept vocabulary and the agreement of the draft head with the source head.

The draft head is an extra lm_head for the MTP drafter, stored as ``draft.<head module>.*`` (the head's
encoding) plus ``draft.<head module>.token_ids`` (I32 [K], sorted ascending): row i of the draft head is the
source head's row ``token_ids[i]``.  Without a subset every row is kept and no ``token_ids`` tensor is stored.

Kept rows (:func:`kept_rows`): K is the requested count rounded **up** to a multiple of :data:`ROW_BLOCK`
(NVFP4 swizzled scale layouts tile 128 rows), capped at the head's row count.

- ``--vocab-subset N``: the K most frequent token ids of the calibration text (count descending, then id
  ascending), so the ranking is total and reproducible;
- ``--token-ids FILE``: exactly the listed ids (whitespace-separated decimal integers, no duplicates), padded to
  K with the most frequent remaining ids (by the calibration counts when given, else by id ascending).

Agreement (:func:`agreement`), on hidden states h (the head's inputs at every position of sample text):
source logits h W^T over the full vocabulary, draft logits h D^T over the kept ids; ``top1`` is the fraction of
positions where the draft's argmax token equals the source's, ``top5`` where the source's argmax token is among
the draft's five best, ``coverage`` where the source's argmax token is kept at all (the ceiling of both).  Ties
go to the lowest index (numpy's argmax / stable sort).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import SourceError

DRAFT_PREFIX = "draft."
TOKEN_IDS_SUFFIX = "token_ids"
ROW_BLOCK = 128
TOP_K = 5
#: Positions per logits product in :func:`agreement` (bounds memory at CHUNK x vocabulary floats).
AGREEMENT_CHUNK = 256
#: Largest token-id file read.
MAX_TOKEN_FILE_BYTES = 64 << 20


def round_rows(count: int, rows: int) -> int:
    """``count`` rounded up to a multiple of :data:`ROW_BLOCK`, capped at ``rows``."""
    return min(-(-count // ROW_BLOCK) * ROW_BLOCK, rows)


def token_counts(ids, rows: int, what: str) -> np.ndarray:
    """Occurrences of each token id in ``ids`` (int64 [rows]); an id outside the head is an error."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        bad = int(ids[(ids < 0) | (ids >= rows)][0])
        raise SourceError(f"{what}: token id {bad} is outside the head's {rows} rows")
    return np.bincount(ids, minlength=rows)


def ranking(counts: np.ndarray | None, rows: int) -> np.ndarray:
    """Token ids by count descending, then id ascending (id order without counts)."""
    if counts is None:
        return np.arange(rows)
    return np.lexsort((np.arange(rows), -counts))


def read_token_ids(path: str | os.PathLike) -> list[int]:
    """Decimal token ids separated by whitespace."""
    path = Path(path)
    if path.stat().st_size > MAX_TOKEN_FILE_BYTES:
        raise SourceError(f"token-id file is over {MAX_TOKEN_FILE_BYTES} bytes", path=path)
    ids = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for word in line.split():
            if not word.isdigit():
                raise SourceError(f"line {line_no}: {word!r} is not a non-negative decimal token id", path=path)
            ids.append(int(word))
    if not ids:
        raise SourceError("token-id file lists no ids", path=path)
    return ids


def kept_rows(rows: int, *, subset: int | None = None, token_ids: list[int] | None = None,
              counts: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """(kept ids int32 sorted, selection description); see the module docstring."""
    order = ranking(counts, rows)
    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
        token_counts(ids, rows, "--token-ids")
        unique, seen = np.unique(ids, return_counts=True)
        if (seen > 1).any():
            raise SourceError(f"--token-ids lists token {int(unique[seen > 1][0])} more than once")
        target = round_rows(len(ids), rows)
        padding = order[~np.isin(order, ids)][: target - len(ids)]
        kept = np.concatenate([ids, padding])
        selection = f"token-ids file ({len(ids)} ids) padded by {'frequency' if counts is not None else 'id'}"
    elif subset is not None:
        if subset <= 0:
            raise SourceError(f"--vocab-subset must be positive, got {subset}")
        if counts is None:
            raise SourceError("--vocab-subset ranks tokens by frequency: it needs --calibration text")
        kept = order[: round_rows(subset, rows)]
        selection = f"top {len(kept)} by frequency (requested {subset})"
    else:
        return np.arange(rows, dtype=np.int32), "full vocabulary"
    return np.sort(kept).astype(np.int32), selection


def agreement(hidden: np.ndarray, source_head: np.ndarray, draft_head: np.ndarray, kept: np.ndarray) -> dict:
    """Top-1 / top-5 agreement and coverage of a draft head with the source head (see the module docstring)."""
    hidden = np.asarray(hidden, dtype=np.float32)
    kept = np.asarray(kept, dtype=np.int64)
    k = min(TOP_K, len(kept))
    top1 = top5 = covered = 0
    for start in range(0, hidden.shape[0], AGREEMENT_CHUNK):
        h = hidden[start:start + AGREEMENT_CHUNK]
        source_best = np.argmax(h @ source_head.T, axis=1)
        draft_logits = h @ draft_head.T
        draft_best = kept[np.argmax(draft_logits, axis=1)]
        draft_top = kept[np.argsort(-draft_logits, axis=1, kind="stable")[:, :k]]
        top1 += int((draft_best == source_best).sum())
        top5 += int((draft_top == source_best[:, None]).any(axis=1).sum())
        covered += int(np.isin(source_best, kept).sum())
    positions = int(hidden.shape[0])
    return {"positions": positions, "top1": top1 / positions if positions else None,
            "top5": top5 / positions if positions else None, "coverage": covered / positions if positions else None}
