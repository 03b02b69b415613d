"""Split a file into transport parts: byte ranges, or llama.cpp split shards of a GGUF file.

Both write each part under a temporary name (``<part>.partial``), hash while copying (the part's and the whole
file's SHA-256, in worker threads), and commit a complete part (``fdatasync``, rename, fsync of the directory) in
the background while the next one is copied (:class:`_Parts`); the manifest is written last, after every part is
committed, so a manifest on disk always describes complete, durable parts.

GGUF shards follow llama.cpp's ``gguf-split`` (``tools/gguf-split/gguf-split.cpp``): shard ``k`` of ``N`` is named
``<stem>-%05d-of-%05d.gguf`` (``k`` from 1); the first carries every metadata key of the file followed by
``split.no`` (UINT16, from 0), ``split.tensors.count`` (INT32, all shards' tensors) and ``split.count`` (UINT16), the
others only those three keys; tensors keep their order, each shard holding a run of whole tensors whose padded
payload bytes fit ``part_size`` (a larger tensor gets a shard of its own), payloads padded to 32 bytes.  The shards
are byte-identical to ``llama-gguf-split --split --split-max-size`` of the same size (tests/test_transport.py).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from gguf.constants import GGUFValueType

from ..errors import (FormatError, MissingSourceError, OutOfSpaceError, OutputExistsError, QuantkitError,
                      UnsupportedError)
from ..io.atomic import atomic_output, check_output, commit_partial, is_out_of_space, output_lock, same_file
from ..io.gguf import KV, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, align
from ..io.gguf_reader import GGUFFile
from ..io.gguf_writer import plan_layout, pwrite_all
from .manifest import MAX_PARTS, Entry, Manifest, load_manifest, manifest_name
from .stream import Syncer, copy_range, progress_bar

#: In llama.cpp's order: gguf-split sets ``split.count`` last (a placeholder replaced once the shards are counted,
#: and ggml's ``gguf_set_val`` moves a replaced key to the end).
SPLIT_KEYS = (SPLIT_NO, SPLIT_TENSORS_COUNT, SPLIT_COUNT)
#: llama.cpp pads shard payloads to GGUF_DEFAULT_ALIGNMENT whatever the file declares.
SPLIT_ALIGNMENT = 32
#: ``split.no`` and ``split.count`` are UINT16.
MAX_SHARDS = 0xFFFF


def _check_count(count: int, most: int, what: str, source: Path) -> None:
    """Before anything is written: a split its readers would refuse is a bad --part-size (exit 2)."""
    if count > most:
        raise QuantkitError(f"--part-size gives {count:,} {what} ({most:,}); use a larger part size", path=source)


def shard_name(stem: str, index: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: ``<stem>-%05d-of-%05d.gguf``, ``index`` from 0."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.gguf"


def byte_part_name(file_name: str, index: int, count: int) -> str:
    return f"{file_name}.part-{index + 1:05d}-of-{count:05d}"


def _check_outputs(out_dir: Path, names: list[str], source: Path, force: bool) -> None:
    for name in names:
        check_output(out_dir / name, inputs=[source], overwrite=force, what="transport part")


def _check_space(out_dir: Path, need: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise OutOfSpaceError(f"needs {need:,} bytes free for the parts, {free:,} available", path=out_dir)


#: Parts handed to the syncer and not yet renamed before the copying waits for them (each holds a file descriptor:
#: thousands of tiny parts ran out of them).
MAX_UNCOMMITTED_PARTS = 64


class _Parts:
    """The parts of one split being written: :meth:`create` opens ``<part>.partial``; :meth:`commit` hands a
    written part to the syncer's thread, which syncs its data, renames it to its name and fsyncs the directory while
    the next part is copied.  A failed commit is an ``OSError`` naming the part, raised at the next :meth:`commit` or at
    :meth:`finish`; leaving the ``with`` block removes every partial not committed."""

    def __init__(self, out_dir: Path, count: int, force: bool) -> None:
        self.out_dir, self.count, self.force = out_dir, count, force
        self.syncer = Syncer()
        self._fds: set[int] = set()
        self._partials: set[Path] = set()

    def __enter__(self) -> _Parts:
        return self

    def __exit__(self, *exc) -> None:
        self.syncer.__exit__(*exc)   # waits for the syncer's thread: what is left below is this thread's alone
        for fd in self._fds:
            os.close(fd)
        for partial in self._partials:
            partial.unlink(missing_ok=True)

    def create(self, name: str) -> int:
        final = self.out_dir / name
        if final.exists() and not self.force:
            raise OutputExistsError("output exists; refusing to replace it", path=final)
        partial = final.with_name(final.name + ".partial")
        partial.unlink(missing_ok=True)
        self._partials.add(partial)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.add(fd)
        return fd

    def commit(self, fd: int, index: int, name: str) -> None:
        self.syncer.forget(fd)
        self.syncer.then(self._commit, fd, index, self.out_dir / name)
        if len(self._fds) > MAX_UNCOMMITTED_PARTS:   # tiny parts outrun their syncs: each holds a descriptor
            self.syncer.drain()
        self.syncer.check()

    def _commit(self, fd: int, index: int, final: Path) -> None:
        partial = final.with_name(final.name + ".partial")
        try:
            self.syncer.sync(fd)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (syncing part {index + 1} of {self.count} to disk)",
                          str(partial)) from None
        finally:
            self._fds.discard(fd)
            os.close(fd)
        commit_partial(partial, final, overwrite=self.force)
        self._partials.discard(partial)

    def finish(self) -> None:
        self.syncer.drain()


def _write_manifest(out_dir: Path, manifest: Manifest, force: bool) -> Manifest:
    path = out_dir / manifest_name(manifest.file.name)
    with atomic_output(path, overwrite=force) as tmp:
        tmp.write_text(manifest.dumps())
    return Manifest(manifest.kind, manifest.file, manifest.part_size, manifest.parts, path)


def split_file(source: str | os.PathLike, out_dir: str | os.PathLike, part_size: int, *, gguf: bool | None = None,
               force: bool = False, progress: bool = False) -> Manifest:
    """Split ``source`` into ``out_dir``; ``gguf`` None: shards for a ``.gguf`` file, byte parts otherwise."""
    source, out_dir = Path(source), Path(out_dir)
    if gguf is None:
        gguf = source.suffix == ".gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        # one split into a directory per source name: a second run would share the parts' partial files, and each
        # would record its own hashes over the other's bytes
        with output_lock(out_dir / manifest_name(source.name)):
            previous = _previous_parts(out_dir / manifest_name(source.name)) if force else set()
            m = (split_gguf if gguf else split_bytes)(source, out_dir, part_size, force=force, progress=progress)
            _remove_stale_parts(out_dir, previous - {p.name for p in m.parts} - {m.path.name}, source)
            return m
    except OSError as exc:
        if is_out_of_space(exc):
            raise OutOfSpaceError(f"filesystem full while writing parts: {exc.strerror}", path=out_dir) from None
        raise


def _previous_parts(manifest_path: Path) -> set[str]:
    """The part names the manifest being replaced records (none when there is none, or it cannot be read)."""
    try:
        return {p.name for p in load_manifest(manifest_path).parts}
    except (MissingSourceError, FormatError):
        return set()


def _remove_stale_parts(out_dir: Path, names: set[str], source: Path) -> None:
    """Parts of the replaced set that the new set does not overwrite would lie beside it as if they belonged to it
    (another part count names other files); only files the old manifest recorded are removed, never the source."""
    for name in names:
        path = out_dir / name
        if path.is_file() and not same_file(path, source):
            path.unlink()


def split_bytes(source: Path, out_dir: Path, part_size: int, *, force: bool = False,
                progress: bool = False) -> Manifest:
    size = source.stat().st_size
    count = max(1, -(-size // part_size))
    _check_count(count, MAX_PARTS, "parts, more than a transport manifest holds", source)
    names = [byte_part_name(source.name, i, count) for i in range(count)]
    _check_outputs(out_dir, [*names, manifest_name(source.name)], source, force)
    _check_space(out_dir, size)
    whole = hashlib.sha256()
    parts = []
    with open(source, "rb") as src, progress_bar(size, progress, source.name) as bar, \
            _Parts(out_dir, count, force) as out:
        for i, name in enumerate(names):
            offset = i * part_size
            length = min(part_size, size - offset)
            digest = hashlib.sha256()
            fd = out.create(name)
            copy_range(src.fileno(), offset, length, fd, 0, [digest, whole], src_path=source, advance=bar.update,
                       syncer=out.syncer)
            out.commit(fd, i, name)
            parts.append(Entry(name, length, digest.hexdigest()))
        out.finish()
    manifest = Manifest("bytes", Entry(source.name, size, whole.hexdigest()), part_size, tuple(parts))
    return _write_manifest(out_dir, manifest, force)


def canonical_layout_problem(f: GGUFFile) -> str | None:
    """Why merging shards of ``f`` would not give back ``f`` byte for byte (None: it would): the header must be
    the one quantkit's writer plans for its metadata and tensors, payloads contiguous in declaration order with
    the last one padded, and the bytes between header and data zero."""
    problem = f.ggml_layout_problem()
    if problem:
        return problem
    planned = plan_layout(f.metadata, f.tensors.values())
    if planned.file_size != f.file_size:
        return f"the file has {f.file_size} bytes, ggml's layout of its tensors {planned.file_size}"
    with open(f.path, "rb") as raw:
        head = raw.read(f.data_offset)
    if head[:len(planned.header)] != planned.header or planned.data_offset != f.data_offset:
        return "its header is not encoded the way ggml and quantkit encode it"
    if head[len(planned.header):].strip(b"\0"):
        return "the padding after its header is not zero"
    return None


def _shard_runs(f: GGUFFile, part_size: int) -> list[list]:
    runs: list[list] = [[]]
    used = 0
    for t in f.tensors.values():
        padded = align(t.nbytes, SPLIT_ALIGNMENT)
        if runs[-1] and used + padded > part_size:
            runs.append([])
            used = 0
        runs[-1].append(t)
        used += padded
    return runs


def split_gguf(source: Path, out_dir: Path, part_size: int, *, force: bool = False,
               progress: bool = False) -> Manifest:
    with GGUFFile(source) as f:
        if SPLIT_COUNT in f.metadata:
            raise UnsupportedError(f"already a split shard ({SPLIT_COUNT} = {f.metadata[SPLIT_COUNT].value}); split "
                                   f"the merged file", path=source)
        if f.alignment != SPLIT_ALIGNMENT:
            raise UnsupportedError(f"alignment {f.alignment}: llama.cpp's split shards pad to {SPLIT_ALIGNMENT}; "
                                   f"split it as bytes (--bytes)", path=source)
        if not f.tensors:
            raise UnsupportedError("no tensors to split at; split it as bytes (--bytes)", path=source)
        problem = canonical_layout_problem(f)
        if problem:
            raise UnsupportedError(f"merging shards would not give back this file ({problem}); split it as bytes "
                                   f"(--bytes)", path=source)
        runs = _shard_runs(f, part_size)
        _check_count(len(runs), MAX_SHARDS, "shards, more than llama.cpp's split keys count", source)
        stem = source.name[:-len(".gguf")] if source.name.endswith(".gguf") else source.name
        names = [shard_name(stem, i, len(runs)) for i in range(len(runs))]
        _check_outputs(out_dir, [*names, manifest_name(source.name)], source, force)
        _check_space(out_dir, f.file_size + len(runs) * f.data_offset)
        whole = hashlib.sha256()
        parts = []
        with open(source, "rb") as src, progress_bar(f.file_size, progress, source.name) as bar, \
                _Parts(out_dir, len(runs), force) as out:
            copy_range(src.fileno(), 0, f.data_offset, None, 0, [whole], src_path=source, advance=bar.update)
            for i, (name, run) in enumerate(zip(names, runs)):
                split_keys = {SPLIT_NO: KV(i, GGUFValueType.UINT16),
                              SPLIT_TENSORS_COUNT: KV(len(f.tensors), GGUFValueType.INT32),
                              SPLIT_COUNT: KV(len(runs), GGUFValueType.UINT16)}
                layout = plan_layout({**f.metadata, **split_keys} if i == 0 else split_keys, run)
                start = f.data_offset + run[0].offset
                length = run[-1].offset + align(run[-1].nbytes, SPLIT_ALIGNMENT) - run[0].offset
                if layout.file_size != layout.data_offset + length:
                    raise FormatError(f"shard {name} plans {layout.file_size} bytes, its tensors span {length} bytes "
                                      f"after a {layout.data_offset}-byte header", path=source)
                head = layout.header + bytes(layout.data_offset - len(layout.header))
                digest = hashlib.sha256(head)
                fd = out.create(name)
                pwrite_all(fd, head, 0)
                copy_range(src.fileno(), start, length, fd, len(head), [digest, whole], src_path=source,
                           advance=bar.update, syncer=out.syncer)
                out.commit(fd, i, name)
                parts.append(Entry(name, layout.file_size, digest.hexdigest()))
            out.finish()
        manifest = Manifest("gguf-split", Entry(source.name, f.file_size, whole.hexdigest()), part_size, tuple(parts))
    return _write_manifest(out_dir, manifest, force)


__all__ = ["split_file", "split_bytes", "split_gguf", "shard_name", "byte_part_name"]
