"""Where a conversion's source lives, which revision it is, and the SHA-256 of every file it reads.

``SOURCE`` is a local checkpoint directory (or ``.safetensors`` file), or a Hugging Face repo id
``owner/name[@revision]``.  A repo id is resolved with ``huggingface_hub.snapshot_download``: it downloads what is
missing when online and falls back to the local cache when offline (``HF_HUB_OFFLINE=1`` forces the cache).  The
revision is the snapshot's commit hash, also for a local path that lies inside a Hugging Face cache
(``.../snapshots/<commit>/``); for any other local path it is unknown.

Provenance files (:func:`provenance_files`): the safetensors shards the checkpoint reads, plus the top-level
configuration and tokenizer files (:data:`PROVENANCE_PATTERNS`), less the JSON files quantkit itself writes
(release and transport manifests, reports, score records, swapset manifests: :func:`written_by_quantkit`), so
that an output written into the checkpoint's directory does not change the identity of the next conversion or
fail a validation.  Their SHA-256 is read from the Hugging Face
cache when the file is a link to a blob named by its SHA-256 (the hub names large (LFS) blobs by the SHA-256 of
their content and checks it on download); every other file is hashed, in ``jobs`` background threads
(:class:`Hashing`; hashlib releases the GIL on large buffers) while the conversion encodes.  These are the only
hashes of the source a conversion computes: its journal records them (:mod:`quantkit.convert.journal`), and a
resumed conversion hashes every file again and compares before it keeps any tensor (an equal size and mtime do not
prove equal bytes), besides putting them in the header.
"""
from __future__ import annotations

import fnmatch
import os
import re
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..errors import MissingSourceError, SourceError
from ..io.atomic import sha256_file
from ..io import jsontext

#: Top-level non-weight files whose hashes are recorded (configs, tokenizer, chat template).
PROVENANCE_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "*.jinja", "vocab.txt", "merges.txt")
#: What ``snapshot_download`` fetches for a conversion: weights plus the provenance files.
DOWNLOAD_PATTERNS = ("*.safetensors", *PROVENANCE_PATTERNS)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: The top-level marks of the JSON files quantkit writes ("format": "quantkit-release", -validation, -transport,
#: -convert-report, -score-sidecar ...; swapset manifests: "schema": "quantkit.swapset"), and the largest file
#: searched for them (quantkit's own are far smaller: a larger JSON file is the model's).
_QUANTKIT_MARKS = (b'"quantkit-', b'"quantkit.')
_LARGEST_QUANTKIT_JSON = 64 << 20


@dataclass(frozen=True)
class ResolvedSource:
    """A source on local disk: ``path`` and what is known of where it came from."""

    path: Path
    given: str
    repo_id: str | None = None
    revision: str | None = None


@dataclass(frozen=True)
class FileHash:
    name: str
    size: int
    mtime_ns: int
    sha256: str


def _cache_revision(path: Path) -> str | None:
    """The commit of a path inside a Hugging Face cache snapshot (``.../snapshots/<commit>/...``)."""
    for part in (path, *path.parents):
        if part.parent.name == "snapshots" and _COMMIT.match(part.name):
            return part.name
    return None


def resolve_source(source: str | os.PathLike) -> ResolvedSource:
    """A local path as it is, or a Hugging Face repo id through ``snapshot_download``."""
    given = str(source)
    path = Path(given).expanduser()
    if path.exists():
        resolved = path.resolve()
        return ResolvedSource(resolved, given, revision=_cache_revision(resolved))
    if not _REPO_ID.match(given):
        raise MissingSourceError("no such checkpoint directory or file, and not a Hugging Face repo id "
                                 "(owner/name[@revision])", path=given)
    repo_id, _, revision = given.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        local = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(DOWNLOAD_PATTERNS)))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as exc:
        message = " ".join(str(exc).split())
        raise MissingSourceError(f"cannot resolve Hugging Face repo {repo_id!r}"
                                 f"{f' at {revision!r}' if revision else ''}: {message}", path=given) from None
    return ResolvedSource(local, given, repo_id=repo_id, revision=_cache_revision(local.resolve()))


def provenance_files(source: ResolvedSource, shard_paths: Iterable[Path]) -> list[Path]:
    """The files whose hashes a conversion records: the shards read, and the top-level config/tokenizer files."""
    files = {Path(p) for p in shard_paths}
    if source.path.is_dir():
        for entry in source.path.iterdir():
            if entry.is_file() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in PROVENANCE_PATTERNS) \
                    and not written_by_quantkit(entry):
                files.add(entry)
    return sorted(files, key=lambda p: p.name)


def written_by_quantkit(path: Path) -> bool:
    """Whether ``path`` is a JSON object quantkit wrote: its top-level ``format`` starts with ``quantkit-`` or its
    ``schema`` with ``quantkit.`` (the bytes are searched first, so a model's own JSON files are rarely parsed)."""
    if path.suffix != ".json":
        return False
    try:
        if path.stat().st_size > _LARGEST_QUANTKIT_JSON:
            return False
        data = path.read_bytes()
        if not any(mark in data for mark in _QUANTKIT_MARKS):
            return False
        record = jsontext.loads(data)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and (str(record.get("format", "")).startswith("quantkit-")
                                         or str(record.get("schema", "")).startswith("quantkit."))


def _blob_sha256(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache names a blob by, when ``path`` links to one."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    return target.name if target.parent.name == "blobs" and _SHA256.match(target.name) else None


def file_stats(paths: list[Path]) -> list[FileHash]:
    """Name, size and mtime of each file (``sha256`` left empty): who the source is before it is hashed."""
    names = [p.name for p in paths]
    if len(set(names)) != len(names):
        raise SourceError(f"two provenance files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    stats = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise MissingSourceError("source file disappeared", path=path) from None
        stats.append(FileHash(path.name, st.st_size, st.st_mtime_ns, ""))
    return stats


class Hashing:
    """SHA-256 of files computed in background threads (one file per thread at a time).

    ``stats`` (:func:`file_stats`) are what the files were when the conversion planned; a file whose size or mtime
    differs when its hash is finished is an error (the source changed under the conversion).
    """

    def __init__(self, paths: list[Path], stats: list[FileHash], *, jobs: int = 1):
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="quantkit-hash")
        self._futures = [self._pool.submit(self._one, path, stat) for path, stat in zip(paths, stats)]

    def _go_on(self, _read: int) -> None:
        if self._stopped.is_set():   # a run that fails early does not wait for whole shards to be hashed
            raise CancelledError()

    def _one(self, path: Path, stat: FileHash) -> FileHash:
        digest = _blob_sha256(path) or sha256_file(path, progress=self._go_on)
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) != (stat.size, stat.mtime_ns):
            raise SourceError("source file changed while the conversion was running", path=path)
        return FileHash(stat.name, stat.size, stat.mtime_ns, digest)

    def done(self) -> bool:
        """Whether every hash is known (or failed: :meth:`result` raises that failure), without waiting."""
        return all(f.done() for f in self._futures)

    def result(self) -> list[FileHash]:
        """Wait for every hash (in the order of ``paths``)."""
        try:
            return [f.result() for f in self._futures]
        finally:
            self._pool.shutdown(wait=False)

    def cancel(self) -> None:
        """Drop the files not started and stop those being hashed (at their next chunk)."""
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def hash_files(paths: list[Path], *, jobs: int = 1) -> list[FileHash]:
    """SHA-256 of each file (in ``paths`` order)."""
    return Hashing(paths, file_stats(paths), jobs=jobs).result()
