"""Download files of a Hugging Face repository, resumably, verified against a transport manifest.

For each file: its metadata comes from the Hub (``huggingface_hub.get_hf_file_metadata``: size, ETag, commit,
final location after redirects) at ``HF_ENDPOINT`` (read at call time); the bytes come through
``huggingface_hub``'s ``http_get`` (its session, headers, token, retries, and ``Range`` resume after a dropped
connection) into ``<dir>/<file>.partial``, hashed while they arrive.  Beside the partial, ``<file>.fetch-journal``
records the ETag and commit it belongs to: a later run (after a kill, a reboot, a network failure) re-hashes the
partial and asks only for the rest (``Range: bytes=N-``); a partial of another ETag is discarded.  Then the size
and SHA-256 are checked against the manifest's entry for the file's name (the whole file or one of its parts): a
mismatch (also a body longer than the file's size) removes the partial and is refused naming the file
(:class:`CorruptDataError`, exit 1).  Only a verified file is renamed to ``<dir>/<file>``; a file already there
whose size and SHA-256 match the manifest is kept and not downloaded again, so rerunning an interrupted
multi-file fetch resumes it.

``hf_hub_download`` itself is not used: in huggingface_hub 2.x it downloads to a process-unique temporary file and
deletes it on failure, so a download interrupted with the process does not resume.  Files over 50 GB need the Xet
protocol through plain HTTP (``huggingface_hub`` refuses them): release parts of at most 49 GB avoid that.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import (CorruptDataError, MissingSourceError, OutOfSpaceError, OutputExistsError, SourceError,
                      UnsupportedError)
from ..io.atomic import HASH_CHUNK_BYTES, check_output, fsync_path, output_lock, sha256_file
from .manifest import Entry, Manifest, load_manifest

PARTIAL_SUFFIX = ".partial"
JOURNAL_SUFFIX = ".fetch-journal"


@dataclass
class Fetched:
    path: Path
    size: int
    sha256: str
    resumed_bytes: int
    verified: bool
    already_there: bool = False
    """Found complete under its name (size and SHA-256 as the manifest says): not downloaded."""


class _HashingFile:
    """The partial, as the file object ``http_get`` writes to: every byte written is hashed; a rewind (the server
    ignored the ``Range``) truncates the file and re-hashes what is left."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "ab", buffering=0)
        self.digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(HASH_CHUNK_BYTES):
                self.digest.update(block)
        self.position = self.file.tell()

    def write(self, data) -> int:
        self.file.write(data)
        self.digest.update(data)
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = 0) -> int:
        self.position = position
        return position

    def truncate(self, size: int | None = None) -> int:
        size = self.position if size is None else size
        self.file.truncate(size)
        self.digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            left = size
            while left and (block := f.read(min(HASH_CHUNK_BYTES, left))):
                self.digest.update(block)
                left -= len(block)
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.file.close()


