"""The transport manifest: a JSON file beside the parts that says how they make up the file.

Format version :data:`MANIFEST_VERSION`; every key below MUST be present and no other key may be::

    {"format": "quantkit-transport",
     "version": 1,
     "kind": "bytes" | "gguf-split",
     "file": {"name": "<file name, no directory>", "size": <bytes>, "sha256": "<64 lowercase hex>"},
     "part_size": <the --part-size asked for, bytes>,
     "parts": [{"name": "<file name in the manifest's directory>", "size": <bytes>, "sha256": "<hex>"}, ...]}

``parts`` are listed in assembly order.  ``bytes``: the file is the parts concatenated (sizes sum to
``file.size``).  ``gguf-split``: the parts are llama.cpp split shards (``<stem>-00001-of-0000N.gguf``) and the
file is their merge: the first shard's metadata without the ``split.*`` keys, every shard's tensors in order,
laid out as ggml lays out a file; quantkit only writes such a manifest for a file that this merge reproduces
byte for byte, so ``file.sha256`` holds for both kinds.

Names are plain file names (no ``/``, not ``.`` or ``..``): a manifest cannot point outside its directory.  The
file is capped at :data:`MAX_MANIFEST_BYTES` before it is parsed and at :data:`MAX_PARTS` parts.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, MissingSourceError
from ..io import jsontext

MANIFEST_FORMAT = "quantkit-transport"
MANIFEST_VERSION = 1
KINDS = ("bytes", "gguf-split")
#: A manifest lists names and hashes; 64 MiB holds about 400,000 parts.  Checked before the JSON is parsed.
MAX_MANIFEST_BYTES = 64 << 20
#: More parts than any transport needs (a 1 PB file in 1 GB parts), small enough to list in memory.
MAX_PARTS = 1 << 20
MANIFEST_SUFFIX = ".transport.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = {"format", "version", "kind", "file", "part_size", "parts"}
_ENTRY_KEYS = {"name", "size", "sha256"}


@dataclass(frozen=True)
class Entry:
    """A file the manifest names: the whole file or one part."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    kind: str
    file: Entry
    part_size: int
    parts: tuple[Entry, ...]
    path: Path | None = None
    """Where the manifest was read from (its directory holds the parts)."""

    @property
    def directory(self) -> Path:
        return self.path.parent if self.path is not None else Path(".")

    def part_path(self, index: int) -> Path:
        return self.directory / self.parts[index].name

    def to_json(self) -> dict:
        return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "kind": self.kind,
                "file": self.file.to_json(), "part_size": self.part_size,
                "parts": [p.to_json() for p in self.parts]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    def identity(self) -> str:
        """SHA-256 of the manifest's content (not of its formatting): what a resume journal is tied to."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def manifest_name(file_name: str) -> str:
    return file_name + MANIFEST_SUFFIX


def is_manifest(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a JSON file that says it is a transport manifest (cheap: reads the first bytes)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4096)
    return b'"format"' in head and MANIFEST_FORMAT.encode() in head


def _plain_name(value, what: str, path: Path) -> str:
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", "..") \
            or "\0" in value:
        raise FormatError(f"{what} must be a plain file name (no directory), got {value!r}", path=path)
    return value


def _size(value, what: str, path: Path, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FormatError(f"{what} must be an integer ≥ {minimum}, got {value!r}", path=path)
    return value


def _entry(raw, what: str, path: Path) -> Entry:
    if not isinstance(raw, dict) or set(raw) != _ENTRY_KEYS:
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise FormatError(f"{what} must be an object with keys {sorted(_ENTRY_KEYS)}, got {found}", path=path)
    sha = raw["sha256"]
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise FormatError(f"{what} sha256 must be 64 lowercase hex digits, got {sha!r}", path=path)
    return Entry(_plain_name(raw["name"], f"{what} name", path), _size(raw["size"], f"{what} size", path), sha)


def load_manifest(path: str | os.PathLike, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Read and check a manifest (layers: size cap, JSON, exact key sets, field types, cross-field sums)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise MissingSourceError("transport manifest not found", path=path) from None
    if size > max_bytes:
        raise FormatError(f"manifest is {size} bytes, more than the limit of {max_bytes} (max_bytes)", path=path)
    try:
        raw = jsontext.loads(path.read_bytes())
    except ValueError as exc:   # UnicodeDecodeError and JSONDecodeError included
        raise FormatError(f"not a JSON transport manifest: {exc}", path=path) from None
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise FormatError(f"not a transport manifest: format is {found!r}, expected {MANIFEST_FORMAT!r}", path=path)
    version = raw.get("version")
    if type(version) is not int or version != MANIFEST_VERSION:   # True and 1.0 compare equal to 1
        raise FormatError(f"manifest version {version!r} is not supported; quantkit reads version "
                          f"{MANIFEST_VERSION}", path=path)
    if set(raw) != _TOP_KEYS:
        extra, missing = sorted(set(raw) - _TOP_KEYS), sorted(_TOP_KEYS - set(raw))
        raise FormatError(f"manifest keys differ from version {MANIFEST_VERSION}'s: unknown {extra}, missing "
                          f"{missing}", path=path)
    if raw["kind"] not in KINDS:
        raise FormatError(f"manifest kind {raw['kind']!r} is not one of {KINDS}", path=path)
    parts_raw = raw["parts"]
    if not isinstance(parts_raw, list) or not 1 <= len(parts_raw) <= MAX_PARTS:
        shown = len(parts_raw) if isinstance(parts_raw, list) else type(parts_raw).__name__
        raise FormatError(f"parts must be a list of 1 to {MAX_PARTS} entries, got {shown}", path=path)
    file = _entry(raw["file"], "file", path)
    parts = tuple(_entry(p, f"part {i + 1}", path) for i, p in enumerate(parts_raw))
    names: set[str] = set()
    for part in parts:
        if part.name in names:
            raise FormatError(f"part name {part.name!r} is listed twice", path=path)
        names.add(part.name)
    if file.name in names:
        raise FormatError(f"part name {file.name!r} is the file's own name", path=path)
    if raw["kind"] == "bytes" and sum(p.size for p in parts) != file.size:
        raise FormatError(f"part sizes sum to {sum(p.size for p in parts)} bytes, the file has {file.size}",
                          path=path)
    return Manifest(raw["kind"], file, _size(raw["part_size"], "part_size", path, 1), parts, path)
