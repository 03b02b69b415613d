"""Evidence records: what produced a result, on what, with what (one definition for score tables, validation
reports and conversion reports).

:func:`evidence` returns a JSON-ready dict (format :data:`EVIDENCE_FORMAT`, version :data:`EVIDENCE_VERSION`)::

    {"format": "quantkit-evidence", "version": 1,
     "tools": {"quantkit": v, "python": v, "numpy": v, "torch": v, "transformers": v},   torch/transformers only
                                                                                         when the process loaded them
     "platform": "Linux-…-x86_64", "device": str | null, "dtype": str | null,
     "threads": int, "threads_from": "caller" | "torch" | "numba" | "cpu affinity",
     "artifact": {"path", "kind": "file", "size", "sha256", "sha256_from"}
               | {"path", "kind": "directory", "size" (its files' bytes), "sha256": null, "source_digest"} | null,
     "fixture": {"content_sha256", "label", "cases", "path"} | null,
     "command": [argv...]}

The artifact's SHA-256 (``sha256_from`` says which applied, in this order):

``given``         the caller already had it (``convert`` hashes its output while writing it);
``<FILE>.sha256`` a ``sha256sum``-style line ``<hex>  <name>`` beside the file, naming it, and modified no earlier
                  than the file (an older one may describe an earlier version of the file: it is not used);
``cache``         quantkit's hash cache (:data:`CACHE_ENV`, default ``~/.cache/quantkit/sha256``): one small
                  file per artifact, keyed by its real path and valid only while device, inode, size and
                  modification time (ns) are unchanged, so a 500 GB artifact scored and validated is read once;
``computed``      the file read in :data:`~quantkit.io.atomic.HASH_CHUNK_BYTES` pieces (memory bounded), with a
                  tqdm bar on stderr for files of :data:`PROGRESS_MIN_BYTES` or more; the result goes to the cache
                  (a cache that cannot be written is skipped: it only saves time).

A directory artifact (a safetensors checkpoint) is not hashed again: its identity is the source digest of its
shards' hashes (:func:`quantkit.scoring.source.source_digest`), passed by the caller.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence
from .io import jsontext

EVIDENCE_FORMAT = "quantkit-evidence"
EVIDENCE_VERSION = 1
#: Environment variable naming the hash cache directory.
CACHE_ENV = "QUANTKIT_HASH_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/quantkit/sha256")
#: Files at least this large show a progress bar while hashed.
PROGRESS_MIN_BYTES = 256 << 20
#: Modules whose versions are recorded only when the process has loaded them (importing torch costs seconds).
LOADED_ONLY = ("torch", "transformers")
#: Largest ``.sha256`` sidecar or cache entry read.
MAX_RECORD_BYTES = 4096
_SHA256SUM_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def _versions() -> dict[str, str]:
    import numpy

    from . import __version__

    tools = {"quantkit": __version__, "python": platform.python_version(), "numpy": numpy.__version__}
    for name in LOADED_ONLY:
        module = sys.modules.get(name)
        if module is not None:
            tools[name] = getattr(module, "__version__", "unknown")
    return tools


def _threads() -> tuple[int, str]:
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads()), "torch"
    numba = sys.modules.get("numba")
    if numba is not None:
        return int(numba.get_num_threads()), "numba"
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, "cpu affinity"


def _small_text(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def recorded_sidecar_hash(path: Path, st: os.stat_result) -> str | None:
    """The hash a ``<FILE>.sha256`` beside ``path`` records for it, when usable (module doc)."""
    sidecar = path.with_name(path.name + ".sha256")
    text = _small_text(sidecar)
    if text is None:
        return None
    try:
        if sidecar.stat().st_mtime_ns < st.st_mtime_ns:
            return None
    except OSError:
        return None
    for line in text.splitlines():
        match = _SHA256SUM_LINE.match(line.strip())
        if match and Path(match.group(2)).name == path.name:
            return match.group(1).lower()
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def _cache_key(real: Path, st: os.stat_result) -> tuple[Path, dict[str, Any]]:
    entry = _cache_dir() / (hashlib.sha256(str(real).encode()).hexdigest() + ".json")
    return entry, {"path": str(real), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
                   "mtime_ns": st.st_mtime_ns}


def cached_hash(real: Path, st: os.stat_result) -> str | None:
    entry, key = _cache_key(real, st)
    text = _small_text(entry)
    try:
        record = jsontext.loads(text) if text is not None else None
    except ValueError:
        return None
    if not isinstance(record, dict) or {k: record.get(k) for k in key} != key:
        return None
    sha = record.get("sha256")
    return sha if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) else None


def _store_cached_hash(real: Path, st: os.stat_result, sha256: str) -> None:
    from .io.atomic import atomic_output

    entry, key = _cache_key(real, st)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(entry, overwrite=True) as tmp:
            tmp.write_text(json.dumps(key | {"sha256": sha256}) + "\n")
    except OSError:     # a read-only or full home: the cache only saves time
        pass


def remember_artifact_sha256(path: str | os.PathLike, sha256: str) -> None:
    """Put the SHA-256 a writer computed of the file it just wrote into the cache (what ``computed`` stores)."""
    path = Path(path)
    _store_cached_hash(path.resolve(), path.stat(), sha256)


def artifact_sha256(path: str | os.PathLike, *, progress: bool = True, reuse: bool = True) -> tuple[str, str]:
    """``(hex SHA-256, where it came from)`` of a file (module doc: a ``.sha256`` sidecar, the cache, or read)."""
    from .io.atomic import sha256_file

    path = Path(path)
    st = path.stat()
    real = path.resolve()
    if reuse:
        recorded = recorded_sidecar_hash(path, st)
        if recorded is not None:
            return recorded, f"{path.name}.sha256"
        cached = cached_hash(real, st)
        if cached is not None:
            return cached, "cache"
    if progress and st.st_size >= PROGRESS_MIN_BYTES:
        from tqdm import tqdm

        with tqdm(total=st.st_size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"sha256 {path.name}",
                  file=sys.stderr, leave=False) as bar:
            sha = sha256_file(path, progress=bar.update)
    else:
        sha = sha256_file(path)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):   # not changed while read
        _store_cached_hash(real, st, sha)
    return sha, "computed"


def _artifact(path: str | os.PathLike, sha256: str | None, source_digest: str | None, progress: bool,
              reuse: bool) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return {"path": str(path), "kind": "directory", "size": size, "sha256": None, "source_digest": source_digest}
    size = path.stat().st_size
    if sha256 is not None:
        return {"path": str(path), "kind": "file", "size": size, "sha256": sha256, "sha256_from": "given"}
    sha, origin = artifact_sha256(path, progress=progress, reuse=reuse)
    return {"path": str(path), "kind": "file", "size": size, "sha256": sha, "sha256_from": origin}


def evidence(*, artifact: str | os.PathLike | None = None, sha256: str | None = None,
             source_digest: str | None = None, fixture: Mapping[str, Any] | None = None, device: str | None = None,
             dtype: str | None = None, threads: int | None = None, command: Sequence[str] | None = None,
             progress: bool = True, reuse_recorded_hash: bool = True) -> dict[str, Any]:
    """The evidence record of a result (module doc).

    ``artifact``: the file (or checkpoint directory) the result is about; ``sha256``: its hash when the caller
    already has it; ``source_digest``: a directory's identity; ``fixture``: the fixture record (its
    ``content_sha256`` is its identity); ``device``/``dtype``: what the model ran on and in (``None`` when nothing
    ran); ``threads``: default from the loaded compute library; ``command``: default ``sys.argv``."""
    count, origin = (threads, "caller") if threads is not None else _threads()
    return {"format": EVIDENCE_FORMAT, "version": EVIDENCE_VERSION, "tools": _versions(),
            "platform": platform.platform(), "device": device, "dtype": dtype, "threads": count,
            "threads_from": origin,
            "artifact": None if artifact is None else _artifact(artifact, sha256, source_digest, progress,
                                                                reuse_recorded_hash),
            "fixture": None if fixture is None else dict(fixture),
            "command": list(sys.argv if command is None else command)}