def manifest_entries(m: Manifest) -> dict[str, Entry]:
    """Name → entry for every file a manifest describes: the whole file and each part."""
    return {e.name: e for e in (m.file, *m.parts)}


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def fetch_file(repo_id: str, filename: str, out_dir: Path, *, revision: str | None = None,
               expected: Entry | None = None, token: str | bool | None = None, force: bool = False,
               progress: bool = False) -> Fetched:
    """Download ``filename`` of ``repo_id`` to ``out_dir`` (see the module docstring)."""
    import httpx2
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    final = local_path(out_dir, filename)
    final.parent.mkdir(parents=True, exist_ok=True)
    if expected is not None and not force and final.is_file():
        return _already_there(final, expected)
    check_output(final, overwrite=force, what="downloaded file")
    # one download of a file at a time: a second run would share its partial and its journal
    with output_lock(final):
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        journal = final.with_name(final.name + JOURNAL_SUFFIX)
        where = f"{repo_id}/{filename}"
        url = hf_hub_url(repo_id, filename, revision=revision, endpoint=_endpoint())
        try:
            meta = get_hf_file_metadata(url, token=token, endpoint=_endpoint())
        except HfHubHTTPError as exc:
            status = getattr(exc.response, "status_code", None)
            kind = MissingSourceError if status in (401, 403, 404) else SourceError
            raise kind(f"the Hub answered {status}: {_first_line(exc)}", path=where) from None
        except httpx2.HTTPError as exc:
            raise SourceError(f"cannot reach the Hub at {url}: {exc}", path=where) from None
        if expected is not None and meta.size is not None and meta.size != expected.size:
            raise CorruptDataError(f"the repository's file is {meta.size:,} bytes, the manifest says {expected.size:,}: "
                                   f"not the file the manifest describes", path=where)
        identity = {"repo": repo_id, "file": filename, "etag": meta.etag, "commit": meta.commit_hash, "size": meta.size}
        try:
            resumable = json.loads(journal.read_text()) == identity and partial.is_file()
        except (OSError, ValueError):
            resumable = False
        if not resumable:
            partial.unlink(missing_ok=True)
            journal.write_text(json.dumps(identity))
        resumed = partial.stat().st_size if partial.exists() else 0
        if meta.size is not None and resumed > meta.size:
            partial.unlink()
            resumed = 0
        need = (meta.size or 0) - resumed
        free = shutil.disk_usage(final.parent).free
        if free < need:
            raise OutOfSpaceError(f"needs {need:,} bytes free to download {filename}, {free:,} available",
                                  path=final.parent)
        partial.touch()
        sink = _HashingFile(partial)
        try:
            http_get(meta.location, sink, resume_size=resumed, headers=build_hf_headers(token=token),
                     expected_size=meta.size, displayed_filename=final.name,
                     tqdm_class=None if progress else _silent_tqdm())
            os.fsync(sink.file.fileno())
        except ValueError as exc:   # huggingface_hub refuses plain-HTTP downloads over 50 GB (they need Xet)
            raise UnsupportedError(f"{_first_line(exc)} (transport parts of at most 49GB avoid this)", path=where) \
                from None
        except (httpx2.HTTPError, HfHubHTTPError, OSError) as exc:
            if isinstance(exc, OSError) and not isinstance(exc, HfHubHTTPError) and exc.errno is not None:
                raise   # a local file error (a full disk): the CLI names it
            if meta.size is None or sink.tell() <= meta.size:
                raise SourceError(f"download stopped after {sink.tell():,} of {meta.size or 0:,} bytes "
                                  f"({_first_line(exc)}); run the same command again to resume", path=where) from None
            # more bytes than the file has: a rerun would get them again, so they are refused below
        finally:
            sink.close()
        size, digest = partial.stat().st_size, sink.digest.hexdigest()
        if expected is not None and (size != expected.size or digest != expected.sha256):
            wanted = f"the manifest says {expected.size:,} bytes, {expected.sha256}"
        elif meta.size is not None and size != meta.size:
            wanted = f"the repository says the file has {meta.size:,} bytes"
        else:
            wanted = None
        if wanted is not None:
            partial.unlink()
            journal.unlink(missing_ok=True)
            raise CorruptDataError(f"downloaded {size:,} bytes with SHA-256 {digest}; {wanted}: refused (the partial "
                                   f"download was removed)", path=where)
        os.replace(partial, final)
        fsync_path(final.parent, directory=True)
        journal.unlink(missing_ok=True)
        return Fetched(final, size, digest, resumed, expected is not None)


def local_path(out_dir: Path, filename: str) -> Path:
    """Where repository file ``filename`` (a path inside the repository) is downloaded under ``out_dir``."""
    name = PurePosixPath(filename)
    if name.is_absolute() or ".." in name.parts:
        raise MissingSourceError(f"file name {filename!r} must be a path inside the repository", path=filename)
    return out_dir.joinpath(*name.parts)


def _already_there(final: Path, expected: Entry) -> Fetched:
    """``final`` exists: kept when it is the manifest's file (an earlier run finished it), refused otherwise."""
    size = final.stat().st_size
    digest = sha256_file(final) if size == expected.size else None
    if digest != expected.sha256:
        found = f"{size:,} bytes, SHA-256 {digest}" if digest else f"{size:,} bytes"
        raise OutputExistsError(f"downloaded file exists and is not the manifest's ({found}; the manifest says "
                                f"{expected.size:,} bytes, {expected.sha256}); refusing to replace it", path=final)
    return Fetched(final, size, digest, 0, True, already_there=True)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _silent_tqdm():
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def fetch(repo_id: str, filenames: list[str], out_dir: str | os.PathLike, *, manifest: str | None = None,
          revision: str | None = None, token: str | bool | None = None, force: bool = False,
          progress: bool = False, on_fetched: Callable[[Fetched], None] | None = None) -> list[Fetched]:
    """Download ``filenames``; with ``manifest`` (a local transport manifest, or the name of one in the
    repository, downloaded first, or found where an earlier run downloaded it unless ``revision`` names one:
    then it is downloaded again, as that revision's may differ) each is verified against its entry,
    and a name it does not list is refused before anything is downloaded.  ``on_fetched`` is called with each file
    as it is done (a later file may still fail)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Entry] = {}
    if manifest is not None:
        local = Path(manifest)
        if not local.is_file():
            local = local_path(out_dir, manifest)
            # one an earlier run saved is that run's revision's: a revision asked for is fetched again
            if not local.is_file() or force or revision is not None:
                local = fetch_file(repo_id, manifest, out_dir, revision=revision, token=token,
                                   force=force or local.is_file(), progress=progress).path
        entries = manifest_entries(load_manifest(local))
        unlisted = [f for f in filenames if PurePosixPath(f).name not in entries]
        if unlisted:
            raise MissingSourceError(f"{unlisted[0]!r} is not listed in the manifest (it lists "
                                     f"{', '.join(sorted(entries)[:5])}{', …' if len(entries) > 5 else ''})",
                                     path=local)
    fetched = []
    for f in filenames:
        fetched.append(fetch_file(repo_id, f, out_dir, revision=revision, expected=entries.get(PurePosixPath(f).name),
                                  token=token, force=force, progress=progress))
        if on_fetched is not None:
            on_fetched(fetched[-1])
    return fetched
